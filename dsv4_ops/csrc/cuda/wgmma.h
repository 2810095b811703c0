// Hopper warpgroup-MMA (wgmma) plumbing shared by the NVFP4 tile kernels and the prefill attention kernel (sm_90a
// PTX; no torch headers): fences, groups, shared-memory matrix descriptors.
#pragma once
#include <stdint.h>

namespace dsv4_cuda {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are written by the tensor cores behind the compiler's back: pin them after a wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Generic-proxy writes (st.shared, cp.async) before wgmma reads them through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared-memory matrix descriptor in 128-byte swizzle atoms (8 rows x 128 B, 1 KB aligned): start address, the
// leading and stride byte offsets (>> 4 in the descriptor). K-major operand: lbo unused (16), sbo = the stride
// between 8-row groups. MN-major (transposed) operand: lbo = the stride between 64-element columns along M / N,
// sbo = the stride between groups of 8 rows along K.
__device__ __forceinline__ uint64_t smem_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr & 0x3FFFFu) >> 4) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

}  // namespace dsv4_cuda

// Where row n's chunk c lives in a kernel-layout NVFP4 matrix [N, Kp/2] codes + [N, Kp/16] scale bytes
// (dsv4_model/nvfp4.py, layout version 2): the rows of every full 16-row tile are interleaved per 128-wide
// chunk, so one mma tile's chunk (16 rows x 64 B of codes, 16 x 8 B of scales) is contiguous -- a warp's
// chunk is one 1 KB stream instead of 16 64-byte pieces 2 KB apart (faster MoE and gemv: bench/RESULTS.md).
// Rows of a last partial tile (N % 16) stay row-major. Shared by the CPU and CUDA kernels.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define DSV4_LAYOUT_FN __host__ __device__ __forceinline__
#else
#define DSV4_LAYOUT_FN inline
#endif

namespace dsv4_nvfp4 {

struct RowAddr {
  size_t w, s;            // byte offsets of chunk 0 (codes, scales)
  uint32_t wstep, sstep;  // bytes from one chunk of the row to the next
};

DSV4_LAYOUT_FN RowAddr row_addr(int64_t n, int64_t N, int64_t kp) {
  const int64_t kp2 = kp / 2, kp16 = kp / 16;
  if (n < (N & ~int64_t(15))) {
    const int64_t t0 = n & ~int64_t(15), r = n & 15;
    return {size_t(t0 * kp2 + r * 64), size_t(t0 * kp16 + r * 8), 1024u, 128u};
  }
  return {size_t(n * kp2), size_t(n * kp16), 64u, 8u};
}

}  // namespace dsv4_nvfp4

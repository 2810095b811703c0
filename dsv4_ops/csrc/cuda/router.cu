// CUDA kernel of dsv4::router_topk (docs/ops.md "## Router"), sm_90a. No torch headers: router_bindings.cpp checks
// and allocates. One warp per row: each lane holds E / 32 experts as 64-bit keys (order key of score + bias, then
// the inverted expert index, so one unsigned max picks the largest value and, among equals, the lowest index);
// k rounds of a warp max select the experts. Replaces torch.topk's two kernels, the gather and the renormalising
// pointwise kernel of a decode step's router with one launch. Same order and arithmetic as the CPU kernel.
#include <cuda_runtime.h>
#include <stdint.h>

#include "pdl.h"

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;

// Unsigned key in the selection order: NaN above +inf, -0 == +0. Real values never map to 0 (0 marks "taken").
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v != v) return 0xFFFFFFFFu;
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <int EPL>  // experts per lane: E <= 32 * EPL
__global__ void __launch_bounds__(128) router_topk_kernel(const float* __restrict__ scores,
                                                         const float* __restrict__ bias, int64_t n, int E, int k,
                                                         int renormalize, float scale, float* __restrict__ weights,
                                                         int64_t* __restrict__ indices, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (r >= n) return;  // whole warps leave together
  const float* row = scores + r * E;
  uint64_t c[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    c[i] = 0;
    if (e < E) {
      const float v = bias != nullptr ? row[e] + bias[e] : row[e];
      c[i] = (uint64_t(order_key(v)) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(e));
    }
  }
  int mine = 0;  // lane j keeps the j-th selected expert
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < EPL; ++i) best = c[i] > best ? c[i] : best;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, best, o);
      best = other > best ? other : best;
    }
    const int e = int(0xFFFFFFFFu - uint32_t(best));
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (lane + 32 * i == e) c[i] = 0;
    if (j == lane) mine = e;
    sum = __fadd_rn(sum, row[e]);
  }
  if (lane < k) {
    const float w = renormalize ? __fdiv_rn(row[mine], sum) : row[mine];
    weights[r * k + lane] = __fmul_rn(w, scale);
    indices[r * k + lane] = mine;
  }
}

}  // namespace

// scores fp32 [n, E] (contiguous), bias fp32 [E] or null, 1 <= k <= 16, E <= 1024.
extern "C" cudaError_t dsv4_router_topk_launch(const float* scores, const float* bias, int64_t n, int E, int k,
                                               int renormalize, float scale, float* weights, int64_t* indices,
                                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (k < 1 || k > 16 || k > E || E > 1024) return cudaErrorInvalidValue;
  const unsigned grid = unsigned((n + 3) / 4);  // 4 rows (warps) per 128-thread block
  const bool pdl = decode_pdl();
  if (E <= 256)
    launch_ex(pdl, router_topk_kernel<8>, grid, dim3(128), 0, stream, scores, bias, n, E, k, renormalize,
              scale, weights, indices, int(pdl));
  else
    launch_ex(pdl, router_topk_kernel<32>, grid, dim3(128), 0, stream, scores, bias, n, E, k, renormalize,
              scale, weights, indices, int(pdl));
  return cudaGetLastError();
}

// CUDA kernel of dsv4::router_topk (docs/ops.md "## Router"), sm_90a. No torch headers: router_bindings.cpp checks
// and allocates. One warp per row: each lane holds E / 32 experts as 64-bit keys (order key of score + bias, then
// the inverted expert index, so one unsigned max picks the largest value and, among equals, the lowest index);
// k rounds of a warp max select the experts. Replaces torch.topk's two kernels, the gather and the renormalising
// pointwise kernel of a decode step's router with one launch (and with sqrt_softplus the score function's
// kernel before it). Same order and arithmetic as the CPU kernel.
#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.h"
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

// torch's fp32 F.softplus (beta 1, threshold 20: log1p(exp(x)) with CUDA's precise log1pf / expf, as its CUDA
// kernel) then sqrt (IEEE: no fast math in this build).
__device__ __forceinline__ float score_of(float x, int sqrt_softplus) {
  return sqrt_softplus ? sqrtf(x > 20.0f ? x : log1pf(expf(x))) : x;
}

template <int EPL>  // experts per lane: E <= 32 * EPL
__global__ void __launch_bounds__(128) router_topk_kernel(const float* __restrict__ scores,
                                                         const float* __restrict__ bias, int64_t n, int E, int k,
                                                         int renormalize, float scale, int sqrt_softplus,
                                                         float* __restrict__ weights, int64_t* __restrict__ indices,
                                                         int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (r >= n) return;  // whole warps leave together
  const float* row = scores + r * E;
  uint64_t c[EPL];
  float sc[EPL];  // the lane's unbiased scores: the winners' are fetched from their lane, not recomputed
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    c[i] = 0;
    sc[i] = 0.0f;
    if (e < E) {
      const float s = score_of(row[e], sqrt_softplus);
      sc[i] = s;
      const float v = bias != nullptr ? s + bias[e] : s;
      c[i] = (uint64_t(order_key(v)) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(e));
    }
  }
  int mine = 0;  // lane j keeps the j-th selected expert and its score
  float mine_s = 0.0f, sum = 0.0f;
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
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (lane + 32 * i == e) {
        c[i] = 0;
        s = sc[i];
      }
    }
    s = __shfl_sync(0xffffffffu, s, e & 31);
    if (j == lane) {
      mine = e;
      mine_s = s;
    }
    sum = __fadd_rn(sum, s);
  }
  if (lane < k) {
    const float w = renormalize ? __fdiv_rn(mine_s, sum) : mine_s;
    weights[r * k + lane] = __fmul_rn(w, scale);
    indices[r * k + lane] = mine;
  }
}

}  // namespace

// scores fp32 [n, E] (contiguous), bias fp32 [E] or null, 1 <= k <= 16, E <= 1024.
extern "C" cudaError_t dsv4_router_topk_launch(const float* scores, const float* bias, int64_t n, int E, int k,
                                               int renormalize, float scale, int sqrt_softplus, float* weights,
                                               int64_t* indices, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (k < 1 || k > 16 || k > E || E > 1024) return cudaErrorInvalidValue;
  const unsigned grid = unsigned((n + 3) / 4);  // 4 rows (warps) per 128-thread block
  const bool pdl = decode_pdl();
  if (E <= 256)
    launch_ex(pdl, router_topk_kernel<8>, grid, dim3(128), 0, stream, scores, bias, n, E, k, renormalize,
              scale, sqrt_softplus, weights, indices, int(pdl));
  else
    launch_ex(pdl, router_topk_kernel<32>, grid, dim3(128), 0, stream, scores, bias, n, E, k, renormalize,
              scale, sqrt_softplus, weights, indices, int(pdl));
  return cudaGetLastError();
}

// CUDA kernel of dsv4::compressor_decode (docs/ops.md "## Compressor decode"), sm_90a. No torch headers:
// compressor_bindings.cpp checks and allocates. One launch per compressor and decode step instead of the ~6
// kernels of the tensor-op form (state writes, the softmax pooling, the overlap shift, copies back).
// A CTA owns 32 columns d of one sequence b (and columns hd + d when windows overlap), so every state element is
// written and read by one CTA: the slot write, the pooling and the shift are ordered by __syncthreads, and T
// tokens of the sequence (rows t * S + b) advance it in order. Only a token that closes its window pools it (the
// model writes an entry only there: m - 1 of every m tokens just write their slot, pooled 0). Warp w pools state
// rows w, w + 8, ... with an online softmax; the 8 partials merge in warp order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "float_cast.h"
#include "launchers.h"
#include "pdl.h"

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;

constexpr int kCols = 32, kWarps = 8;

template <typename P, typename O>  // positions' and pooled's types
__global__ void __launch_bounds__(kCols* kWarps) compressor_decode_kernel(
    const float* __restrict__ kv, const float* __restrict__ score, const float* __restrict__ ape,
    const P* __restrict__ positions, float* kv_state, float* score_state, O* __restrict__ pooled, int C, int m,
    int R, int hd, int overlap, int by_pos, int seqs, int tokens, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  __shared__ float part[3][kWarps][kCols];  // running max, sum, weighted sum
  const int b = blockIdx.y, d0 = blockIdx.x * kCols, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int d = d0 + lane;
  for (int t = 0; t < tokens; ++t) {
    if (t) __syncthreads();  // the previous token's pooling and shift are done before this token's write
    const int64_t n = int64_t(t) * seqs + b;  // this token's row of kv / score / positions / pooled
    const int64_t p = int64_t(positions[n]);
    const int cm = overlap ? 2 * m : m;  // the rows pooled
    // shifted: the token at row (m if overlap) + r; by position: at row p mod R
    const int r = int(((p % m) + m) % m), slot = by_pos ? int(((p % R) + R) % R) : (overlap ? m : 0) + r;
    float* kb = kv_state + int64_t(b) * R * C;
    float* sb = score_state + int64_t(b) * R * C;
    if (warp < 1 + overlap && d < hd) {  // warp 0: columns d, warp 1: hd + d (overlap)
      const int k = warp * hd + d;
      kb[int64_t(slot) * C + k] = kv[n * C + k];
      sb[int64_t(slot) * C + k] = score[n * C + k] + ape[int64_t(r) * C + k];
    }
    const bool closes = ((p + 1) % m + m) % m == 0;
    if (!closes) {  // the window stays open: its entry is never used, pooled 0
      if (warp == 0 && d < hd) dsv4_cuda::store_one(pooled + n * hd + d, 0.0f);
      continue;  // (the shift happens only where a window closes; the next token's write waits at the barrier)
    }
    __syncthreads();
    float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
    if (d < hd) {
  #pragma unroll 4
      for (int j = warp; j < cm; j += kWarps) {
        // pooled row j: state row j (shifted) or the row of position p - cm + 1 + j (by position; below 0: unwritten)
        const int64_t q = p - cm + 1 + j;
        const bool none = by_pos && q < 0;
        const int64_t row = by_pos ? (none ? 0 : q % R) : j;
        const int64_t e = row * C + (overlap && j >= m ? hd : 0) + d;
        const float s = none ? -INFINITY : sb[e], v = none ? 0.0f : kb[e];
        const float nm = fmaxf(mx, s);
        // -inf scores (slots not yet written) weigh 0; the first finite score rescales the empty sums by 0
        const float a = mx == nm ? 1.0f : expf(mx - nm), w = s == -INFINITY ? 0.0f : expf(s - nm);
        sum = fmaf(sum, a, w);
        acc = fmaf(acc, a, v * w);
        mx = nm;
      }
    }
    part[0][warp][lane] = mx;
    part[1][warp][lane] = sum;
    part[2][warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && d < hd) {
      float M = part[0][0][lane];
  #pragma unroll
      for (int w = 1; w < kWarps; ++w) M = fmaxf(M, part[0][w][lane]);
      float S = 0.0f, A = 0.0f;
  #pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = part[0][w][lane];
        const float f = mw == -INFINITY ? 0.0f : expf(mw - M);  // a warp with no rows
        S = fmaf(part[1][w][lane], f, S);
        A = fmaf(part[2][w][lane], f, A);
      }
      dsv4_cuda::store_one(pooled + n * hd + d, A / S);  // rounded to-nearest-even to O
    }
    if (overlap && !by_pos) {  // closed: its rows become the previous window
      for (int e = threadIdx.x; e < m * 2 * kCols; e += blockDim.x) {
        const int j = e / (2 * kCols), c = e % (2 * kCols), dd = d0 + (c & (kCols - 1));
        if (dd >= hd) continue;
        const int64_t k = int64_t(c < kCols ? 0 : hd) + dd;
        kb[int64_t(j) * C + k] = kb[int64_t(m + j) * C + k];
        sb[int64_t(j) * C + k] = sb[int64_t(m + j) * C + k];
      }
    }
  }
}

template <typename O>
cudaError_t launch_out(const float* kv, const float* score, const float* ape, const void* positions, int pos_i32,
                       float* kv_state, float* score_state, O* pooled, int B, int C, int m, int R, int hd,
                       int overlap, int by_pos, int S, cudaStream_t stream) {
  const dim3 grid((hd + kCols - 1) / kCols, S);
  const int T = B / S;
  const bool pdl = decode_pdl();
  if (pos_i32)
    return launch_ex(pdl, compressor_decode_kernel<int32_t, O>, grid, dim3(kCols * kWarps), 0, stream, kv, score,
                     ape, static_cast<const int32_t*>(positions), kv_state, score_state, pooled, C, m, R, hd,
                     overlap, by_pos, S, T, int(pdl));
  return launch_ex(pdl, compressor_decode_kernel<int64_t, O>, grid, dim3(kCols * kWarps), 0, stream, kv, score,
                   ape, static_cast<const int64_t*>(positions), kv_state, score_state, pooled, C, m, R, hd, overlap,
                   by_pos, S, T, int(pdl));
}

}  // namespace

// kv / score fp32 [B, C], ape fp32 [m, C], positions int64 (pos_i32 = 0) or int32 [B], kv_state / score_state
// fp32 contiguous [>= B, R, C] (R = m, or 2m with overlap and C = 2 hd: shifted; by_pos: R larger, indexed by
// position), pooled [B, hd]: pooled_kind 0 fp32, 1 bf16, 2 fp16. kv_batch > 0 (a divisor of B): the rows are
// B / kv_batch tokens of kv_batch sequences, token-major, each advancing its sequence's state (row b) in order.
extern "C" cudaError_t dsv4_compressor_decode_launch(const float* kv, const float* score, const float* ape,
                                                     const void* positions, int pos_i32, float* kv_state,
                                                     float* score_state, void* pooled, int pooled_kind, int B, int C,
                                                     int m, int R, int hd, int overlap, int by_pos, int kv_batch,
                                                     cudaStream_t stream) {
  if (B == 0 || hd == 0) return cudaSuccess;
  const int S = kv_batch > 0 ? kv_batch : B;
  if (S > 65535 || B % S != 0) return cudaErrorInvalidValue;
  if (pooled_kind == 1)
    return launch_out(kv, score, ape, positions, pos_i32, kv_state, score_state,
                      static_cast<__nv_bfloat16*>(pooled), B, C, m, R, hd, overlap, by_pos, S, stream);
  if (pooled_kind == 2)
    return launch_out(kv, score, ape, positions, pos_i32, kv_state, score_state, static_cast<__half*>(pooled), B,
                      C, m, R, hd, overlap, by_pos, S, stream);
  return launch_out(kv, score, ape, positions, pos_i32, kv_state, score_state, static_cast<float*>(pooled), B, C,
                    m, R, hd, overlap, by_pos, S, stream);
}

// CUDA kernels of dsv4::hc_sinkhorn (docs/ops.md "## mHC"), sm_90a. No torch headers: mhc_bindings.cpp checks and
// allocates. The decode step's Sinkhorn is one launch instead of one per normalisation. The steps and their order
// are the CPU kernel's; exp is expf (<= 2 ulp from the CPU's), every other step an fp32 add / divide rounded as
// IEEE does (the hc <= 4 kernel's division: within an ulp where a value is subnormal).
//   hc <= 4 (V4): 16 lanes per matrix, one entry each; a row / column sum gathers its hc entries with shuffles
//     and adds them in index order. At decode there is one matrix per token, so the chain of 2 * iters
//     normalisations is the kernel's latency. H200, one matrix, 20 iterations: one thread per matrix 24 us (its
//     16 divisions per normalisation run back to back); a lane per entry with __fdiv_rn 6.6 us, with the
//     branch-free division below 2.6 us (the same bits on every tested input).
//   hc <= 8: one thread per matrix, all iterations in registers.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// Divides every row (ROWS) or column of c by its sum + eps; sums in index order.
template <int MAXHC, bool ROWS>
__device__ __forceinline__ void normalise(float (&c)[MAXHC][MAXHC], int hc, float eps) {
#pragma unroll
  for (int a = 0; a < MAXHC; ++a) {
    if (a >= hc) break;
    float s = 0.0f;
#pragma unroll
    for (int b = 0; b < MAXHC; ++b)
      if (b < hc) s = __fadd_rn(s, ROWS ? c[a][b] : c[b][a]);
    s = __fadd_rn(s, eps);
#pragma unroll
    for (int b = 0; b < MAXHC; ++b) {
      if (b < hc) {
        float& v = ROWS ? c[a][b] : c[b][a];
        v = __fdiv_rn(v, s);
      }
    }
  }
}

template <int MAXHC>  // hc <= MAXHC; the loops run to MAXHC so the matrix stays in registers
__global__ void __launch_bounds__(128) hc_sinkhorn_kernel(const float* __restrict__ x, float* __restrict__ y,
                                                          int64_t n, int hc, int iters, float eps) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const float* xm = x + t * hc * hc;
  float c[MAXHC][MAXHC];
#pragma unroll
  for (int i = 0; i < MAXHC; ++i) {
    if (i >= hc) break;
    float m = xm[i * hc];
#pragma unroll
    for (int j = 1; j < MAXHC; ++j)
      if (j < hc) m = fmaxf(m, xm[i * hc + j]);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXHC; ++j) {
      if (j < hc) {
        c[i][j] = expf(__fsub_rn(xm[i * hc + j], m));
        s = __fadd_rn(s, c[i][j]);
      }
    }
#pragma unroll
    for (int j = 0; j < MAXHC; ++j)
      if (j < hc) c[i][j] = __fadd_rn(__fdiv_rn(c[i][j], s), eps);
  }
  normalise<MAXHC, false>(c, hc, eps);
  for (int it = 1; it < iters; ++it) {
    normalise<MAXHC, true>(c, hc, eps);
    normalise<MAXHC, false>(c, hc, eps);
  }
  float* ym = y + t * hc * hc;
#pragma unroll
  for (int i = 0; i < MAXHC; ++i)
#pragma unroll
    for (int j = 0; j < MAXHC; ++j)
      if (i < hc && j < hc) ym[i * hc + j] = c[i][j];
}

// x / s for the values of this op (s = a sum + eps >= eps > 0, normal): the fast path of IEEE division (refined
// reciprocal, quotient, one residual correction), which is correctly rounded unless x or the quotient is
// subnormal (then within an ulp of it); __fdiv_rn adds a range check and a branch to a slow path on every call,
// which on this latency chain costs more than the arithmetic.
__device__ __forceinline__ float div_fast(float x, float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  r = fmaf(fmaf(-s, r, 1.0f), r, r);
  const float q = x * r;
  return fmaf(fmaf(-q, s, x), r, q);
}

// Sum, in index order, of the hc entries of this lane's row (ROWS) or column; lanes hold entry (i, j) at lane
// 4 * i + j of their 16-lane group (base = the group's first lane).
template <bool ROWS>
__device__ __forceinline__ float line_sum(float v, int base, int i, int j, int hc) {
  float s = 0.0f;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const float o = __shfl_sync(0xffffffffu, v, ROWS ? base + 4 * i + b : base + 4 * b + j);
    if (b < hc) s = __fadd_rn(s, o);
  }
  return s;
}

__global__ void __launch_bounds__(128) hc_sinkhorn_lanes_kernel(const float* __restrict__ x, float* __restrict__ y,
                                                                int64_t n, int hc, int iters, float eps) {
  const int lane = threadIdx.x & 31, base = lane & 16, e = lane & 15, i = e >> 2, j = e & 3;
  const int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 4;
  // every lane takes part in the shuffles; only entries of a real matrix are read and written
  const bool live = t < n && i < hc && j < hc;
  const float v = live ? x[t * hc * hc + i * hc + j] : -INFINITY;
  float m = v;
#pragma unroll
  for (int b = 0; b < 4; ++b) m = fmaxf(m, __shfl_sync(0xffffffffu, v, base + 4 * i + b));
  float c = live ? expf(__fsub_rn(v, m)) : 0.0f;
  c = __fadd_rn(div_fast(c, line_sum<true>(c, base, i, j, hc)), eps);
  c = div_fast(c, __fadd_rn(line_sum<false>(c, base, i, j, hc), eps));
  for (int it = 1; it < iters; ++it) {
    c = div_fast(c, __fadd_rn(line_sum<true>(c, base, i, j, hc), eps));
    c = div_fast(c, __fadd_rn(line_sum<false>(c, base, i, j, hc), eps));
  }
  if (live) y[t * hc * hc + i * hc + j] = c;
}

}  // namespace

extern "C" cudaError_t dsv4_hc_sinkhorn_launch(const float* x, float* y, int64_t n, int hc, int iters, float eps,
                                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (hc <= 4) {
    const unsigned grid = unsigned((n + 7) / 8);  // 8 matrices of 16 lanes per 128-thread block
    hc_sinkhorn_lanes_kernel<<<grid, 128, 0, stream>>>(x, y, n, hc, iters, eps);
  } else {
    hc_sinkhorn_kernel<8><<<unsigned((n + 127) / 128), 128, 0, stream>>>(x, y, n, hc, iters, eps);
  }
  return cudaGetLastError();
}

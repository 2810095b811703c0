// CUDA kernel of dsv4::hc_sinkhorn (docs/ops.md "## mHC"), sm_90a. No torch headers: mhc_bindings.cpp checks and
// allocates. One thread per token's hc x hc matrix, all iterations in registers: the decode step's Sinkhorn is
// one launch instead of one per normalisation. The steps and their order are the CPU kernel's; exp is expf
// (<= 2 ulp from the CPU's), every other step is an IEEE fp32 add / divide.
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

}  // namespace

extern "C" cudaError_t dsv4_hc_sinkhorn_launch(const float* x, float* y, int64_t n, int hc, int iters, float eps,
                                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = unsigned((n + 127) / 128);
  if (hc <= 4) hc_sinkhorn_kernel<4><<<grid, 128, 0, stream>>>(x, y, n, hc, iters, eps);
  else hc_sinkhorn_kernel<8><<<grid, 128, 0, stream>>>(x, y, n, hc, iters, eps);
  return cudaGetLastError();
}

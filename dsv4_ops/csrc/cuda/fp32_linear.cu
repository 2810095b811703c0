// CUDA GEMV of dsv4::fp32_linear for a few token rows (docs/ops.md "## fp32 linear"), sm_90a. No torch headers:
// fp32_linear_bindings.cpp checks, allocates and falls back to fp32 matmuls beyond what this kernel takes.
// At decode these projections (compressor wkv / wgate: 2 x 16 MB of fp32 weights per CSA layer; the mHC mixes:
// 24 rows x 16384) ran as cuBLAS fp32 GEMM / GEMV kernels, one launch each. Here one launch covers every matrix
// that reads the same x: a CTA owns R rows of one matrix over the whole K (no cross-CTA reduction, so the sums
// are deterministic), its threads take consecutive 16-byte pieces of the rows (coalesced), issue U pieces per row
// before using them, and reduce by shuffles then across warps in warp order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.h"
#include "pdl.h"

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;
using bf16 = __nv_bfloat16;

constexpr int kMaxSeg = 8;
constexpr int kMaxThreads = 512;

struct Fp32LinearParams {
  const void* x;
  int M, K;
  int nseg;
  const void* w[kMaxSeg];
  float* y[kMaxSeg];
  int n[kMaxSeg];
  int cta0[kMaxSeg];  // first CTA of each matrix
};

__device__ __forceinline__ uint4 ld_nc16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xFFFF0000u); }

// V = elements per 16-byte weight piece: 8 bf16 or 4 fp32.
template <typename WT>
struct Piece {
  static constexpr int V = 16 / sizeof(WT);
};

template <typename WT>
__device__ __forceinline__ void widen_w(uint4 u, float (&f)[Piece<WT>::V]) {
  if constexpr (sizeof(WT) == 2) {
    const uint32_t a[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = bf16_lo(a[i]);
      f[2 * i + 1] = bf16_hi(a[i]);
    }
  } else {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
  }
}

// V elements of x (bf16 or fp32) starting at p (aligned to V elements), widened.
template <typename XT, int V>
__device__ __forceinline__ void load_x(const XT* p, float (&f)[V]) {
  if constexpr (sizeof(XT) == 2) {
    if constexpr (V == 8) {
      widen_w<__nv_bfloat16>(__ldg(reinterpret_cast<const uint4*>(p)), f);
    } else {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      f[0] = bf16_lo(u.x);
      f[1] = bf16_hi(u.x);
      f[2] = bf16_lo(u.y);
      f[3] = bf16_hi(u.y);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p + i));
      f[i] = v.x;
      f[i + 1] = v.y;
      f[i + 2] = v.z;
      f[i + 3] = v.w;
    }
  }
}

// pdl: 0 launched without PDL; 1 with it (wait at the top, then let the successor launch); 2 beside the kernel
// before it (kBeside: that kernel triggered this launch at its start and reads the same, final, inputs): no wait
// before the work, the successor may launch at once, and a wait at the end of the last CTA, so that this grid
// completes only after its predecessor has (the successor's wait then covers both).
constexpr int kBeside = 2;

// R rows per CTA, MT = token rows the accumulators hold (M <= MT), U pieces per row in flight per thread.
template <int R, int MT, int U, typename WT, typename XT>
__global__ void __launch_bounds__(kMaxThreads) fp32_linear_kernel(const Fp32LinearParams p, int pdl) {
  if (pdl != kBeside) dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  constexpr int V = Piece<WT>::V;
  int seg = 0;
#pragma unroll
  for (int s = 1; s < kMaxSeg; ++s)
    if (s < p.nseg && int(blockIdx.x) >= p.cta0[s]) seg = s;
  const int N = p.n[seg], K = p.K, M = p.M;
  const int row0 = (int(blockIdx.x) - p.cta0[seg]) * R;
  const WT* __restrict__ w = static_cast<const WT*>(p.w[seg]);
  const XT* __restrict__ x = static_cast<const XT*>(p.x);
  const int pieces = K / V, step = int(blockDim.x);

  float acc[R][MT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.0f;

  for (int c0 = threadIdx.x; c0 < pieces; c0 += U * step) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * step;
#pragma unroll
      for (int r = 0; r < R; ++r)
        wv[u][r] = (c < pieces && row0 + r < N) ? ld_nc16(w + size_t(row0 + r) * K + size_t(c) * V)
                                                : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * step;
      if (c >= pieces) break;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= M) break;
        float xv[V];
        load_x<XT, V>(x + size_t(m) * K + size_t(c) * V, xv);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float wf[V];
          widen_w<WT>(wv[u][r], wf);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[r][m] = fmaf(wf[e], xv[e], acc[r][m]);
        }
      }
    }
  }

  __shared__ float part[kMaxThreads / 32][R * MT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = step >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float v = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[warp][r * MT + m] = v;
    }
  __syncthreads();
  const int t = threadIdx.x;
  if (t < R * MT) {
    const int r = t / MT, m = t % MT;
    if (m < M && row0 + r < N) {
      float s = 0.0f;
      for (int i = 0; i < warps; ++i) s += part[i][t];
      p.y[seg][size_t(m) * N + row0 + r] = s;
    }
  }
  // One CTA's wait suffices (the grid completes when its last CTA exits): the last one, which runs in the last
  // wave, so the earlier waves leave the SMs to the next as soon as their work is done.
  if (pdl == kBeside && blockIdx.x == gridDim.x - 1) dsv4_cuda::grid_dep_wait();
}

template <int R, int MT, int U>
cudaError_t launch_rmt(const Fp32LinearParams& p, int w_fp32, int x_fp32, int ctas, int threads, int beside,
                       cudaStream_t st) {
  const bool pdl = beside || decode_pdl();
  const int mode = beside ? kBeside : int(pdl);
  const dim3 grid(ctas), block(threads);
  if (w_fp32 && x_fp32) launch_ex(pdl, fp32_linear_kernel<R, MT, U, float, float>, grid, block, 0, st, p, mode);
  else if (w_fp32) launch_ex(pdl, fp32_linear_kernel<R, MT, U, float, bf16>, grid, block, 0, st, p, mode);
  else if (x_fp32) launch_ex(pdl, fp32_linear_kernel<R, MT, U, bf16, float>, grid, block, 0, st, p, mode);
  else launch_ex(pdl, fp32_linear_kernel<R, MT, U, bf16, bf16>, grid, block, 0, st, p, mode);
  return cudaGetLastError();
}

}  // namespace

// x [M, K] (bf16 or fp32, 16-byte aligned rows), w[i] [n[i], K] (all bf16 or all fp32, 16-byte aligned rows),
// y[i] fp32 [M, n[i]]. M in [1, 8], K a multiple of 8, nseg in [1, 8]. beside: the kernel enqueued just before
// this one lets it launch at its start and reads only what it reads (dsv4::nvfp4_fp32_linear_multi's gemv): run
// beside it (kBeside above). Returns the launch error.
extern "C" cudaError_t dsv4_fp32_linear_launch(const void* x, int x_fp32, int M, int K, const void* const* w,
                                               int w_fp32, float* const* y, const int* n, int nseg,
                                               int num_sms, int beside, cudaStream_t stream) {
  if (M < 1 || M > 8 || nseg < 1 || nseg > kMaxSeg) return cudaErrorInvalidValue;
  int rows = 0;
  for (int i = 0; i < nseg; ++i) rows += n[i];
  // 4 rows per CTA while that still gives 2 CTAs per SM, else one (the mHC mixes: 24 rows, long K).
  const int R = rows >= 8 * num_sms ? 4 : 1;
  Fp32LinearParams p{};
  p.x = x;
  p.M = M;
  p.K = K;
  p.nseg = nseg;
  int ctas = 0;
  for (int i = 0; i < nseg; ++i) {
    p.w[i] = w[i];
    p.y[i] = y[i];
    p.n[i] = n[i];
    p.cta0[i] = ctas;
    ctas += (n[i] + R - 1) / R;
  }
  if (ctas == 0) return cudaSuccess;
  // Few CTAs: wide ones, so that the whole weight is in flight at once.
  const int threads = ctas >= 2 * num_sms ? 256 : kMaxThreads;
  // The accumulators hold MT >= M token rows: the smallest of 1, 2, 4, 8 (a verification step's 2-4 rows would
  // otherwise carry 8 rows of registers and an unrolled loop sized for them).
  if (R == 4) {
    if (M == 1) return launch_rmt<4, 1, 2>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
    if (M == 2) return launch_rmt<4, 2, 2>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
    if (M <= 4) return launch_rmt<4, 4, 2>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
    return launch_rmt<4, 8, 2>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
  }
  // One row per CTA (the mHC mixes: 24 CTAs x 64 KB): 8 pieces per thread, the CTA's whole share in flight.
  if (M == 1) return launch_rmt<1, 1, 8>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
  if (M == 2) return launch_rmt<1, 2, 8>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
  if (M <= 4) return launch_rmt<1, 4, 4>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
  return launch_rmt<1, 8, 4>(p, w_fp32, x_fp32, ctas, threads, beside, stream);
}

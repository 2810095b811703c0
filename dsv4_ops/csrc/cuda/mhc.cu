// CUDA kernels of dsv4::hc_sinkhorn (docs/ops.md "## mHC"), sm_90a. No torch headers: mhc_bindings.cpp checks and
// allocates. The decode step's Sinkhorn is one launch instead of one per normalisation. The steps and their order
// are the CPU kernel's; exp is expf (<= 2 ulp from the CPU's), every other step an fp32 add / divide rounded as
// IEEE does (the hc <= 4 kernel's division: within an ulp where a value is subnormal).
//   hc <= 4 (V4): 16 lanes per matrix, one entry each; a row / column sum gathers its hc entries with shuffles
//     and adds them in index order. At decode there is one matrix per token, so the chain of 2 * iters
//     normalisations is the kernel's latency. One thread per matrix (its 16 divisions per normalisation run
//     back to back) and a lane per entry with __fdiv_rn were both slower than a lane per entry with the
//     branch-free division below (the same bits on every tested input; bench/RESULTS.md).
//   hc <= 8: one thread per matrix, all iterations in registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "float_cast.h"
#include "launchers.h"
#include "pdl.h"

#include <algorithm>

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;

using dsv4_cuda::load_one;
using dsv4_cuda::round_to;
using dsv4_cuda::store_one;

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

// The Sinkhorn of one matrix held by a 16-lane group (entry (i, j) at lane 4 * i + j; every lane of the warp
// calls this, entries of no real matrix pass live = false): returns the lane's entry of the mixing matrix.
__device__ __forceinline__ float sinkhorn_lanes(float v, bool live, int lane, int hc, int iters, float eps) {
  const int base = lane & 16, e = lane & 15, i = e >> 2, j = e & 3;
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
  return c;
}

__global__ void __launch_bounds__(128) hc_sinkhorn_lanes_kernel(const float* __restrict__ x, float* __restrict__ y,
                                                                int64_t n, int hc, int iters, float eps) {
  const int lane = threadIdx.x & 31, e = lane & 15, i = e >> 2, j = e & 3;
  const int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 4;
  // every lane takes part in the shuffles; only entries of a real matrix are read and written
  const bool live = t < n && i < hc && j < hc;
  const float v = live ? x[t * hc * hc + i * hc + j] : -INFINITY;
  const float c = sinkhorn_lanes(v, live, lane, hc, iters, eps);
  if (live) y[t * hc * hc + i * hc + j] = c;
}

// ------------------------------------------------------------------------------------------------- hc_pre
// Two launches per call (docs/ops.md "## mHC"). partial: CTA s takes k in [s * kHcChunk, + kHcChunk) of the
// flattened streams (hc * d) for every token: the 24 dot products with fn's rows (warp w: rows w, w + 8, ...;
// lane: 4 consecutive k) and the sum of squares, each reduced over the warp by a fixed shuffle tree, into
// ws [nsplit, T, mix + 1]. finish: a CTA per token sums the splits in order, applies rs, the sigmoids and the
// Sinkhorn (16 lanes of warp 0), then y = sum_h pre_h x_h rounded to x's dtype and, with a norm weight, the
// sublayer's RMSNorm of y (block reduction in a fixed order). The reference sums in another order: fp32 rounding.
// Both kernels issue their weight / stream loads first: at decode (one token) each is a single CTA's or a
// single wave's latency chain. A finish kernel that loaded x after the Sinkhorn, 4 bytes per thread and iteration,
// made the op slower than the unfused steps; 16-byte loads issued up front beat both (bench_hc_pre.py,
// bench/RESULTS.md).
constexpr int kHcChunk = 128;
constexpr int kHcMaxTokens = 16;
constexpr int kHcMaxMix = 24;     // (2 + hc) * hc for hc <= 4
constexpr int kHcRowsPerWarp = 4;  // partial: warp w takes m = w + 8 r, r < 4, covering m <= mix (24)

__device__ __forceinline__ float4 load4_f(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4_f(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xFFFF0000u));
}

// 16 bytes of x's dtype <-> floats (V = 16 / sizeof(T) of them)
__device__ __forceinline__ void unpack16(uint4 u, float (&f)[4], float*) {
  f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y); f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack16(uint4 u, float (&f)[8], __nv_bfloat16*) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);
    f[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void unpack16(uint4 u, float (&f)[8], __half*) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    __half2 h;
    memcpy(&h, &w[k], 4);
    const float2 v = __half22float2(h);
    f[2 * k] = v.x;
    f[2 * k + 1] = v.y;
  }
}
__device__ __forceinline__ uint4 pack16(const float (&f)[4], float*) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
}
template <typename T2, typename F>
__device__ __forceinline__ uint4 pack16_pairs(const float (&f)[8], F cvt) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const T2 h = cvt(make_float2(f[2 * k], f[2 * k + 1]));
    memcpy(&w[k], &h, 4);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint4 pack16(const float (&f)[8], __nv_bfloat16*) {
  return pack16_pairs<__nv_bfloat162>(f, [](float2 v) { return __float22bfloat162_rn(v); });
}
__device__ __forceinline__ uint4 pack16(const float (&f)[8], __half*) {
  return pack16_pairs<__half2>(f, [](float2 v) { return __float22half2_rn(v); });
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// hc_post_pre: the streams x are first made from the previous sublayer's output (hc_post): x[t, j, k] =
// post[t, j] * out[t, k] + sum_i comb[t, i, j] * res[t, i, k] (fp32, the unfused order), rounded to TX; each CTA
// writes its chunk of x for the finish kernel and the caller. With ids, out[t, k] is itself summed from the MoE's
// uncombined rows (the combine kernel this replaces: one launch less per layer at decode).
template <typename TX>
struct HcPostIn {
  const TX* out;  // null: plain hc_pre (x is read)
  const TX* res;
  const float* post;
  const float* comb;
  // null: out is [T, d]; else int32 / int64 (ids64) [T, k] and out the rows [T*k (+ T if shared), d]
  const void* ids;
  int ids64, k, experts, shared;
};

// out[t, kd] from the rows as nvfp4_moe_combine_kernel forms it, bit for bit: fp32 from 0, slot j's row where
// its id is in [0, experts) (no other row is read: the expert kernels leave it unwritten), j in order, then the
// shared row, rounded once to TX. The ids are written by the step's router: the caller has passed the PDL wait.
// Slots go in groups of 8 so that a token's ids, then its rows, are in flight together (one slot per trip cost the
// op much of what dropping the combine kernel saved: bench/RESULTS.md).
template <typename TX>
__device__ __forceinline__ float moe_rows_value(const HcPostIn<TX>& pi, int t, int T, int d, int kd) {
  constexpr int G = 8;
  const float sh = pi.shared ? load_one(pi.out + (int64_t(T) * pi.k + t) * d + kd) : 0.0f;
  float acc = 0.0f;
  const int64_t slot0 = int64_t(t) * pi.k;
  for (int j0 = 0; j0 < pi.k; j0 += G) {
    bool ok[G];
    float v[G];
#pragma unroll
    for (int u = 0; u < G; ++u) {
      const int64_t s = slot0 + j0 + u;
      int64_t e = -1;
      if (j0 + u < pi.k)
        e = pi.ids64 ? static_cast<const int64_t*>(pi.ids)[s] : int64_t(static_cast<const int*>(pi.ids)[s]);
      ok[u] = e >= 0 && e < pi.experts;
    }
#pragma unroll
    for (int u = 0; u < G; ++u) v[u] = ok[u] ? load_one(pi.out + (slot0 + j0 + u) * d + kd) : 0.0f;
#pragma unroll
    for (int u = 0; u < G; ++u)
      if (ok[u]) acc = __fadd_rn(acc, v[u]);
  }
  if (pi.shared) acc = __fadd_rn(acc, sh);
  return round_to(acc, static_cast<const TX*>(nullptr));
}

template <typename TX>
__device__ __forceinline__ float hc_post_value(const HcPostIn<TX>& pi, int t, int T, int hc, int d, int kk) {
  const int j = kk / d, k = kk - j * d;
  const float* c = pi.comb + int64_t(t) * hc * hc;
  float s = 0.0f;
  for (int i = 0; i < hc; ++i)
    s = __fadd_rn(s, __fmul_rn(c[i * hc + j], load_one(pi.res + (int64_t(t) * hc + i) * d + k)));
  const float o = pi.ids == nullptr ? load_one(pi.out + int64_t(t) * d + k) : moe_rows_value(pi, t, T, d, k);
  return __fadd_rn(__fmul_rn(pi.post[int64_t(t) * hc + j], o), s);
}

template <typename TX, typename TW>
__global__ void __launch_bounds__(256) hc_pre_partial_kernel(TX* x, const TW* __restrict__ fn, int T, int K, int mix,
                                                             float* __restrict__ ws, const HcPostIn<TX> pi, int d,
                                                             int pdl) {
  __shared__ __align__(16) float xs[kHcMaxTokens][kHcChunk];
  const int s = blockIdx.x, k0 = s * kHcChunk, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kl = 4 * lane, k = k0 + kl;  // K % 4 == 0: a lane's 4 k are all in range or all out
  // fn is a weight, written by no kernel of the step: its loads go out before the PDL wait, under the
  // predecessor's tail (these CTAs fit beside a gemv's, unlike a 16-CTA cluster of the whole call, which was
  // faster alone at batch 1 and no faster in a layer: it could start only once a GPC had drained; bench/RESULTS.md).
  float4 w[kHcRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kHcRowsPerWarp; ++r) {
    const int m = warp + 8 * r;
    w[r] = m < mix && k < K ? load4_f(fn + int64_t(m) * K + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  for (int e = threadIdx.x; e < T * kHcChunk; e += blockDim.x) {
    const int t = e / kHcChunk, kk = k0 + e % kHcChunk;
    float v = 0.0f;
    if (kk < K) {
      if (pi.out == nullptr) {
        v = load_one(x + int64_t(t) * K + kk);
      } else {
        v = round_to(hc_post_value(pi, t, T, K / d, d, kk), static_cast<TX*>(nullptr));
        store_one(x + int64_t(t) * K + kk, v);
      }
    }
    xs[t][e % kHcChunk] = v;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kHcRowsPerWarp; ++r) {
    const int m = warp + 8 * r;  // m == mix: the sum of squares
    if (m > mix) break;
    for (int t = 0; t < T; ++t) {
      const float4 xv = *reinterpret_cast<const float4*>(&xs[t][kl]);
      const float4 wr = w[r];
      float v;
      if (m < mix)
        v = fmaf(wr.w, xv.w, fmaf(wr.z, xv.z, fmaf(wr.y, xv.y, wr.x * xv.x)));
      else
        v = fmaf(xv.w, xv.w, fmaf(xv.z, xv.z, fmaf(xv.y, xv.y, xv.x * xv.x)));
      v = warp_sum(v);
      if (lane == 0) ws[(int64_t(s) * T + t) * (mix + 1) + m] = v;
    }
  }
}

// d % V == 0 (V = 16 / sizeof(TX) elements per 16-byte vector). Warp 0 runs the Sinkhorn (a chain of 40
// dependent normalisations) while warps 1.. compute y and its norm, which need only pre: thread 32 + i takes
// vectors i, i + (blockDim - 32), ...
template <typename TX>
__global__ void __launch_bounds__(1024) hc_pre_finish_kernel(
    const TX* __restrict__ x, const float* __restrict__ ws, int nsplit, int T, int hc, int d, int mix,
    const float* __restrict__ scale, const float* __restrict__ base, const float* __restrict__ norm_w, int iters,
    float hc_eps, float norm_eps, float out_eps, TX* __restrict__ y, float* __restrict__ post,
    float* __restrict__ comb, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  constexpr int V = 16 / sizeof(TX);
  extern __shared__ __align__(16) float ybuf[];  // [d]: y rounded to x's dtype
  __shared__ float red[kHcMaxMix + 1];
  __shared__ float wsum[32];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int K = hc * d, nvec = d / V, v0 = int(threadIdx.x) - 32, vstep = int(blockDim.x) - 32;
  const TX* xt = x + int64_t(t) * K;
  // The thread's first vector of x and of the norm weight, in flight during the split sums.
  uint4 x0[4] = {};
  float w0[V] = {};
  if (v0 >= 0 && v0 < nvec) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (i < hc) x0[i] = __ldg(reinterpret_cast<const uint4*>(xt + int64_t(i) * d) + v0);
    if (norm_w != nullptr) {
#pragma unroll
      for (int q = 0; q < V / 4; ++q) {
        const float4 n = __ldg(reinterpret_cast<const float4*>(norm_w + v0 * V) + q);
        w0[4 * q] = n.x; w0[4 * q + 1] = n.y; w0[4 * q + 2] = n.z; w0[4 * q + 3] = n.w;
      }
    }
  }
  for (int v = warp; v <= mix; v += nwarps) {  // splits in order per lane, then a fixed shuffle tree
    float a = 0.0f;
    for (int sp = lane; sp < nsplit; sp += 32) a += ws[(int64_t(sp) * T + t) * (mix + 1) + v];
    a = warp_sum(a);
    if (lane == 0) red[v] = a;
  }
  __syncthreads();
  const float rs = 1.0f / sqrtf(__fadd_rn(red[mix] / float(K), norm_eps));
  if (warp == 0) {
    if (lane < hc) post[int64_t(t) * hc + lane] = 2.0f / (1.0f + expf(-fmaf(red[hc + lane] * rs, scale[1],
                                                                             base[hc + lane])));
    const int e = lane & 15, i = e >> 2, j = e & 3;
    const bool live = lane < 16 && i < hc && j < hc;
    const int c = 2 * hc + i * hc + j;
    const float v = live ? fmaf(red[c] * rs, scale[2], base[c]) : -INFINITY;
    const float r = sinkhorn_lanes(v, live, lane, hc, iters, hc_eps);
    if (live) comb[(int64_t(t) * hc + i) * hc + j] = r;
    return;
  }
  float pre[4];  // every thread evaluates the same expressions: no barrier to share them
#pragma unroll
  for (int i = 0; i < 4; ++i)
    pre[i] = i < hc ? 1.0f / (1.0f + expf(-fmaf(red[i] * rs, scale[0], base[i]))) + hc_eps : 0.0f;
  TX* yt = y + int64_t(t) * d;
  float ss = 0.0f;
  for (int v = v0; v < nvec; v += vstep) {
    float a[V] = {};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i >= hc) break;
      float f[V];
      unpack16(v == v0 ? x0[i] : __ldg(reinterpret_cast<const uint4*>(xt + int64_t(i) * d) + v), f,
               static_cast<TX*>(nullptr));
#pragma unroll
      for (int e = 0; e < V; ++e) a[e] = fmaf(pre[i], f[e], a[e]);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) {
      a[e] = round_to(a[e], static_cast<TX*>(nullptr));
      ss = fmaf(a[e], a[e], ss);
    }
    if (norm_w == nullptr) {
      reinterpret_cast<uint4*>(yt)[v] = pack16(a, static_cast<TX*>(nullptr));
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) ybuf[v * V + e] = a[e];
    }
  }
  if (norm_w == nullptr) return;
  ss = warp_sum(ss);
  if (lane == 0) wsum[warp] = ss;
  asm volatile("bar.sync 1, %0;" ::"r"(vstep) : "memory");  // warps 1.. only
  float tot = 0.0f;
  for (int w = 1; w < nwarps; ++w) tot += wsum[w];
  const float rs2 = 1.0f / sqrtf(__fadd_rn(tot / float(d), out_eps));
  for (int v = v0; v < nvec; v += vstep) {
    float o[V];
#pragma unroll
    for (int e = 0; e < V; ++e) o[e] = (v == v0 ? w0[e] : __ldg(norm_w + v * V + e)) * (ybuf[v * V + e] * rs2);
    reinterpret_cast<uint4*>(yt)[v] = pack16(o, static_cast<TX*>(nullptr));
  }
}

template <typename TX, typename TW>
cudaError_t hc_pre_launch_t(void* x, const void* fn, const float* scale, const float* base, const float* norm_w,
                            int T, int hc, int d, int iters, float hc_eps, float norm_eps, float out_eps, float* ws,
                            int nsplit, void* y, float* post, float* comb, const void* p_out, const void* p_res,
                            const float* p_post, const float* p_comb, const void* p_ids, int ids64, int slots,
                            int experts, int shared, cudaStream_t stream) {
  const int K = hc * d, mix = (2 + hc) * hc;
  const HcPostIn<TX> pi{static_cast<const TX*>(p_out), static_cast<const TX*>(p_res), p_post, p_comb, p_ids, ids64,
                        slots, experts, shared};
  const bool pdl = decode_pdl();
  launch_ex(pdl, hc_pre_partial_kernel<TX, TW>, dim3(nsplit), dim3(256), 0, stream, static_cast<TX*>(x),
            static_cast<const TW*>(fn), T, K, mix, ws, pi, d, int(pdl));
  const size_t smem = norm_w != nullptr ? size_t(d) * sizeof(float) : 0;
  if (smem > 40 * 1024) {  // with the static arrays past the 48 KB default
    const cudaError_t e = cudaFuncSetAttribute(hc_pre_finish_kernel<TX>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  // warp 0 + one vector per thread where d allows (V4-Flash / Pro bf16: 32 + 512 / 896 threads)
  const int nvec = d / int(16 / sizeof(TX));
  const int threads = 32 + std::min(std::max((nvec + 31) / 32 * 32, 64), 992);
  launch_ex(pdl, hc_pre_finish_kernel<TX>, dim3(T), dim3(threads), smem, stream, static_cast<const TX*>(x), ws,
            nsplit, T, hc, d, mix, scale, base, norm_w, iters, hc_eps, norm_eps, out_eps, static_cast<TX*>(y), post,
            comb, int(pdl));
  return cudaGetLastError();
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

// hc_pre's kernels (hc <= 4, T <= 16 tokens, d % 8 == 0, d <= 12288; x, fn, norm_w 16-byte aligned): x_kind 0
// bf16 / 1 fp16 / 2 fp32, fn_bf16: fn held in bf16 (else fp32). ws: fp32 [nsplit, T, (2 + hc) * hc + 1], nsplit
// = dsv4_hc_pre_splits. hc_post_pre: p_out [T, d] / p_res [T, hc, d] (x's dtype), p_post fp32 [T, hc], p_comb fp32
// [T, hc, hc]; x is then an output (the new streams); p_out null: plain hc_pre, x read. p_ids (int32, or int64
// where ids64) [T, slots]: p_out is instead the MoE's rows [T * slots (+ T where shared), d], summed per token
// over the slots whose id is in [0, experts) (then the shared row); null: p_out [T, d].
extern "C" int dsv4_hc_pre_splits(int hc, int d) { return (hc * d + kHcChunk - 1) / kHcChunk; }

extern "C" cudaError_t dsv4_hc_pre_launch(void* x, int x_kind, const void* fn, int fn_bf16, const float* scale,
                                          const float* base, const float* norm_w, int T, int hc, int d, int iters,
                                          float hc_eps, float norm_eps, float out_eps, float* ws, void* y,
                                          float* post, float* comb, const void* p_out, const void* p_res,
                                          const float* p_post, const float* p_comb, const void* p_ids, int ids64,
                                          int slots, int experts, int shared, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  if (hc > 4 || T > kHcMaxTokens || d % 8 != 0 || d > 12288) return cudaErrorInvalidValue;
  const int nsplit = dsv4_hc_pre_splits(hc, d);
#define DSV4_HC_PRE(TX)                                                                                           \
  return fn_bf16 ? hc_pre_launch_t<TX, __nv_bfloat16>(x, fn, scale, base, norm_w, T, hc, d, iters, hc_eps,      \
                                                      norm_eps, out_eps, ws, nsplit, y, post, comb, p_out,      \
                                                      p_res, p_post, p_comb, p_ids, ids64, slots, experts,      \
                                                      shared, stream)                                           \
                 : hc_pre_launch_t<TX, float>(x, fn, scale, base, norm_w, T, hc, d, iters, hc_eps, norm_eps,     \
                                              out_eps, ws, nsplit, y, post, comb, p_out, p_res, p_post, p_comb, \
                                              p_ids, ids64, slots, experts, shared, stream)
  if (x_kind == 0) DSV4_HC_PRE(__nv_bfloat16);
  if (x_kind == 1) DSV4_HC_PRE(__half);
  DSV4_HC_PRE(float);
#undef DSV4_HC_PRE
}

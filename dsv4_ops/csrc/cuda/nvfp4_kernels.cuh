// What the NVFP4 weight kernels share (nvfp4_gemm.cu: MoE routing / host side, nvfp4_skinny.cu,
// nvfp4_tiled.cu, nvfp4_gemv.cu): the launch parameters and the launchers each kernel file defines (namespace
// dsv4_nvfp4), and the device helpers (weight / scale decode, routing, epilogue, cp.async) in an anonymous
// namespace, so every translation unit keeps its own private copy as when they were one file. Layout and
// exactness argument: nvfp4_gemm.cu's file comment.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "nvfp4_gemm.h"
#include "nvfp4_mma.cuh"
#include "pdl.h"

namespace dsv4_nvfp4 {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// ------------------------------------------------------------------------------ gemv / skinny launch parameters
enum Mode { kDense = 0, kMoeUp = 1, kMoeDown = 2 };

struct SkinnyParams {
  // dense
  const bf16* x;
  void* y;
  int out_kind;
  const float* gs_act;
  int M;
  int G;  // dense: groups of nvfp4_linear_grouped (1: a plain linear); group = blockIdx.y
  int nseg;  // dense: > 0 = nvfp4_linear_multi, segment = blockIdx.y (seg_* replace w, s, g, y, N)
  const uint8_t* seg_w[kNvfp4MaxSegments];
  const uint8_t* seg_s[kNvfp4MaxSegments];
  const float* seg_g[kNvfp4MaxSegments];
  void* seg_y[kNvfp4MaxSegments];
  int seg_n[kNvfp4MaxSegments];
  // dense matrix, or the stacked routed experts of this projection ([E, N, Kp/2])
  const uint8_t* w;
  const uint8_t* s;
  const float* g;  // dense: 1 value; MoE: [E]
  int N, K;
  // shared expert of this projection
  const uint8_t* sw;
  const uint8_t* ss;
  const float* sg;
  int sN, sK;
  // MoE routing (route = counts[E], offsets[E], active[E], num_active, sorted assignments[T*k]).
  // blockIdx.y: slots [0, n_sslots) = the shared expert, s_chunk tokens each (first, so its CTAs start
  // early); then n_rslots routed slots (active expert i = slot - n_sslots).
  // local_route: T*k <= kLocalRouteMax and no route kernel; each routed CTA derives its expert and assignments
  // from ids itself (local_route()).
  const int* route;
  const void* ids;
  int ids64, local_route;
  int E, topk, T, n_rslots, n_sslots, s_chunk;
  const bf16* in;         // B rows: up = x [T, d]; down = routed h [T*k, I]
  const bf16* in_shared;  // down: shared h [T, Is]
  bf16* out;              // up: routed h; down: o rows [T*k, d]
  bf16* out_shared;       // up: shared h; down: o rows T*k.. (shared)
  const float* wts;
  float limit;
  int kw, rt;  // warps splitting K per row tile, row tiles per CTA (kw * rt = 8)
  int pdl;     // launched with programmatic dependent launch
  int trigger_now;  // dense gemv: let the next kernel launch as soon as this CTA may read its inputs (a kernel that
                    // runs beside it, dsv4::nvfp4_fp32_linear_multi), not after its last pass
};


// ------------------------------------------------------------------------------------ tiled launch parameters
struct TiledParams {
  const bf16* x;
  const uint8_t* w;
  const uint8_t* s;
  const float* gs;
  const float* gs_act;
  void* y;
  int out_kind;
  int M, N, K;
  // G > 1: nvfp4_linear_grouped (wgmma only): x [M, G, K], y [M, G, N], the stacked matrices [G, N, ...] and one
  // global scale each; the kernel's blockIdx.y = group * token tiles + token tile (group_matrix).
  int G = 1;
  int ldx = 0, ldy = 0;  // row strides of x / y in elements (a plain matrix: K / N)
  int y_col = 0;         // the matrix's first column of y (group g: g * N)
};

// The CTA's matrix of a grouped launch: group g's slices of x, y and the stacked weights.
__device__ __forceinline__ TiledParams group_matrix(const TiledParams& p, int g) {
  TiledParams q = p;
  if (p.G > 1) {
    const size_t kp = size_t((p.K + 127) & ~127), rows = size_t(g) * size_t(p.N);
    q.x = p.x + size_t(g) * size_t(p.K);
    q.w = p.w + rows * (kp / 2);
    q.s = p.s + rows * (kp / 16);
    q.gs = p.gs + g;
    q.y_col = g * p.N;
  }
  return q;
}

// Launchers of the kernel files (instantiated there for every MODE / ROWS the host side uses).
template <int MODE>
cudaError_t launch_skinny(const SkinnyParams& p, int nt, dim3 grid, cudaStream_t stream);
template <int MODE, int ROWS>
cudaError_t launch_gemv(const SkinnyParams& p, dim3 grid, cudaStream_t stream, int occ);
cudaError_t launch_tiled(const TiledParams& p, int sms, cudaStream_t stream);
cudaError_t launch_wgmma(const TiledParams& p, bool wide, int sms, cudaStream_t stream);  // wide: 256-row tiles
// grid: ceil(rows / 128) (wide: / 256) x slots
template <int MODE>
cudaError_t launch_moe_wgmma(const SkinnyParams& p, int tm, bool wide, int rows, int slots, cudaStream_t stream);
int wgmma_tile_tokens(int64_t tokens);  // the wgmma kernels' token tile (16 / 32 / 64 / 128) for `tokens`

}  // namespace dsv4_nvfp4

namespace {

using dsv4_cuda::grid_dep_launch;
using dsv4_cuda::grid_dep_wait;
using dsv4_cuda::launch_ex;
using namespace dsv4_nvfp4;

constexpr int kStageChunks = 2;  // chunks per register-prefetch stage (skinny kernel)

// Weights are read once: keep them out of L1, let L2 prefetch the rest of the row.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Warm L2 (the GPU's point of coherence: a later write by another kernel updates the same lines, so this is a hint
// that can never make a later read stale). bytes: a multiple of 16, p 16-byte aligned.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ int load_id(const void* ids, int is64, int64_t a) {
  if (is64) {
    const int64_t v = reinterpret_cast<const int64_t*>(ids)[a];
    return (v < 0 || v > 0x7FFFFFFF) ? -1 : int(v);
  }
  return reinterpret_cast<const int32_t*>(ids)[a];
}

__device__ __forceinline__ float swiglu(float gate, float up, float limit) {
  if (limit > 0.f) {
    up = fminf(fmaxf(up, -limit), limit);
    gate = fminf(gate, limit);
  }
  return gate / (1.0f + expf(-gate)) * up;
}

// Exact scale value of a kernel scale byte ((e + 10) << 3 | m, 0 -> 0).
__device__ __forceinline__ float scale_value(uint32_t b) {
  return b == 0 ? 0.f : __int_as_float(int((((b >> 3) + 117u) << 23) | ((b & 7u) << 20)));
}

// Code of pair q, element e (0 = even k) of a kernel-layout word.
__device__ __forceinline__ uint32_t word_code(uint32_t w, int q, int e) {
  if (q < 3) {
    const uint32_t x = w << (3 * q);
    return e == 0 ? (((x >> 6) & 7u) | (((x >> 15) & 1u) << 3)) : (((x >> 22) & 7u) | (((x >> 31) & 1u) << 3));
  }
  const int b = e == 0 ? 0 : 16;
  return ((w >> (10 + b)) & 3u) | (((w >> (13 + b)) & 1u) << 2) | (((w >> (14 + b)) & 1u) << 3);
}

__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t c = code & 7u;  // c >= 2: (1 + m/2) * 2^(e-1) with e = c >> 1, m = c & 1
  const float mag = c < 2u ? 0.5f * float(c) : __int_as_float(int((((c >> 1) + 126u) << 23) | ((c & 1u) << 22)));
  return (code & 8u) ? -mag : mag;
}

__device__ __forceinline__ float e4m3_value(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float v;
  if (e == 15u && m == 7u)
    v = __int_as_float(0x7FC00000);
  else if (e == 0u)
    v = float(m) * (1.0f / 512.0f);
  else
    v = __int_as_float(int(((e + 120u) << 23) | (m << 20)));
  return (b & 0x80u) ? -v : v;
}


struct Task {
  const uint8_t* w;
  const uint8_t* s;
  float alpha;
  int N, K, cnt, base, kind;  // kind: 0 dense, 1 routed expert (base = offset in the sorted assignments),
                              // 2 shared expert (base = first token)
  const int* asg;             // routed: the expert's assignments (asg[base + pos]); global route or shared memory
  int grp;                    // dense: the group (x [M, G, K], y [M, G, N])
  const float* gsp;           // dense: the global scale
  void* y;                    // dense: the output
};

// Dense matrix of group blockIdx.y (stacked [G, N, Kp/2] / [G, N, Kp/16]); alpha needs the global scale, read
// by the caller (after griddepcontrol.wait in the gemv kernel).
__device__ __forceinline__ void dense_task(const SkinnyParams& p, Task& t) {
  if (p.nseg > 0) {  // nvfp4_linear_multi: segment blockIdx.y, its own matrix and output
    const int seg = int(blockIdx.y);
    t.grp = 0;
    t.w = p.seg_w[seg];
    t.s = p.seg_s[seg];
    t.gsp = p.seg_g[seg];
    t.y = p.seg_y[seg];
    t.N = p.seg_n[seg];
  } else {
    t.grp = int(blockIdx.y);
    const size_t kp = size_t((p.K + 127) & ~127), off = size_t(t.grp) * size_t(p.N);
    t.w = p.w + off * (kp / 2);
    t.s = p.s + off * (kp / 16);
    t.gsp = p.g + t.grp;
    t.y = p.y;
    t.N = p.N;
  }
  t.K = p.K;
  t.cnt = p.M;
  t.base = 0;
  t.kind = 0;
}

// Decode-size routing inside the MoE kernels (no route kernel launch): the assignments a < T*k with a valid id
// (0 <= id < E) are grouped by expert; routed slot s is the s-th smallest expert present, as in the route kernel's
// active list, and its assignments are listed in ascending a (the route kernel's order within an expert is that of
// its atomics; every assignment's output is computed alone, so the order changes no value).
constexpr int kLocalRouteMax = 32;  // one assignment per lane of warp 0
struct LocalRoute {
  int asg[kLocalRouteMax];
  int e, cnt;  // the slot's expert (-1: no expert for this slot) and its number of assignments
};

// Warp 0 of the CTA fills r for routed slot `slot`; the caller synchronizes the CTA before reading it.
__device__ void local_route(const SkinnyParams& p, int slot, LocalRoute& r) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const int lane = threadIdx.x & 31, TK = p.T * p.topk;
  int id = -1;  // lane a holds assignment a's expert (-1: none or invalid)
  if (lane < TK) {
    const int e = load_id(p.ids, p.ids64, lane);
    id = (e >= 0 && e < p.E) ? e : -1;
  }
  const unsigned same = __match_any_sync(kAll, id);
  const bool first = id >= 0 && __ffs(same) - 1 == lane;  // the expert's first assignment
  const int first_id = first ? id : -1;
  int rank = 0;  // distinct experts below this lane's
  for (int b = 0; b < 32; ++b) {
    const int v = __shfl_sync(kAll, first_id, b);
    rank += v >= 0 && v < id;
  }
  const unsigned hit = __ballot_sync(kAll, first && rank == slot);
  const int e = hit ? __shfl_sync(kAll, id, __ffs(hit) - 1) : -1;
  const unsigned mine = __ballot_sync(kAll, e >= 0 && id == e);
  if (e >= 0 && id == e) r.asg[__popc(mine & ((1u << lane) - 1u))] = lane;
  if (lane == 0) {
    r.e = e;
    r.cnt = __popc(mine);
  }
}

// The CTA's local routing (MoE kernels, routed slots, local_route on): all threads call it before resolve_task.
template <int MODE>
__device__ __forceinline__ void local_route_cta(const SkinnyParams& p, LocalRoute& r) {
  if (MODE == kDense || !p.local_route || int(blockIdx.y) < p.n_sslots) return;  // CTA-uniform
  if (threadIdx.x < 32) local_route(p, int(blockIdx.y) - p.n_sslots, r);
  __syncthreads();
}

template <int MODE>
__device__ __forceinline__ bool resolve_task(const SkinnyParams& p, Task& t, const LocalRoute& lr) {
  if (MODE == kDense) {
    dense_task(p, t);
    float a = __ldg(t.gsp) * kUnbias;
    if (p.gs_act != nullptr) a *= __ldg(p.gs_act);
    t.alpha = a;
    return true;
  }
  const int slot = int(blockIdx.y) - p.n_sslots;
  if (slot >= 0) {
    int e;
    if (p.local_route) {
      e = lr.e;
      if (e < 0) return false;
      t.cnt = lr.cnt;
      t.base = 0;
      t.asg = lr.asg;
    } else {
      if (slot >= __ldg(p.route + 3 * p.E)) return false;
      e = __ldg(p.route + 2 * p.E + slot);
      t.cnt = __ldg(p.route + e);
      t.base = __ldg(p.route + p.E + e);
      t.asg = p.route + 3 * p.E + 1;
    }
    t.kind = 1;
    t.N = p.N;
    t.K = p.K;
    const size_t kp = size_t((p.K + 127) & ~127);
    t.w = p.w + size_t(e) * size_t(p.N) * (kp / 2);
    t.s = p.s + size_t(e) * size_t(p.N) * (kp / 16);
    t.alpha = __ldg(p.g + e) * kUnbias;
  } else {
    t.w = p.sw;
    t.s = p.ss;
    t.N = p.sN;
    t.K = p.sK;
    t.base = int(blockIdx.y) * p.s_chunk;
    t.cnt = min(p.s_chunk, p.T - t.base);
    t.kind = 2;
    t.alpha = __ldg(p.sg) * kUnbias;
  }
  return true;
}

// Row of the B operand (activations) for token-tile position pos < cnt.
template <int MODE>
__device__ __forceinline__ const bf16* b_row(const SkinnyParams& p, const Task& t, int pos) {
  if (MODE == kDense) return p.x + (size_t(pos) * size_t(p.G) + size_t(t.grp)) * size_t(t.K);
  if (t.kind == 2) return (MODE == kMoeUp ? p.in : p.in_shared) + size_t(t.base + pos) * size_t(t.K);
  const int a = t.asg[t.base + pos];
  return p.in + size_t(MODE == kMoeUp ? a / p.topk : a) * size_t(t.K);
}

template <int MODE, int NT>
__device__ __forceinline__ void skinny_epilogue(const SkinnyParams& p, const Task& t, const float (&acc)[NT][4],
                                                int tile, int tt, int g, int tq, int width) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = nt * 8 + 2 * tq + e, pos = tt + col;
      if (col >= width || pos >= t.cnt) continue;
      const float lo = acc[nt][e] * t.alpha, hi = acc[nt][2 + e] * t.alpha;
      if (MODE == kDense) {
        const int na = tile * 16 + g;
        const size_t row = (size_t(pos) * size_t(p.G) + size_t(t.grp)) * size_t(t.N);
        if (na < t.N) store_out(t.y, row + na, lo, p.out_kind);
        if (na + 8 < t.N) store_out(t.y, row + na + 8, hi, p.out_kind);
      } else if (MODE == kMoeUp) {
        // rows g / g + 8 of the tile are gate / up of SwiGLU column tile * 8 + g
        const int inter = t.N / 2, col = tile * 8 + g;
        float h = swiglu(round_bf16(lo), round_bf16(hi), p.limit);
        if (t.kind == 1) {
          const int a = t.asg[t.base + pos];
          h *= __ldg(p.wts + a);
          p.out[size_t(a) * inter + col] = __float2bfloat16(h);
        } else {
          p.out_shared[size_t(t.base + pos) * inter + col] = __float2bfloat16(h);
        }
      } else {
        const int na = tile * 16 + g;
        bf16* dst = t.kind == 1 ? p.out + size_t(t.asg[t.base + pos]) * t.N
                                : p.out_shared + size_t(t.base + pos) * t.N;
        if (na < t.N) dst[na] = __float2bfloat16(lo);
        if (na + 8 < t.N) dst[na + 8] = __float2bfloat16(hi);
      }
    }
  }
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(d), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

}  // namespace

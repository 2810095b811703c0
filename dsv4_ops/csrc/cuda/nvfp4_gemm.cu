// NVFP4-weight GEMM / GEMV and routed-expert MoE kernels for sm_90a (H200: no FP4 tensor cores, so the
// weights are decoded to bf16 in registers and fed to mma.sync m16n8k16 with fp32 accumulation).
//
// Weight layout: the kernel layout of dsv4_model.nvfp4.repack_weight (docs/ops.md). Per 128-wide K chunk of a
// row, mma lane t (= lane & 3) finds its A fragments for all 8 k-steps in 16 contiguous bytes; every 32-bit
// word decodes with one AND (+ one shift) per pair into bf16x2 holding e2m1 * 2^-126, which one bf16x2 multiply
// by the block scale * 2^119 (exact: <= 5 significant bits, normal range) turns into e2m1 * scale * 2^-7. The
// fp32 epilogue multiplies by global_scale * 2^7. Weights are the mma A operand ("swap-AB"): 16 output
// features x 8 tokens per mma, so a single token still uses the tensor cores.
//
// Kernels:
//   gemv (default for dense M <= 8 and the MoE projections while T*k <= 4E; DSV4_NVFP4_GEMM_KERNEL=skinny opts
//     out): skinny's work split, fed through a per-warp cp.async shared-memory ring (weights, scales,
//     activations; see the kernel's comment); PDL for dense. 1.25-1.9x faster than skinny at M = 1 on the H200.
//   skinny (M <= 64, and every MoE projection): each warp owns 16 rows x a K range, streams its weights
//     straight from HBM into registers (two-deep register prefetch of 2 chunks), B fragments (activations)
//     from L1/L2; warps of a CTA split K and reduce through shared memory. MoE: blockIdx.y = active-expert
//     slot (device-side routing, grid sized by min(E, T*k)), gather of token rows, fused SwiGLU epilogue.
//   tiled (64 < M < 256 by default): 128x128 CTA tile, 3-stage cp.async pipeline (activations swizzled for
//     ldmatrix, packed weights + scales), 8 warps of 32 features x 64 tokens.
//   dequant_weight: W -> bf16 e2m1 * block scale (exact) for the bindings' cuBLAS path (M >= 256).
//   simple: plain CUDA-core reference-style kernels (DSV4_NVFP4_GEMM_KERNEL=simple), any shape.
//   MoE: route (one CTA) -> up (gemv or skinny, SwiGLU epilogue) -> down -> combine, chained with PDL.
//   Dense launches also serve nvfp4_linear_grouped (blockIdx.y = group of x [M, G, K]) and nvfp4_linear_multi
//   (blockIdx.y = one of several matrices sharing x) on the gemv / skinny kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "device_info.h"
#include "nvfp4_gemm.h"
#include "nvfp4_mma.cuh"
#include "pdl.h"

namespace {

using bf16 = __nv_bfloat16;
using dsv4_cuda::grid_dep_launch;
using dsv4_cuda::grid_dep_wait;
using dsv4_cuda::launch_ex;
using namespace dsv4_nvfp4;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStageChunks = 2;               // chunks per register-prefetch stage (skinny kernel)

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

// ------------------------------------------------------------------------------------------ skinny kernel
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
};

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

struct WStage {
  uint4 wa[kStageChunks], wb[kStageChunks];
  uint2 sa[kStageChunks], sb[kStageChunks];
};

template <int MODE, int NT>
__global__ void __launch_bounds__(kThreads) nvfp4_skinny_kernel(const SkinnyParams p) {
  __shared__ float red[kWarps][NT * 4][32];
  __shared__ LocalRoute lr;
  if (p.pdl) grid_dep_wait();
  local_route_cta<MODE>(p, lr);
  Task task;
  if (!resolve_task<MODE>(p, task, lr)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int kw = warp % p.kw, rt = warp / p.kw;
  const int ntiles = (task.N + 15) >> 4;
  const int tile0 = blockIdx.x * p.rt;
  if (tile0 >= ntiles) return;
  const bool tile_ok = tile0 + rt < ntiles;
  const int tile = tile_ok ? tile0 + rt : ntiles - 1;
  const int row_a = min(tile * 16 + g, task.N - 1), row_b = min(tile * 16 + g + 8, task.N - 1);
  const int kp = (task.K + 127) & ~127, nchunks = kp >> 7;
  const int per = (nchunks + p.kw - 1) / p.kw;
  const int c_begin = min(kw * per, nchunks), c_end = min(c_begin + per, nchunks);
  const uint8_t* wa_ptr = task.w + size_t(row_a) * size_t(kp >> 1) + tq * 16;
  const uint8_t* wb_ptr = task.w + size_t(row_b) * size_t(kp >> 1) + tq * 16;
  const uint8_t* sa_ptr = task.s + size_t(row_a) * size_t(kp >> 4);
  const uint8_t* sb_ptr = task.s + size_t(row_b) * size_t(kp >> 4);

  for (int tt = 0; tt < task.cnt; tt += 8 * NT) {
    const uint32_t* brow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      brow[nt] = reinterpret_cast<const uint32_t*>(b_row<MODE>(p, task, min(tt + nt * 8 + g, task.cnt - 1)));
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

    auto load = [&](WStage& st, int c0) {
#pragma unroll
      for (int i = 0; i < kStageChunks; ++i) {
        const int c = c0 + i;
        if (c < c_end) {
          st.wa[i] = ld_stream16(wa_ptr + size_t(c) * 64);
          st.wb[i] = ld_stream16(wb_ptr + size_t(c) * 64);
          st.sa[i] = __ldg(reinterpret_cast<const uint2*>(sa_ptr + size_t(c) * 8));
          st.sb[i] = __ldg(reinterpret_cast<const uint2*>(sb_ptr + size_t(c) * 8));
        } else {
          st.wa[i] = st.wb[i] = make_uint4(0u, 0u, 0u, 0u);
          st.sa[i] = st.sb[i] = make_uint2(0u, 0u);
        }
      }
    };
    auto compute = [&](const WStage& st, int c0) {
#pragma unroll
      for (int i = 0; i < kStageChunks; ++i) {
        const int c = c0 + i;
        if (c >= c_end) continue;
        const uint32_t wra[4] = {st.wa[i].x, st.wa[i].y, st.wa[i].z, st.wa[i].w};
        const uint32_t wrb[4] = {st.wb[i].x, st.wb[i].y, st.wb[i].z, st.wb[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t ra[4], rb[4];
          decode_word(wra[j], ra);
          decode_word(wrb[j], rb);
#pragma unroll
          for (int hs = 0; hs < 2; ++hs) {
            const int s = 2 * j + hs;
            const int kk = c * 128 + s * 16;
            if (kk >= task.K) continue;
            uint32_t a[4];
            a_fragment(ra, rb, st.sa[i], st.sb[i], s, a);
            const int kx = (kk >> 1) + tq;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint32_t b0 = __ldg(brow[nt] + kx), b1 = __ldg(brow[nt] + kx + 4);
              mma16816(acc[nt], a[0], a[1], a[2], a[3], b0, b1);
            }
          }
        }
      }
    };

    WStage s0, s1;
    int c = c_begin;
    load(s0, c);
    while (c < c_end) {
      load(s1, c + kStageChunks);
      compute(s0, c);
      c += kStageChunks;
      if (c >= c_end) break;
      load(s0, c + kStageChunks);
      compute(s1, c);
      c += kStageChunks;
    }

    // every weight load of this CTA is issued: let the next kernel's CTAs fill the SMs this wave frees
    if (p.pdl && tt + 8 * NT >= task.cnt) grid_dep_launch();
    if (p.kw > 1) {
      if (kw != 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) red[warp][nt * 4 + r][lane] = acc[nt][r];
      }
      __syncthreads();
      if (kw == 0) {
        for (int w2 = 1; w2 < p.kw; ++w2) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[nt][r] += red[warp + w2][nt * 4 + r][lane];
        }
      }
    }
    if (kw == 0 && tile_ok) skinny_epilogue<MODE, NT>(p, task, acc, tile, tt, g, tq, 8 * NT);
    if (p.kw > 1) __syncthreads();  // `red` is reused by the next token tile
  }
}

// ------------------------------------------------------------------------------------------ tiled kernel
constexpr int kTileN = 128, kTileM = 128, kStages = 3;
constexpr int kXStage = kTileM * 128 * 2;  // bf16 activations, 128 tokens x 128 k, swizzled 16-byte pieces
constexpr int kWStage = kTileN * 64;       // packed weights, 128 rows x one chunk
constexpr int kSStage = kTileN * 8;        // scale bytes
constexpr int kStageBytes = kXStage + kWStage + kSStage;
constexpr int kTiledSmem = kStageBytes * kStages;
constexpr int kOutStride = kTileN + 4;  // fp32 epilogue staging [token][feature]
static_assert(kTileM * kOutStride * 4 <= kTiledSmem, "epilogue staging must fit in the pipeline smem");

struct TiledParams {
  const bf16* x;
  const uint8_t* w;
  const uint8_t* s;
  const float* gs;
  const float* gs_act;
  void* y;
  int out_kind;
  int M, N, K;
};

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

__global__ void __launch_bounds__(kThreads, 1) nvfp4_tiled_kernel(const TiledParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int wn = warp & 3, wm = warp >> 2;  // 4 warps along features x 2 along tokens
  const int n_base = blockIdx.x * kTileN, m_base = blockIdx.y * kTileM;
  const int kp = (p.K + 127) & ~127, nchunks = kp >> 7;

  auto load_stage = [&](int st, int c) {
    uint8_t* xs = smem + st * kStageBytes;
    uint8_t* ws = xs + kXStage;
    uint8_t* ss = ws + kWStage;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int id = tid + i * kThreads, r = id >> 4, ch = id & 15;
      const int m = m_base + r, k = c * 128 + ch * 8;
      const bool ok = m < p.M && k < p.K;
      const bf16* src = p.x + size_t(min(m, p.M - 1)) * p.K + (ok ? k : 0);
      cp_async16(xs + r * 256 + ((ch ^ (r & 7)) << 4), src, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int id = tid + i * kThreads, r = id >> 2, part = id & 3;
      const int n = n_base + r;
      const uint8_t* src = p.w + size_t(min(n, p.N - 1)) * (kp >> 1) + size_t(c) * 64 + part * 16;
      cp_async16(ws + r * 64 + part * 16, src, n < p.N ? 16 : 0);
    }
    if (tid < kTileN) {
      const int n = n_base + tid;
      const uint8_t* src = p.s + size_t(min(n, p.N - 1)) * (kp >> 4) + size_t(c) * 8;
      cp_async8(ss + tid * 8, src, n < p.N ? 8 : 0);
    }
  };

  float acc[2][8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < nchunks) load_stage(st, st);
    cp_async_commit();
  }
  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int cn = c + kStages - 1;
    if (cn < nchunks) load_stage(cn % kStages, cn);
    cp_async_commit();

    const uint8_t* xs = smem + (c % kStages) * kStageBytes;
    const uint8_t* ws = xs + kXStage;
    const uint8_t* ss = ws + kWStage;
    uint4 wa[2], wb[2];
    uint2 sa[2], sb[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = wn * 32 + i * 16 + g;
      wa[i] = *reinterpret_cast<const uint4*>(ws + r * 64 + tq * 16);
      wb[i] = *reinterpret_cast<const uint4*>(ws + (r + 8) * 64 + tq * 16);
      sa[i] = *reinterpret_cast<const uint2*>(ss + r * 8);
      sb[i] = *reinterpret_cast<const uint2*>(ss + (r + 8) * 8);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t ra[2][4], rb[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t wa_j = j == 0 ? wa[i].x : j == 1 ? wa[i].y : j == 2 ? wa[i].z : wa[i].w;
        const uint32_t wb_j = j == 0 ? wb[i].x : j == 1 ? wb[i].y : j == 2 ? wb[i].z : wb[i].w;
        decode_word(wa_j, ra[i]);
        decode_word(wb_j, rb[i]);
      }
#pragma unroll
      for (int hs = 0; hs < 2; ++hs) {
        const int s = 2 * j + hs;
        if (c * 128 + s * 16 >= p.K) continue;
        uint32_t a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) a_fragment(ra[i], rb[i], sa[i], sb[i], s, a[i]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          const int tok = wm * 64 + (np * 2 + (lane >> 4)) * 8 + (lane & 7);
          const int ch = 2 * s + ((lane >> 3) & 1);
          uint32_t b[4];
          ldmatrix_x4(b, xs + tok * 256 + ((ch ^ (tok & 7)) << 4));
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mma16816(acc[i][2 * np], a[i][0], a[i][1], a[i][2], a[i][3], b[0], b[1]);
            mma16816(acc[i][2 * np + 1], a[i][0], a[i][1], a[i][2], a[i][3], b[2], b[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  float alpha = __ldg(p.gs) * kUnbias;
  if (p.gs_act != nullptr) alpha *= __ldg(p.gs_act);
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = wn * 32 + i * 16 + g, tok = wm * 64 + nt * 8 + 2 * tq + e;
        cs[tok * kOutStride + row] = acc[i][nt][e] * alpha;
        cs[tok * kOutStride + row + 8] = acc[i][nt][2 + e] * alpha;
      }
  __syncthreads();
  const bool vec = (p.N % 8) == 0;
#pragma unroll 1
  for (int it = 0; it < (kTileM * kTileN / 8) / kThreads; ++it) {
    const int id = tid + it * kThreads, tl = id >> 4, fl = (id & 15) * 8;
    const int m = m_base + tl, n = n_base + fl;
    if (m >= p.M || n >= p.N) continue;
    const float* v = cs + tl * kOutStride + fl;
    const size_t o = size_t(m) * p.N + n;
    if (vec && p.out_kind == 0) {
      __nv_bfloat162 q[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) q[u] = __floats2bfloat162_rn(v[2 * u], v[2 * u + 1]);
      *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(p.y) + o) = *reinterpret_cast<const uint4*>(q);
    } else {
      for (int u = 0; u < 8 && n + u < p.N; ++u) store_out(p.y, o + u, v[u], p.out_kind);
    }
  }
}

// ------------------------------------------------------------------------------------------ gemv kernel
// Decode GEMV: dense M <= 8, and the MoE projections while experts see few tokens. Work split as in skinny (a
// warp owns 16 rows x a K range, warps of a CTA split K), but each warp streams its chunks through its own
// shared-memory ring of kStages chunks filled by cp.async (weights, scales and the chunk's activation rows), so
// kStages - 1 chunks are in flight without holding registers, and the activation fragments come from the ring by
// ldmatrix: nothing on the mma's critical path waits on L1/L2 (skinny's per-k-step activation loads did).
// With PDL (dense too) a CTA may start under the previous kernel's tail but reads nothing before
// griddepcontrol.wait, weights included: the op cannot know that its weights were not just written (a copy of a
// misaligned view, a test's copy_). Dense CTAs only warm L2 with their weights before the wait. (Loading weights
// into the ring before the wait measured ~1 us faster per call.)
template <int ROWS, int OCC>  // activation rows per pass (2 or 8); the mma's other columns repeat them and are dropped
struct GemvCfg {
  static constexpr int kStages = ROWS <= 2 ? (OCC == 3 ? 4 : 6) : 3;
  static constexpr int kW = 1024;        // [2][32 lanes] x 16 B: rows g / g + 8 of the chunk, lane order
  static constexpr int kS = 128;         // [16 rows] x 8 scale bytes
  static constexpr int kX = ROWS * 256;  // [ROWS] x 128 bf16, 16-byte pieces XOR-swizzled by row (ldmatrix)
  static constexpr int kStage = kW + kS + kX;
  static constexpr int kSmem = kStage * kStages * kWarps;
};

template <int MODE, int ROWS, int OCC>
__global__ void __launch_bounds__(kThreads, OCC) nvfp4_gemv_kernel(const SkinnyParams p) {
  using Cfg = GemvCfg<ROWS, OCC>;
  constexpr int S = Cfg::kStages;
  extern __shared__ __align__(128) uint8_t gsmem[];
  __shared__ float red[kWarps][4][32];
  __shared__ LocalRoute lr;
  // The weights and the shape of a dense task or of the shared expert are launch parameters, known before the
  // wait; a routed expert comes from the routing (its kernel, or the ids: the predecessors' outputs).
  const bool early = MODE == kDense || int(blockIdx.y) < p.n_sslots;
  if (!early && p.pdl) grid_dep_wait();
  local_route_cta<MODE>(p, lr);
  Task task;
  if (MODE == kDense) {
    dense_task(p, task);
  } else if (!resolve_task<MODE>(p, task, lr)) {
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int kw = warp % p.kw, rt = warp / p.kw;
  const int ntiles = (task.N + 15) >> 4;
  const int tile0 = blockIdx.x * p.rt;
  if (tile0 >= ntiles) return;
  const bool tile_ok = tile0 + rt < ntiles;
  const int tile = tile_ok ? tile0 + rt : ntiles - 1;
  const int kp = (task.K + 127) & ~127, nchunks = kp >> 7;
  const int per = (nchunks + p.kw - 1) / p.kw;
  const int c_begin = min(kw * per, nchunks), c_end = min(c_begin + per, nchunks);
  const uint8_t* wa_ptr = task.w + size_t(min(tile * 16 + g, task.N - 1)) * size_t(kp >> 1) + tq * 16;
  const uint8_t* wb_ptr = task.w + size_t(min(tile * 16 + g + 8, task.N - 1)) * size_t(kp >> 1) + tq * 16;
  const uint8_t* s_ptr = task.s + size_t(min(tile * 16 + (lane & 15), task.N - 1)) * size_t(kp >> 4);
  uint8_t* ring = gsmem + warp * (Cfg::kStage * S);
  if (early && p.pdl) {
    // Only the chunks the ring's first fills read: warming the whole K range slowed large shapes by ~1.3 us
    // (it competes with the previous kernel's own stream).
    const int warm = min(c_end - c_begin, S);
    if (lane < 16 && warm > 0) {  // lane l: row l of the tile
      const size_t row = size_t(min(tile * 16 + lane, task.N - 1));
      prefetch_l2_bulk(task.w + row * size_t(kp >> 1) + size_t(c_begin) * 64, uint32_t(warm) * 64);
      const uint8_t* srow = task.s + row * size_t(kp >> 4) + size_t(c_begin) * 8;
      prefetch_l2(srow);
      prefetch_l2(srow + warm * 8 - 1);
    }
    grid_dep_wait();
  }
  if (MODE == kDense) {
    float a = __ldg(task.gsp) * kUnbias;
    if (p.gs_act != nullptr) a *= __ldg(p.gs_act);
    task.alpha = a;
  }

  // This lane's copies go to fixed offsets of a stage: its 16 bytes of rows g / g + 8, the scale bytes of row
  // `lane` (lanes < 16), and piece lane & 15 (8 bf16) of activation rows lane >> 4, + 2, ... (XOR-swizzled).
  const int pc = lane & 15;
  uint32_t x_dst[ROWS / 2];
#pragma unroll
  for (int i = 0; i < ROWS / 2; ++i) {
    const int r = (lane >> 4) + 2 * i;
    x_dst[i] = Cfg::kW + Cfg::kS + r * 256 + ((pc ^ (r & 7)) << 4);
  }
  // ldmatrix: matrix m = lane >> 3 (k-step 2q + m / 2, half m & 1), token row lane & 7 (repeating the pass rows)
  const int xr = (lane & 7) & (ROWS - 1), xm = lane >> 3;
  uint32_t ldm[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int piece = (2 * q + (xm >> 1)) * 2 + (xm & 1);
    ldm[q] = Cfg::kW + Cfg::kS + xr * 256 + ((piece ^ xr) << 4);
  }
  for (int tt = 0; tt < task.cnt; tt += ROWS) {
    const int rows = min(ROWS, task.cnt - tt);
    const bf16* xrow[ROWS / 2];
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i)
      xrow[i] = b_row<MODE>(p, task, tt + min((lane >> 4) + 2 * i, rows - 1));
    // Chunk ci into stage stg: one cp.async group per chunk (empty past c_end).
    auto issue = [&](int ci, uint8_t* stg) {
      if (ci < c_end) {
        cp_async16(stg + lane * 16, wa_ptr + uint32_t(ci) * 64u, 16);
        cp_async16(stg + 512 + lane * 16, wb_ptr + uint32_t(ci) * 64u, 16);
        if (lane < 16) cp_async8(stg + Cfg::kW + lane * 8, s_ptr + uint32_t(ci) * 8u, 8);
        const int kx = ci * 128 + pc * 8;
#pragma unroll
        for (int i = 0; i < ROWS / 2; ++i) {
          const bool ok = (lane >> 4) + 2 * i < rows && kx < task.K;
          cp_async16(stg + x_dst[i], ok ? xrow[i] + kx : xrow[0], ok ? 16 : 0);
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(c_begin + j, ring + j * Cfg::kStage);
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    // One trip of the outer loop walks the whole ring, so every stage offset is a constant.
    for (int c0 = c_begin; c0 < c_end; c0 += S) {
#pragma unroll
      for (int j = 0; j < S; ++j) {
        const int c = c0 + j;
        if (c >= c_end) break;
        // chunk c + S - 1 into the stage consumed last step (the __syncwarp below ordered its reads)
        issue(c + S - 1, ring + ((j + S - 1) % S) * Cfg::kStage);
        cp_async_wait<S - 1>();  // this thread's copies of chunk c have landed
        __syncwarp();            // ... and every lane's
        const uint8_t* st = ring + j * Cfg::kStage;
        const uint4 wa = *reinterpret_cast<const uint4*>(st + lane * 16);
        const uint4 wb = *reinterpret_cast<const uint4*>(st + 512 + lane * 16);
        const RowScales sa = row_scales(*reinterpret_cast<const uint2*>(st + Cfg::kW + g * 8));
        const RowScales sb = row_scales(*reinterpret_cast<const uint2*>(st + Cfg::kW + (g + 8) * 8));
        uint32_t b[4][4];  // k-steps 2q, 2q + 1: {b0, b1, b0', b1'}
#pragma unroll
        for (int q = 0; q < 4; ++q) ldmatrix_x4(b[q], st + ldm[q]);
        chunk_mma(wa, wb, sa, sb, b, acc0, acc1);
        __syncwarp();  // every lane's reads of this stage are done before it is refilled
      }
    }
    cp_async_wait<0>();  // no copy outlives the pass (the next pass refills from stage 0)
    __syncwarp();
    float acc[1][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[0][r] = acc0[r] + acc1[r];
    if (p.pdl && tt + ROWS >= task.cnt) grid_dep_launch();
    if (p.kw > 1) {
      if (kw != 0) {
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][r][lane] = acc[0][r];
      }
      __syncthreads();
      if (kw == 0) {
        for (int w2 = 1; w2 < p.kw; ++w2) {
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[0][r] += red[warp + w2][r][lane];
        }
      }
    }
    if (kw == 0 && tile_ok) skinny_epilogue<MODE, 1>(p, task, acc, tile, tt, g, tq, ROWS);
    if (p.kw > 1) __syncthreads();  // `red` is reused by the next pass
  }
}

// ------------------------------------------------------------------------------------------ simple kernels
// Warp-reduced sum_k code * scale * x[k] over one kernel-layout row (exact decode, fp32 FMA).
__device__ float simple_row_dot(const uint8_t* wrow, const uint8_t* srow, int K, const bf16* xrow, int lane) {
  const int kp = (K + 127) & ~127;
  float acc = 0.f;
  for (int wi = lane; wi < kp / 8; wi += 32) {
    const int c = wi >> 4, t = (wi >> 2) & 3, j = wi & 3;
    const uint8_t* b = wrow + size_t(wi) * 4;
    const uint32_t w = uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 24);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int s = 2 * j + (q >> 1), h = q & 1;
      const float sc = scale_value(srow[c * 8 + s]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int k = c * 128 + 16 * s + 8 * h + 2 * t + e;
        if (k < K) acc = fmaf(e2m1_value(word_code(w, q, e)) * sc, __bfloat162float(xrow[k]), acc);
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, off);
  return acc;
}

__global__ void nvfp4_simple_linear_kernel(const TiledParams p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * kWarps + warp;
  if (n >= p.N) return;
  const int kp = (p.K + 127) & ~127;
  float alpha = __ldg(p.gs);
  if (p.gs_act != nullptr) alpha *= __ldg(p.gs_act);
  for (int m = blockIdx.y; m < p.M; m += gridDim.y) {
    const float dot = simple_row_dot(p.w + size_t(n) * (kp / 2), p.s + size_t(n) * (kp / 16), p.K,
                                     p.x + size_t(m) * p.K, lane);
    if (lane == 0) store_out(p.y, size_t(m) * p.N + n, dot * alpha, p.out_kind);
  }
}

struct SimpleMoeParams {
  const bf16* x;
  const void* ids;
  int ids64;
  const float* wts;
  const uint8_t *w13, *s13, *w2, *s2, *sw13, *ss13, *sw2, *ss2;
  const float *g13, *g2, *sg13, *sg2;
  int T, d, k, E, I, Is;
  float limit;
  bf16* h;   // routed [T*k, I], then shared [T, Is]
  bf16* o;   // [(T*k + T), d]
};

// blockIdx.y = assignment row r (< T*k routed, else shared token r - T*k); warps over SwiGLU columns.
__device__ void simple_moe_up_row(const SimpleMoeParams& p, int r) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tk = p.T * p.k;
  const int col = blockIdx.x * kWarps + warp;
  const uint8_t *w, *s;
  float gs, route = 1.f;
  int inter, tok;
  bf16* dst;
  const size_t kpd = size_t((p.d + 127) & ~127);
  if (r < tk) {
    const int e = load_id(p.ids, p.ids64, r);
    if (e < 0 || e >= p.E) return;
    inter = p.I;
    w = p.w13 + size_t(e) * 2 * p.I * (kpd / 2);
    s = p.s13 + size_t(e) * 2 * p.I * (kpd / 16);
    gs = p.g13[e];
    route = p.wts[r];
    tok = r / p.k;
    dst = p.h + size_t(r) * p.I;
  } else {
    inter = p.Is;
    w = p.sw13;
    s = p.ss13;
    gs = p.sg13[0];
    tok = r - tk;
    dst = p.h + size_t(tk) * p.I + size_t(tok) * p.Is;
  }
  if (col >= inter) return;
  const int grow = (col / 8) * 16 + col % 8;  // gate row in the interleaved layout; up = grow + 8
  const bf16* xrow = p.x + size_t(tok) * p.d;
  const float gate = simple_row_dot(w + size_t(grow) * (kpd / 2), s + size_t(grow) * (kpd / 16), p.d, xrow, lane);
  const float up = simple_row_dot(w + size_t(grow + 8) * (kpd / 2), s + size_t(grow + 8) * (kpd / 16), p.d, xrow, lane);
  float hv = swiglu(round_bf16(gate * gs), round_bf16(up * gs), p.limit);
  if (r < tk) hv *= route;
  if (lane == 0) dst[col] = __float2bfloat16(hv);
}

__global__ void nvfp4_simple_moe_up_kernel(const SimpleMoeParams p) {
  for (int r = blockIdx.y; r < p.T * p.k + (p.sw13 != nullptr ? p.T : 0); r += gridDim.y) simple_moe_up_row(p, r);
}

__device__ void simple_moe_down_row(const SimpleMoeParams& p, int r) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tk = p.T * p.k;
  const int n = blockIdx.x * kWarps + warp;
  if (n >= p.d) return;
  const uint8_t *w, *s;
  float gs;
  int K;
  const bf16* hrow;
  if (r < tk) {
    const int e = load_id(p.ids, p.ids64, r);
    if (e < 0 || e >= p.E) return;
    K = p.I;
    const size_t kp = size_t((K + 127) & ~127);
    w = p.w2 + size_t(e) * p.d * (kp / 2);
    s = p.s2 + size_t(e) * p.d * (kp / 16);
    gs = p.g2[e];
    hrow = p.h + size_t(r) * p.I;
  } else {
    K = p.Is;
    w = p.sw2;
    s = p.ss2;
    gs = p.sg2[0];
    hrow = p.h + size_t(tk) * p.I + size_t(r - tk) * p.Is;
  }
  const size_t kp = size_t((K + 127) & ~127);
  const float dot = simple_row_dot(w + size_t(n) * (kp / 2), s + size_t(n) * (kp / 16), K, hrow, lane);
  if (lane == 0) p.o[size_t(r) * p.d + n] = __float2bfloat16(dot * gs);
}

__global__ void nvfp4_simple_moe_down_kernel(const SimpleMoeParams p) {
  for (int r = blockIdx.y; r < p.T * p.k + (p.sw13 != nullptr ? p.T : 0); r += gridDim.y) simple_moe_down_row(p, r);
}

// ------------------------------------------------------------------------------------------ MoE routing
// One CTA: per-expert counts, exclusive offsets, the list of active experts (ascending id) and the
// assignments a = t*k + j grouped by expert. route = [counts E | offsets E | active E | n_active | sorted T*k].
__global__ void __launch_bounds__(1024) nvfp4_moe_route_kernel(const void* ids, int ids64, int TK, int E,
                                                               int* route) {
  extern __shared__ int rsm[];
  int* cnt = rsm;
  int* cur = rsm + E;
  __shared__ int wsum[32], wact[32];
  grid_dep_wait();  // topk_ids come from the previous kernel
  grid_dep_launch();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int a = tid; a < TK; a += blockDim.x) {
    const int e = load_id(ids, ids64, a);
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  const int per = (E + blockDim.x - 1) / blockDim.x;
  const int e0 = min(tid * per, E), e1 = min(e0 + per, E);
  int lsum = 0, lact = 0;
  for (int e = e0; e < e1; ++e) {
    lsum += cnt[e];
    lact += cnt[e] > 0;
  }
  int ssum = lsum, sact = lact;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, ssum, off), u = __shfl_up_sync(0xFFFFFFFFu, sact, off);
    if (lane >= off) {
      ssum += v;
      sact += u;
    }
  }
  if (lane == 31) {
    wsum[warp] = ssum;
    wact[warp] = sact;
  }
  __syncthreads();
  if (warp == 0) {
    int v = lane < nwarps ? wsum[lane] : 0, u = lane < nwarps ? wact[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v2 = __shfl_up_sync(0xFFFFFFFFu, v, off), u2 = __shfl_up_sync(0xFFFFFFFFu, u, off);
      if (lane >= off) {
        v += v2;
        u += u2;
      }
    }
    wsum[lane] = v;
    wact[lane] = u;
  }
  __syncthreads();
  int off_sum = (warp > 0 ? wsum[warp - 1] : 0) + ssum - lsum;
  int off_act = (warp > 0 ? wact[warp - 1] : 0) + sact - lact;
  for (int e = e0; e < e1; ++e) {
    route[e] = cnt[e];
    route[E + e] = off_sum;
    cur[e] = off_sum;
    if (cnt[e] > 0) route[2 * E + off_act++] = e;
    off_sum += cnt[e];
  }
  if (tid == 0) route[3 * E] = wact[nwarps - 1];
  __syncthreads();
  for (int a = tid; a < TK; a += blockDim.x) {
    const int e = load_id(ids, ids64, a);
    if (e >= 0 && e < E) route[3 * E + 1 + atomicAdd(&cur[e], 1)] = a;
  }
}

// y[t] = bf16(sum_j o[t*k + j] (valid ids only, slot order) + o[T*k + t] (shared)), 8 features per thread.
__global__ void nvfp4_moe_combine_kernel(const bf16* o, const void* ids, int ids64, int T, int k, int E, int d,
                                         int has_shared, bf16* y) {
  grid_dep_wait();
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int d8 = d / 8;
  if (idx >= int64_t(T) * d8) return;
  const int t = int(idx / d8), n = int(idx % d8) * 8;
  float acc[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) acc[u] = 0.f;
  auto add_row = [&](int64_t row) {
    const uint4 v = *reinterpret_cast<const uint4*>(o + row * d + n);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float2 f = __bfloat1622float2(h[u]);
      acc[2 * u] += f.x;
      acc[2 * u + 1] += f.y;
    }
  };
  for (int j = 0; j < k; ++j) {
    const int e = load_id(ids, ids64, int64_t(t) * k + j);
    if (e >= 0 && e < E) add_row(int64_t(t) * k + j);
  }
  if (has_shared) add_row(int64_t(T) * k + t);
  __nv_bfloat162 q[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) q[u] = __floats2bfloat162_rn(acc[2 * u], acc[2 * u + 1]);
  *reinterpret_cast<uint4*>(y + int64_t(t) * d + n) = *reinterpret_cast<const uint4*>(q);
}

__global__ void nvfp4_dequant_act_kernel(const uint8_t* packed, const uint8_t* scale, bf16* out, int64_t nbytes,
                                         int K) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nbytes) return;
  const int64_t row = i / (K / 2), kb = (i % (K / 2)) * 2;
  const float sc = e4m3_value(scale[row * (K / 16) + kb / 16]);
  const uint32_t b = packed[i];
  reinterpret_cast<__nv_bfloat162*>(out)[i] =
      __floats2bfloat162_rn(e2m1_value(b & 15u) * sc, e2m1_value(b >> 4) * sc);
}

// One thread per kernel-layout word: 8 codes -> bf16 e2m1 * scale at their k positions.
__global__ void nvfp4_dequant_weight_kernel(const uint8_t* w, const uint8_t* s, int64_t N, int K, bf16* out) {
  const int kp = (K + 127) & ~127, words = kp / 8;
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= N * words) return;
  const int64_t n = id / words;
  const int wi = int(id % words), c = wi >> 4, t = (wi >> 2) & 3, j = wi & 3;
  const uint32_t word = *reinterpret_cast<const uint32_t*>(w + n * (kp / 2) + size_t(wi) * 4);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int st = 2 * j + (q >> 1), h = q & 1;
    const int k0 = c * 128 + 16 * st + 8 * h + 2 * t;
    if (k0 >= K) continue;
    const float sc = scale_value(s[n * (kp / 16) + c * 8 + st]);
    reinterpret_cast<__nv_bfloat162*>(out + n * K + k0)[0] =
        __floats2bfloat162_rn(e2m1_value(word_code(word, q, 0)) * sc, e2m1_value(word_code(word, q, 1)) * sc);
  }
}

// ------------------------------------------------------------------------------------------ host side
int pick_nt(int64_t tokens) { return tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : 8; }

// Warps per row tile along K (kw) and row tiles per CTA (rt): at most ~4 chunks per warp, and enough
// CTAs for all SMs when the matrix allows.
void pick_split(int64_t ntiles, int64_t nchunks, int64_t slots, int& kw, int& rt) {
  kw = 1;
  while (kw < kWarps && (nchunks + kw - 1) / kw > 4) kw *= 2;
  rt = kWarps / kw;
  while (kw < kWarps && ((ntiles + rt - 1) / rt) * slots < 264 && nchunks >= 2 * kw) {
    kw *= 2;
    rt = kWarps / kw;
  }
}

using dsv4_cuda::sm_count;

// gemv split: the kw (K-splits per row tile; rt = 8 / kw tiles per CTA) with the fewest chunk-times, counting
// waves of occ CTAs per SM and ~3 chunk-times of pipeline fill per wave (session 8's sweep: with 4, the MoE up
// projection at T = 1 / 2 took kw = 1 / 2 where kw = 4 measured 5-7% faster; the dense picks are the same).
// CTAs per SM of the gemv kernel: 3 (a 4-stage ring, <= 80 registers) for 2-token passes over >= 12288 chunks
// (12 MB of weights), else 2 (a 6-stage ring). H200, M = 1: 3 per SM took wq_b 32768x1024 10.85 -> 9.71 us, wo_b
// 11.35 -> 10.85, wo_a 8 x 1024x4096 11.46 -> 10.80, the MoE at T = 1 48.3 -> 42.8; but w1+w3 4096x4096 7.70 ->
// 8.18, w2 / expert-sized 5.5 / 5.1 -> 5.7 / 5.7 (fewer chunks in flight per warp, fewer waves to hide the fill).
int gemv_occ(int rows, int64_t chunks) { return rows == 2 && chunks >= 12288 ? 3 : 2; }

void pick_gemv_split(int64_t ntiles, int64_t nchunks, int64_t slots, int& kw, int& rt, int occ) {
  const int64_t cap = occ * int64_t(sm_count());
  int64_t best = -1;
  for (int k = 1; k <= kWarps; k *= 2) {
    if (k > 1 && k / 2 >= nchunks) break;
    const int64_t r = kWarps / k, per = (nchunks + k - 1) / k;
    const int64_t waves = (((ntiles + r - 1) / r) * slots + cap - 1) / cap;
    const int64_t cost = waves * (per + 3) + (k > 1 ? 1 : 0);
    if (best < 0 || cost < best) {
      best = cost;
      kw = k;
      rt = int(r);
    }
  }
}

// The gemv launch plan for `rows`-token passes: CTAs per SM (occ), K-splits per row tile (kw) and tiles per CTA
// (rt). DSV4_GEMV_SPLIT=kw:occ forces one (bench/sweep_gemv_split.py; occ 3 only for 2-token passes; read at each
// launch). Session 8's sweep on the H200: 4 CTAs per SM (<= 64 registers, 3 stages) lost on every decode shape.
void plan_gemv(int rows, int64_t ntiles, int64_t nchunks, int64_t slots, int& kw, int& rt, int& occ) {
  occ = gemv_occ(rows, ntiles * nchunks * slots);
  pick_gemv_split(ntiles, nchunks, slots, kw, rt, occ);
  const char* v = std::getenv("DSV4_GEMV_SPLIT");
  int fk = 0, fo = 0;
  if (v == nullptr || std::sscanf(v, "%d:%d", &fk, &fo) != 2) return;
  if ((fk == 1 || fk == 2 || fk == 4 || fk == 8) && fo >= 2 && fo <= (rows == 2 ? 3 : 2)) {
    kw = fk;
    rt = kWarps / fk;
    occ = fo;
  }
}

// While T*k <= kLocalRouteMax the up / down kernels route themselves and the route kernel is not launched
// (H200, 256 experts, top-6, T = 1: 44.1 -> 41.7 us routed, 44.3 -> 43.2 us with the shared expert).
// DSV4_NVFP4_MOE_LOCAL_ROUTE=0 launches the route kernel at every size (read at each launch).
bool moe_local_route() {
  const char* v = std::getenv("DSV4_NVFP4_MOE_LOCAL_ROUTE");
  return v == nullptr || v[0] != '0';
}

template <int MODE, int ROWS, int OCC>
cudaError_t launch_gemv_occ(const SkinnyParams& p, dim3 grid, cudaStream_t stream) {
  auto kernel = nvfp4_gemv_kernel<MODE, ROWS, OCC>;
  static bool smem_set[64] = {};  // per device; the attribute is set before the first launch (never in capture)
  int dev = 0;
  cudaGetDevice(&dev);
  if (!smem_set[dev & 63]) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, GemvCfg<ROWS, OCC>::kSmem);
    if (err != cudaSuccess) return err;
    smem_set[dev & 63] = true;
  }
  return launch_ex(p.pdl != 0, kernel, grid, dim3(kThreads), size_t(GemvCfg<ROWS, OCC>::kSmem), stream, p);
}

template <int MODE, int ROWS>
cudaError_t launch_gemv(const SkinnyParams& p, dim3 grid, cudaStream_t stream, int occ) {
  if (ROWS == 2 && occ == 3) return launch_gemv_occ<MODE, 2, 3>(p, grid, stream);
  return launch_gemv_occ<MODE, ROWS, 2>(p, grid, stream);
}

template <int MODE>
cudaError_t launch_skinny(const SkinnyParams& p, int nt, dim3 grid, cudaStream_t stream) {
  const bool pdl = p.pdl != 0;
  switch (nt) {
    case 1: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 1>, grid, dim3(kThreads), 0, stream, p);
    case 2: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 2>, grid, dim3(kThreads), 0, stream, p);
    case 4: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 4>, grid, dim3(kThreads), 0, stream, p);
    default: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 8>, grid, dim3(kThreads), 0, stream, p);
  }
}

}  // namespace

extern "C" cudaError_t dsv4_nvfp4_linear_launch(const Nvfp4LinearArgs* a, cudaStream_t stream) {
  if ((a->G > 1 || a->nseg > 0) && (a->simple || a->M > 64)) return cudaErrorInvalidValue;  // gemv / skinny only
  if (a->nseg > kNvfp4MaxSegments) return cudaErrorInvalidValue;
  int64_t n_max = a->N;  // (G <= 1: one matrix; nseg > 0: the widest segment sizes the grid)
  if (a->nseg > 0) {
    n_max = 0;
    for (int i = 0; i < a->nseg; ++i) n_max = a->seg_n[i] > n_max ? a->seg_n[i] : n_max;
  }
  if (a->M == 0 || n_max == 0) return cudaSuccess;
  const int64_t kp = (a->K + 127) / 128 * 128, nchunks = kp / 128, ntiles = (n_max + 15) / 16;
  if (a->simple) {
    TiledParams p{reinterpret_cast<const bf16*>(a->x), a->w, a->s, a->gs, a->gs_act, a->y, a->out_kind,
                  int(a->M), int(a->N), int(a->K)};
    nvfp4_simple_linear_kernel<<<dim3(unsigned((a->N + kWarps - 1) / kWarps), unsigned(a->M < 65535 ? a->M : 65535)),
                                 kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if (a->M > 64) {
    const cudaError_t err =
        cudaFuncSetAttribute(nvfp4_tiled_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTiledSmem);
    if (err != cudaSuccess) return err;
    TiledParams p{reinterpret_cast<const bf16*>(a->x), a->w, a->s, a->gs, a->gs_act, a->y, a->out_kind,
                  int(a->M), int(a->N), int(a->K)};
    const dim3 grid(unsigned((a->N + kTileN - 1) / kTileN), unsigned((a->M + kTileM - 1) / kTileM));
    nvfp4_tiled_kernel<<<grid, kThreads, kTiledSmem, stream>>>(p);
    return cudaGetLastError();
  }
  SkinnyParams p{};
  p.x = reinterpret_cast<const bf16*>(a->x);
  p.y = a->y;
  p.out_kind = a->out_kind;
  p.gs_act = a->gs_act;
  p.M = int(a->M);
  p.w = a->w;
  p.s = a->s;
  p.g = a->gs;
  p.N = int(a->N);
  p.K = int(a->K);
  p.G = a->G > 1 ? int(a->G) : 1;
  p.nseg = a->nseg;
  for (int i = 0; i < a->nseg; ++i) {
    p.seg_w[i] = a->seg_w[i];
    p.seg_s[i] = a->seg_s[i];
    p.seg_g[i] = a->seg_gs[i];
    p.seg_y[i] = a->seg_y[i];
    p.seg_n[i] = int(a->seg_n[i]);
  }
  const int ny = a->nseg > 0 ? a->nseg : p.G;  // blockIdx.y: groups or segments
  if (a->gemv && a->M <= 8 && reinterpret_cast<uintptr_t>(a->x) % 16 == 0) {
    const cudaError_t bulk = dsv4_nvfp4_gemv_bulk_launch(a, stream);  // opt-in (nvfp4_gemv_bulk.cu)
    if (bulk != cudaErrorNotSupported) return bulk;
    p.pdl = a->pdl;
    int occ = 2;
    plan_gemv(a->M <= 2 ? 2 : 8, ntiles, nchunks, ny, p.kw, p.rt, occ);
    const dim3 grid(unsigned((ntiles + p.rt - 1) / p.rt), unsigned(ny));
    return a->M <= 2 ? launch_gemv<kDense, 2>(p, grid, stream, occ) : launch_gemv<kDense, 8>(p, grid, stream, occ);
  }
  pick_split(ntiles, nchunks, ny, p.kw, p.rt);
  const dim3 grid(unsigned((ntiles + p.rt - 1) / p.rt), unsigned(ny));
  return launch_skinny<kDense>(p, pick_nt(a->M), grid, stream);
}

extern "C" cudaError_t dsv4_nvfp4_dequant_act_launch(const Nvfp4DequantActArgs* a, cudaStream_t stream) {
  const int64_t nbytes = a->rows * (a->K / 2);
  if (nbytes == 0) return cudaSuccess;
  nvfp4_dequant_act_kernel<<<unsigned((nbytes + 255) / 256), 256, 0, stream>>>(
      a->packed, a->scale, reinterpret_cast<bf16*>(a->out), nbytes, int(a->K));
  return cudaGetLastError();
}

extern "C" cudaError_t dsv4_nvfp4_dequant_weight_launch(const uint8_t* w, const uint8_t* s, int64_t N, int64_t K,
                                                        void* out, cudaStream_t stream) {
  const int64_t total = N * ((K + 127) / 128 * 16);
  if (total == 0) return cudaSuccess;
  nvfp4_dequant_weight_kernel<<<unsigned((total + 255) / 256), 256, 0, stream>>>(w, s, N, int(K),
                                                                                 reinterpret_cast<bf16*>(out));
  return cudaGetLastError();
}

extern "C" cudaError_t dsv4_nvfp4_moe_launch(const Nvfp4MoeArgs* a, cudaStream_t stream) {
  if (a->T == 0) return cudaSuccess;
  const int64_t TK = a->T * a->k;
  const bool shared = a->sw13 != nullptr;
  bf16* h = reinterpret_cast<bf16*>(a->h);
  bf16* o = reinterpret_cast<bf16*>(a->o);
  if (a->simple) {
    SimpleMoeParams p{};
    p.x = reinterpret_cast<const bf16*>(a->x);
    p.ids = a->ids;
    p.ids64 = a->ids_int64;
    p.wts = a->wts;
    p.w13 = a->w13, p.s13 = a->s13, p.w2 = a->w2, p.s2 = a->s2;
    p.sw13 = a->sw13, p.ss13 = a->ss13, p.sw2 = a->sw2, p.ss2 = a->ss2;
    p.g13 = a->g13, p.g2 = a->g2, p.sg13 = a->sg13, p.sg2 = a->sg2;
    p.T = int(a->T), p.d = int(a->d), p.k = int(a->k), p.E = int(a->E), p.I = int(a->I), p.Is = int(a->Is);
    p.limit = a->limit;
    p.h = h;
    p.o = o;
    const int64_t rows = TK + (shared ? a->T : 0) < 65535 ? TK + (shared ? a->T : 0) : 65535;
    const int64_t imax = a->I > a->Is ? a->I : a->Is;
    nvfp4_simple_moe_up_kernel<<<dim3(unsigned((imax + kWarps - 1) / kWarps), unsigned(rows)), kThreads, 0,
                                 stream>>>(p);
    nvfp4_simple_moe_down_kernel<<<dim3(unsigned((a->d + kWarps - 1) / kWarps), unsigned(rows)), kThreads, 0,
                                   stream>>>(p);
  } else {
    SkinnyParams p{};
    p.pdl = a->pdl;
    p.route = a->route;
    p.ids = a->ids;
    p.ids64 = int(a->ids_int64);
    p.local_route = TK <= kLocalRouteMax && moe_local_route();
    cudaError_t err = cudaSuccess;
    if (!p.local_route) {
      err = launch_ex(a->pdl != 0, nvfp4_moe_route_kernel, dim3(1), dim3(1024), size_t(2 * a->E) * sizeof(int),
                      stream, a->ids, int(a->ids_int64), int(TK), int(a->E), a->route);
      if (err != cudaSuccess) return err;
    }
    p.E = int(a->E);
    p.topk = int(a->k);
    p.T = int(a->T);
    p.n_rslots = int(TK < a->E ? TK : a->E);
    p.wts = a->wts;
    p.limit = a->limit;
    // tokens per tile: ~2x the mean tokens per expert (the kernel loops over more). One 8-token tile: the
    // gemv kernel (2-token passes while T <= 2), else skinny with 8 * nt tokens per pass.
    const int nt = pick_nt((TK + a->E - 1) / a->E * 2);
    const bool gemv = a->gemv && nt == 1;
    const int gemv_rows = a->T <= 2 ? 2 : 8;
    p.s_chunk = gemv ? gemv_rows : 8 * nt;
    p.n_sslots = shared ? int((a->T + p.s_chunk - 1) / p.s_chunk) : 0;
    const int slots = p.n_rslots + p.n_sslots;
    // up: gate/up rows [2I] x K = d; B rows = tokens of x
    p.w = a->w13, p.s = a->s13, p.g = a->g13, p.N = int(2 * a->I), p.K = int(a->d);
    p.sw = a->sw13, p.ss = a->ss13, p.sg = a->sg13, p.sN = int(2 * a->Is), p.sK = int(a->d);
    p.in = reinterpret_cast<const bf16*>(a->x);
    p.in_shared = p.in;
    p.out = h;
    p.out_shared = h + TK * a->I;
    const int64_t nmax_up = (shared && a->Is > a->I ? a->Is : a->I) * 2;
    const int64_t kchunks_d = (a->d + 127) / 128;
    if (gemv) {
      int occ = 2;
      plan_gemv(gemv_rows, (nmax_up + 15) / 16, kchunks_d, slots, p.kw, p.rt, occ);
      const dim3 grid(unsigned(((nmax_up + 15) / 16 + p.rt - 1) / p.rt), unsigned(slots));
      err = gemv_rows == 2 ? launch_gemv<kMoeUp, 2>(p, grid, stream, occ)
                           : launch_gemv<kMoeUp, 8>(p, grid, stream, occ);
    } else {
      pick_split((nmax_up + 15) / 16, kchunks_d, slots, p.kw, p.rt);
      err = launch_skinny<kMoeUp>(p, nt, dim3(unsigned(((nmax_up + 15) / 16 + p.rt - 1) / p.rt), unsigned(slots)),
                                  stream);
    }
    if (err != cudaSuccess) return err;
    // down: rows d x K = I (Is); B rows = h
    p.w = a->w2, p.s = a->s2, p.g = a->g2, p.N = int(a->d), p.K = int(a->I);
    p.sw = a->sw2, p.ss = a->ss2, p.sg = a->sg2, p.sN = int(a->d), p.sK = int(a->Is);
    p.in = h;
    p.in_shared = h + TK * a->I;
    p.out = o;
    p.out_shared = o + TK * a->d;
    const int64_t kmax = shared && a->Is > a->I ? a->Is : a->I;
    const int64_t ntiles_d = (a->d + 15) / 16;
    if (gemv) {
      int occ = 2;
      plan_gemv(gemv_rows, ntiles_d, (kmax + 127) / 128, slots, p.kw, p.rt, occ);
      const dim3 grid(unsigned((ntiles_d + p.rt - 1) / p.rt), unsigned(slots));
      err = gemv_rows == 2 ? launch_gemv<kMoeDown, 2>(p, grid, stream, occ)
                           : launch_gemv<kMoeDown, 8>(p, grid, stream, occ);
    } else {
      pick_split(ntiles_d, (kmax + 127) / 128, slots, p.kw, p.rt);
      err = launch_skinny<kMoeDown>(p, nt, dim3(unsigned((ntiles_d + p.rt - 1) / p.rt), unsigned(slots)), stream);
    }
    if (err != cudaSuccess) return err;
  }
  const int64_t items = a->T * (a->d / 8);
  return launch_ex(a->pdl != 0 && !a->simple, nvfp4_moe_combine_kernel, dim3(unsigned((items + 255) / 256)),
                   dim3(256), 0, stream, static_cast<const bf16*>(o), a->ids, int(a->ids_int64), int(a->T),
                   int(a->k), int(a->E), int(a->d), shared ? 1 : 0, reinterpret_cast<bf16*>(a->y));
}

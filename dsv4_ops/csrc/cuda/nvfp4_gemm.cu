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
//   gemv (default for dense M <= 8 and the MoE projections while T*k <= 4E; the nvfp4_gemm_kernel override
//     "skinny" opts out): skinny's work split, fed through a per-warp cp.async shared-memory ring (weights, scales,
//     activations; see the kernel's comment); PDL for dense. Faster than skinny at M = 1 (bench/RESULTS.md).
//   skinny (grouped / multi launches at 8 < M <= 64; the MoE projections beyond gemv's reach with the override
//     "skinny" or "tiled"; every M <= 64 with the override "skinny"): each warp owns 16 rows x a K range, streams its weights
//     straight from HBM into registers (two-deep register prefetch of 2 chunks), B fragments (activations)
//     from L1/L2; warps of a CTA split K and reduce through shared memory. MoE: blockIdx.y = active-expert
//     slot (device-side routing, grid sized by min(E, T*k)), gather of token rows, fused SwiGLU epilogue.
//   tiled (one dense matrix at 8 < M < 32 by default; every M > 8 with the override "tiled"): 128 features x 16 / 32 / 64 / 128 tokens per CTA, a
//     cp.async pipeline (activations swizzled for ldmatrix, packed weights + scales), warps of 16 features x all
//     tokens (TM = 128: 32 x 64); K split over a thread-block cluster that reduces through distributed shared
//     memory where the tiles alone would leave SMs idle (nvfp4_tiled.cu).
//   wgmma (default for one dense matrix at 32 <= M <= 1024 and the MoE projections beyond gemv's reach; every
//     M > 8 with the override "wgmma"): the tiled kernel's CTA with Hopper's warpgroup MMA, the decoded weights as its register A
//     operand, activations read by the tensor cores from shared memory (nvfp4_wgmma.cu, nvfp4_wgmma.cuh); 128 or
//     256 weight rows per CTA (the wide tile: dense where its tiles fill the GPU, the MoE from 32-token tiles).
//   dequant_weight: W -> bf16 e2m1 * block scale (exact) for the bindings' cuBLAS path (M > 1024).
//   MoE: route (one CTA) -> up (gemv, wgmma or skinny, SwiGLU epilogue) -> down -> combine, chained with PDL.
//   Dense launches also serve nvfp4_linear_grouped (blockIdx.y = group of x [M, G, K]) and nvfp4_linear_multi
//   (blockIdx.y = one of several matrices sharing x) on the gemv / skinny kernels.
// Files: nvfp4_kernels.cuh (what the kernels share), nvfp4_gemv.cu, nvfp4_skinny.cu, nvfp4_tiled.cu,
// nvfp4_wgmma.cu (nvfp4_tile.cuh: what the two tile kernels share); here the
// MoE routing / combine and dequant kernels, and the host side (kernel choice, work split, the extern "C"
// launchers).
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "device_info.h"
#include "overrides.h"
#include "nvfp4_kernels.cuh"

namespace {

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

// The weight -> bf16 e2m1 * block scale, a tile at a time: a CTA per 16 rows x kDqChunks chunks, thread (chunk,
// row, quarter t) decodes its 16 bytes of codes (32 values) into a shared-memory copy of the rows, then the CTA
// writes each row out in 16-byte pieces. A thread per word with a 4-byte store per value pair (each warp instruction
// touching 8 rows) made the path 3.5-4.5% slower at M = 4096, 10-12% at M = 1024 (bench/RESULTS.md, session 50).
constexpr int kDqChunks = 4;
constexpr int kDqRow = kDqChunks * 256 + 16;  // bytes per shared row; + 16 puts the 8 rows of a warp on distinct banks
static_assert(kDqChunks * 16 * 4 == 256, "a thread per (chunk, row, 16 bytes of codes)");

__global__ void __launch_bounds__(256) nvfp4_dequant_weight_tile_kernel(const uint8_t* w, const uint8_t* s,
                                                                        int64_t N, int K, bf16* out) {
  __shared__ __align__(16) uint8_t rows[16 * kDqRow];
  const int kp = (K + 127) & ~127, nchunks = kp >> 7;
  const int64_t n0 = int64_t(blockIdx.x) * 16;
  const int c0 = int(blockIdx.y) * kDqChunks;
  const int tid = int(threadIdx.x), t = tid & 3, r = (tid >> 2) & 15, cc = tid >> 6;
  const int c = c0 + cc;
  if (n0 + r < N && c < nchunks) {
    const RowAddr a = row_addr(n0 + r, N, kp);
    const uint4 code = *reinterpret_cast<const uint4*>(w + a.w + size_t(c) * a.wstep + t * 16);
    const uint2 sb = *reinterpret_cast<const uint2*>(s + a.s + size_t(c) * a.sstep);
    const uint32_t words[4] = {code.x, code.y, code.z, code.w};
    uint8_t* dst = rows + r * kDqRow + cc * 256;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int st = 2 * j + (q >> 1), h = q & 1;
        const float sc = scale_value(((st < 4 ? sb.x : sb.y) >> (8 * (st & 3))) & 0xFFu);
        *reinterpret_cast<__nv_bfloat162*>(dst + (16 * st + 8 * h + 2 * t) * 2) = __floats2bfloat162_rn(
            e2m1_value(word_code(words[j], q, 0)) * sc, e2m1_value(word_code(words[j], q, 1)) * sc);
      }
    }
  }
  __syncthreads();
  for (int p = tid; p < 16 * kDqChunks * 16; p += 256) {  // 16 rows x (8 values = 16 B) pieces
    const int rr = p / (kDqChunks * 16), pc = p % (kDqChunks * 16);
    const int k = c0 * 128 + pc * 8;
    if (n0 + rr < N && k < K)  // K % 16 == 0: a piece is all inside K or all past it
      *reinterpret_cast<uint4*>(out + (n0 + rr) * K + k) =
          *reinterpret_cast<const uint4*>(rows + rr * kDqRow + pc * 16);
  }
}

// ------------------------------------------------------------------------------------------ host side
int pick_nt(int64_t tokens) { return tokens <= 8 ? 1 : tokens <= 16 ? 2 : tokens <= 32 ? 4 : 8; }

using dsv4_cuda::sm_count;

// Warps per row tile along K (kw) and row tiles per CTA (rt): at most ~4 chunks per warp, and enough
// CTAs for two per SM (264 on an H200) when the matrix allows.
void pick_split(int64_t ntiles, int64_t nchunks, int64_t slots, int& kw, int& rt) {
  const int64_t want = 2 * int64_t(sm_count());
  kw = 1;
  while (kw < kWarps && (nchunks + kw - 1) / kw > 4) kw *= 2;
  rt = kWarps / kw;
  while (kw < kWarps && ((ntiles + rt - 1) / rt) * slots < want && nchunks >= 2 * kw) {
    kw *= 2;
    rt = kWarps / kw;
  }
}

// gemv split: the kw (K-splits per row tile; rt = 8 / kw tiles per CTA) with the fewest chunk-times, counting
// waves of occ CTAs per SM and ~3 chunk-times of pipeline fill per wave (a fill of 4 picked splits the sweep
// measured slower for the MoE up projection at T = 1 / 2; bench/RESULTS.md).
// CTAs per SM of the gemv kernel: 3 (a 4-stage ring, <= 80 registers) for 2-token passes over >= 12288 chunks
// (12 MB of weights), else 2 (a 6-stage ring): 3 per SM wins on the large decode matrices and the MoE, loses on
// the smaller ones (fewer chunks in flight per warp, fewer waves to hide the fill; figures in bench/RESULTS.md).
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
// (rt). A sweep of forced plans on the H200 (bench/RESULTS.md) found none better on a decode shape; 4 CTAs per SM
// (<= 64 registers, 3 stages) lost on every one.
void plan_gemv(int rows, int64_t ntiles, int64_t nchunks, int64_t slots, int& kw, int& rt, int& occ) {
  occ = gemv_occ(rows, ntiles * nchunks * slots);
  pick_gemv_split(ntiles, nchunks, slots, kw, rt, occ);
}

// While T*k <= kLocalRouteMax the up / down kernels route themselves and the route kernel is not launched
// (faster at T = 1 with and without the shared expert, 256 experts, top-6: bench/RESULTS.md).
// The moe_local_route override off launches the route kernel at every size (read at each launch).
bool moe_local_route() { return dsv4_overrides::get().moe_local_route != 0; }

}  // namespace

extern "C" cudaError_t dsv4_nvfp4_linear_launch(const Nvfp4LinearArgs* a, cudaStream_t stream) {
  // grouped beyond gemv's rows with wgmma: one wgmma launch, every group's tiles in its grid
  const bool wg_grouped = a->G > 1 && a->nseg == 0 && a->M > 8 && a->wgmma;
  if ((a->G > 1 || a->nseg > 0) && a->M > 64 && !wg_grouped) return cudaErrorInvalidValue;  // gemv / skinny only
  if (a->nseg > kNvfp4MaxSegments) return cudaErrorInvalidValue;
  int64_t n_max = a->N;  // (G <= 1: one matrix; nseg > 0: the widest segment sizes the grid)
  if (a->nseg > 0) {
    n_max = 0;
    for (int i = 0; i < a->nseg; ++i) n_max = a->seg_n[i] > n_max ? a->seg_n[i] : n_max;
  }
  if (a->M == 0 || n_max == 0) return cudaSuccess;
  const int64_t kp = (a->K + 127) / 128 * 128, nchunks = kp / 128, ntiles = (n_max + 15) / 16;
  // The tile kernels: M > 64, and one dense matrix at 8 < M <= 64 unless skinny is forced (gemv = 0); wgmma also
  // takes a grouped launch.
  if (wg_grouped || (a->G <= 1 && a->nseg == 0 && (a->M > 64 || (a->M > 8 && a->gemv)))) {
    TiledParams p{reinterpret_cast<const bf16*>(a->x), a->w, a->s, a->gs, a->gs_act, a->y, a->out_kind,
                  int(a->M), int(a->N), int(a->K)};
    p.G = a->G > 1 ? int(a->G) : 1;
    p.ldx = int(p.G * a->K);
    p.ldy = int(p.G * a->N);
    return a->wgmma ? launch_wgmma(p, a->wgmma == 2, dsv4_cuda::sm_count(), stream)  // nvfp4_wgmma.cu
                    : launch_tiled(p, dsv4_cuda::sm_count(), stream);                 // nvfp4_tiled.cu
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
  if (dsv4_nvfp4_takes_gemv(a)) {
    p.pdl = a->pdl;
    p.trigger_now = a->trigger_now;
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
  if (N == 0 || K == 0) return cudaSuccess;
  const dim3 grid(unsigned((N + 15) / 16), unsigned(((K + 127) / 128 + kDqChunks - 1) / kDqChunks));
  nvfp4_dequant_weight_tile_kernel<<<grid, 256, 0, stream>>>(w, s, N, int(K), reinterpret_cast<bf16*>(out));
  return cudaGetLastError();
}

extern "C" cudaError_t dsv4_nvfp4_moe_launch(const Nvfp4MoeArgs* a, cudaStream_t stream) {
  if (a->T == 0) return cudaSuccess;
  const int64_t TK = a->T * a->k;
  const bool shared = a->sw13 != nullptr;
  bf16* h = reinterpret_cast<bf16*>(a->h);
  bf16* o = reinterpret_cast<bf16*>(a->o);
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
  // Token rows per gemv pass: 2 while T <= 8, else 8 (the moe_gemv_rows override forces either). With 2 rows a
  // warp's ring holds 4-6 chunks instead of 3, more weight bytes in flight where most experts see one token; a
  // slot with more tokens takes several passes, the shared expert T / 2 slots. H100, 256 experts top-6: T = 8
  // 240.9 vs 252.5 us, T = 16 even, T = 64 1.19x slower (bench/RESULTS.md).
  const int forced_rows = dsv4_overrides::get().moe_gemv_rows;
  const int gemv_rows = forced_rows == 2 || forced_rows == 8 ? forced_rows : a->T <= 8 ? 2 : 8;
  // the wgmma kernels where skinny would run (unless a kernel is forced): TM tokens per tile, 128 rows per CTA
  const int wg_tm = a->wgmma && !gemv ? wgmma_tile_tokens((TK + a->E - 1) / a->E * 2) : 0;
  // 256-row tiles (forced, or auto from 32-token tiles: each CTA re-reads its gathered activations half as often;
  // H100, 256 experts top-6, T = 512 / 4096 / 8192: 1.13x / 1.07x / 1.08x the 128-row tiles, bench/RESULTS.md)
  const bool wide = a->wgmma == 2 || (a->wgmma == 3 && wg_tm >= 32);
  p.s_chunk = gemv ? gemv_rows : wg_tm ? wg_tm : 8 * nt;
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
  if (wg_tm) {
    err = launch_moe_wgmma<kMoeUp>(p, wg_tm, wide, int(nmax_up), slots, stream);
  } else if (gemv) {
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
  if (wg_tm) {
    err = launch_moe_wgmma<kMoeDown>(p, wg_tm, wide, int(a->d), slots, stream);
  } else if (gemv) {
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
  // dsv4::nvfp4_moe_rows: its consumer sums o.
  if (a->skip_combine) return cudaSuccess;
  const int64_t items = a->T * (a->d / 8);
  return launch_ex(a->pdl != 0, nvfp4_moe_combine_kernel, dim3(unsigned((items + 255) / 256)),
                   dim3(256), 0, stream, static_cast<const bf16*>(o), a->ids, int(a->ids_int64), int(a->T),
                   int(a->k), int(a->E), int(a->d), shared ? 1 : 0, reinterpret_cast<bf16*>(a->y));
}

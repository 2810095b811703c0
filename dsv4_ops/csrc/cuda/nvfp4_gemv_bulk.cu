// Bulk GEMV for the decode step's large dense NVFP4 projections (M <= 2 tokens; wq_b, wo_a, wo_b of V4-Flash:
// ~19 MB of weights each). Opt-in (DSV4_NVFP4_BULK=1): on the H200 it is slower than the ring gemv it was written
// to replace (bench/RESULTS.md, session 10), and stays as the measured base for the next step.
//
// Why: the ring gemv (nvfp4_gemv.cu) keeps a few 1 KB chunks per warp in flight, so a 19 MB projection takes
// ~3-4 rounds of DRAM latency (39-45% of HBM). Here each CTA (one per SM) owns a contiguous range of 16-row tiles
// and a producer warp requests its weights with bulk async copies (cp.async.bulk: one copy per tile for the codes
// and one for the scales, completion counted by mbarriers) into a ring of shared-memory stages as deep as shared
// memory allows. Measured: the copies alone move the 19 MB in 6.2-7.6 us (60-71% of HBM; per-row copies of
// 0.5-1 KB were 2-3x slower: the copy engine pays per copy); with the math the kernel takes ~13.4 us against the
// ring gemv's ~10-11, whatever the ring depth (2 stages to all of them): the consumer side is what binds.
//
// Stage: tps = max(1, 2048 / K) whole tiles (16 rows x K), rows contiguous as in the weight. kConsumers warps take
// the stage's (tile, 128-k chunk) units round-robin in tile-major order, decode exactly as the ring gemv
// (nvfp4_mma.cuh) and feed mma.sync with the activations from shared memory (copied once per CTA). Each warp keeps
// one accumulator for the tile it is on and parks it in shared memory when it moves on; the end sums a tile's
// parked partials in warp order (deterministic) and applies global scale * 2^7.
//
// Requirements (else the caller runs the ring gemv): M <= 2, K % 256 == 0 (every copy 16-byte sized), 16-byte
// aligned x / weight / scale pointers, <= 16 matrices (nvfp4_linear_grouped groups or nvfp4_linear_multi
// segments), <= kMaxTiles tiles per CTA and two stages in shared memory (K <= 8192 at 16 rows per tile).
//
// PDL: the CTA warms L2 with <= 16 KB of its first tile, then waits like every other kernel before reading
// anything (weights included: the op cannot know they were not just written).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdlib>

#include "device_info.h"
#include "nvfp4_gemm.h"
#include "nvfp4_mma.cuh"
#include "pdl.h"

namespace {

using bf16 = __nv_bfloat16;
using namespace dsv4_nvfp4;

constexpr int kStageK = 2048;                    // a stage holds >= 16 rows x 2048 k
constexpr int kConsumers = 16;                   // consumer warps; warp kConsumers is the producer
constexpr int kMaxTiles = 32;                    // tiles per CTA (parked partials: kMaxTiles x 8 warps x 128 B)
constexpr int kMaxMats = 16;
constexpr int kMaxStages = 32;                  // ring stages (mbarrier pairs)
constexpr int kPartBytes = kConsumers * 8 * 4 * 4;  // one tile's partials: [warp][row group g][4 floats]

struct BulkParams {
  const bf16* x;
  int M, K;
  int nmat;
  const uint8_t* w[kMaxMats];
  const uint8_t* s[kMaxMats];
  const float* g[kMaxMats];
  void* y[kMaxMats];
  int n[kMaxMats];
  int tile_start[kMaxMats + 1];  // first global tile of matrix j; tile_start[nmat] = all tiles
  int x_off[kMaxMats];           // bf16 offset of matrix j's activations in a token row of x
  int x_ld, y_ld_grouped;        // x token stride (elements); grouped: y token stride (G * N), else 0
  const float* gs_act;
  int out_kind;
  int n_ctas;
  int tps, NS;                   // tiles per stage, ring stages
  int stage_bytes, x_rows, x_stride;
  int pdl;
  int nomath;                    // benchmarks only (DSV4_NVFP4_BULK_NOMATH=1): consumers skip the math
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}
// Global -> shared bulk copy completing on `bar` (bytes: a multiple of 16; both addresses 16-byte aligned).
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint64_t policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers * 32) : "memory");
}

__device__ __forceinline__ int mat_of(const BulkParams& p, int tile) {
  int j = 0;
  while (j + 1 < p.nmat && p.tile_start[j + 1] <= tile) ++j;
  return j;
}


__global__ void __launch_bounds__(32 * (kConsumers + 1), 1) nvfp4_gemv_bulk_kernel(const BulkParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full_bar[kMaxStages], empty_bar[kMaxStages], x_bar;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int total = p.tile_start[p.nmat];
  const int t0 = int((int64_t(blockIdx.x) * total) / p.n_ctas);
  const int t1 = int((int64_t(blockIdx.x + 1) * total) / p.n_ctas);
  const int nstages = (t1 - t0 + p.tps - 1) / p.tps;  // stage i: tiles [t0 + i * tps, + tps) clipped to t1
  const int j0 = mat_of(p, t0), j1 = mat_of(p, max(t0, t1 - 1));
  uint8_t* xs = smem + size_t(p.NS) * p.stage_bytes;
  float* part = reinterpret_cast<float*>(xs + size_t(p.x_rows) * p.x_stride);
  // x rows of this CTA: matrices j0..j1 that read different activations (grouped) or one set (plain / multi)
  const bool x_per_mat = p.x_off[p.nmat - 1] != 0;
  const int xmats = x_per_mat ? j1 - j0 + 1 : 1;

  if (threadIdx.x == 0) {
    for (int i = 0; i < p.NS; ++i) {
      mbar_init(&full_bar[i], 1);
      mbar_init(&empty_bar[i], kConsumers);
    }
    mbar_init(&x_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < (t1 - t0) * (kPartBytes / 4); i += blockDim.x) part[i] = 0.f;
  if (p.pdl) {
    if (warp == kConsumers && lane == 0) {  // warm L2 with <= 16 KB of the first tile (a hint: never stale)
      const int j = mat_of(p, t0), lt = t0 - p.tile_start[j];
      const uint32_t bytes = uint32_t(min(16, p.n[j] - lt * 16)) * uint32_t(p.K / 2);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p.w[j] + size_t(lt) * 16 * (p.K / 2)),
                   "r"(min(bytes, 16384u))
                   : "memory");
    }
    dsv4_cuda::grid_dep_wait();
  }
  __syncthreads();

  if (warp == kConsumers) {  // ------------------------------------------------------------------ producer
    const uint64_t pol_w = policy_evict_first(), pol_x = policy_evict_last();
    const int nx = xmats * p.M;
    if (lane == 0) mbar_expect_tx(&x_bar, uint32_t(nx) * uint32_t(p.K) * 2u);
    __syncwarp();
    for (int r = lane; r < nx; r += 32) {
      const int jm = j0 + r / p.M, m = r % p.M;
      const bf16* src = p.x + size_t(m) * p.x_ld + (x_per_mat ? p.x_off[jm] : 0);
      bulk_g2s(xs + size_t(r) * p.x_stride, src, uint32_t(p.K) * 2u, &x_bar, pol_x);
    }
    for (int i = 0; i < nstages; ++i) {
      const int slot = i % p.NS;
      if (i >= p.NS) mbar_wait(&empty_bar[slot], uint32_t((i / p.NS - 1) & 1));
      const int ft = t0 + i * p.tps, nt = min(p.tps, t1 - ft);
      uint8_t* ws = smem + size_t(slot) * p.stage_bytes;
      uint8_t* ss = ws + size_t(p.tps) * 16 * (p.K / 2);
      uint32_t bytes = 0, rows = 0;
      int j = 0, lt = 0;
      if (lane < nt) {  // lane l copies tile ft + l: its rows are contiguous in the weight and in the stage
        j = mat_of(p, ft + lane);
        lt = ft + lane - p.tile_start[j];
        rows = uint32_t(min(16, p.n[j] - lt * 16));
        bytes = rows * uint32_t(p.K / 2 + p.K / 16);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) bytes += __shfl_xor_sync(0xFFFFFFFFu, bytes, o);
      if (lane == 0) mbar_expect_tx(&full_bar[slot], bytes);
      __syncwarp();
      if (lane < nt) {
        bulk_g2s(ws + size_t(lane) * 16 * (p.K / 2), p.w[j] + size_t(lt) * 16 * (p.K / 2), rows * uint32_t(p.K / 2),
                 &full_bar[slot], pol_w);
        bulk_g2s(ss + size_t(lane) * 16 * (p.K / 16), p.s[j] + size_t(lt) * 16 * (p.K / 16),
                 rows * uint32_t(p.K / 16), &full_bar[slot], pol_w);
      }
    }
    if (p.pdl) dsv4_cuda::grid_dep_launch();
    return;
  }

  // ------------------------------------------------------------------------------------------------ consumers
  if (p.pdl) dsv4_cuda::grid_dep_launch();
  const int g = lane >> 2, tq = lane & 3;
  const int w_ld = p.K / 2, s_ld = p.K / 16, cpt = p.K >> 7;  // stage row strides, 128-k chunks per tile
  const int tok = g < p.M ? g : 0;  // mma column g: token g (columns >= M repeat token 0 and are dropped)
  mbar_wait(&x_bar, 0);
  int cur = -1;  // the tile this warp accumulates
  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  auto park = [&]() {
    if (cur >= 0 && tq == 0) {
      float* dst = part + size_t(cur - t0) * (kPartBytes / 4) + (warp * 8 + g) * 4;
#pragma unroll
      for (int r = 0; r < 4; ++r) dst[r] = acc0[r] + acc1[r];
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) acc0[r] = acc1[r] = 0.f;
  };
  for (int i = 0; i < nstages; ++i) {
    const int slot = i % p.NS;
    mbar_wait(&full_bar[slot], uint32_t((i / p.NS) & 1));
    const int ft = t0 + i * p.tps, nt = min(p.tps, t1 - ft);
    const uint8_t* ws = smem + size_t(slot) * p.stage_bytes;
    const uint8_t* ss = ws + size_t(p.tps) * 16 * w_ld;
    for (int u = warp; u < (p.nomath ? 0 : nt * cpt); u += kConsumers) {
      const int tl = u / cpt, c = u - tl * cpt, tile = ft + tl;
      if (tile != cur) {
        park();
        cur = tile;
      }
      const int jm = mat_of(p, tile);
      const uint8_t* wr = ws + size_t(tl * 16 + g) * w_ld + c * 64 + tq * 16;
      const uint4 wa = *reinterpret_cast<const uint4*>(wr);
      const uint4 wb = *reinterpret_cast<const uint4*>(wr + 8 * w_ld);
      const uint8_t* sr = ss + size_t(tl * 16 + g) * s_ld + c * 8;
      const RowScales sa = row_scales(*reinterpret_cast<const uint2*>(sr));
      const RowScales sb = row_scales(*reinterpret_cast<const uint2*>(sr + 8 * s_ld));
      const int xr = (x_per_mat ? jm - j0 : 0) * p.M + tok;
      const uint32_t* xw = reinterpret_cast<const uint32_t*>(xs + size_t(xr) * p.x_stride) +
                           c * 64 + tq;
      uint32_t b[4][4];  // k-steps 2q, 2q + 1: {b0, b1, b0', b1'}
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        b[q][0] = xw[16 * q];
        b[q][1] = xw[16 * q + 4];
        b[q][2] = xw[16 * q + 8];
        b[q][3] = xw[16 * q + 12];
      }
      chunk_mma(wa, wb, sa, sb, b, acc0, acc1);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty_bar[slot]);
  }
  park();
  consumers_sync();
  // Epilogue: warp w finishes tiles t0 + w, t0 + w + kConsumers, ...; lane = (token, row) with row 0..15.
  const int row = lane & 15, m = lane >> 4;
  for (int tile = t0 + warp; tile < t1; tile += kConsumers) {
    const int j = mat_of(p, tile), lr = (tile - p.tile_start[j]) * 16 + row;
    const float* src = part + size_t(tile - t0) * (kPartBytes / 4) + (row & 7) * 4 + (row >> 3) * 2 + m;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumers; ++w) v += src[w * 32];
    if (m < p.M && lr < p.n[j]) {
      float alpha = __ldg(p.g[j]) * kUnbias;
      if (p.gs_act != nullptr) alpha *= __ldg(p.gs_act);
      const size_t ld = p.y_ld_grouped ? size_t(p.y_ld_grouped) : size_t(p.n[j]);
      store_out(p.y[j], size_t(m) * ld + lr, v * alpha, p.out_kind);
    }
  }
}

bool bulk_on() {  // DSV4_NVFP4_BULK=1: wherever the kernel applies (read at each launch)
  const char* v = std::getenv("DSV4_NVFP4_BULK");
  return v != nullptr && v[0] == '1';
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

cudaError_t launch_bulk(BulkParams& p, int per_cta, int optin, int dev, cudaStream_t stream) {
  static int static_smem[64] = {};
  if (!static_smem[dev & 63]) {
    cudaFuncAttributes fa{};
    const cudaError_t err = cudaFuncGetAttributes(&fa, nvfp4_gemv_bulk_kernel);
    if (err != cudaSuccess) return err;
    static_smem[dev & 63] = int(fa.sharedSizeBytes) + 1;
  }
  const int fixed = p.x_rows * p.x_stride + per_cta * kPartBytes;
  const int room = optin - static_smem[dev & 63] - fixed;
  const int stages_needed = (per_cta + p.tps - 1) / p.tps;
  p.NS = std::min({room / p.stage_bytes, stages_needed, kMaxStages});
  const char* es = std::getenv("DSV4_NVFP4_BULK_STAGES");  // benchmarks / tests: cap the ring
  if (es != nullptr && std::atoi(es) > 0) p.NS = std::min(p.NS, std::atoi(es));
  if (p.NS < std::min(2, stages_needed) || p.NS < 1) return cudaErrorNotSupported;
  const size_t smem = size_t(p.NS) * p.stage_bytes + fixed;
  static bool attr_set[64] = {};
  if (!attr_set[dev & 63]) {  // the largest size once per device (never during capture: the first launch is eager)
    const cudaError_t err = cudaFuncSetAttribute(nvfp4_gemv_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 optin - static_smem[dev & 63] + 1);
    if (err != cudaSuccess) return err;
    attr_set[dev & 63] = true;
  }
  return dsv4_cuda::launch_ex(p.pdl != 0, nvfp4_gemv_bulk_kernel, dim3(unsigned(p.n_ctas)),
                              dim3(32 * (kConsumers + 1)), smem, stream, p);
}
}  // namespace

extern "C" cudaError_t dsv4_nvfp4_gemv_bulk_launch(const Nvfp4LinearArgs* a, cudaStream_t stream) {
  if (!bulk_on() || a->M < 1 || a->M > 2 || a->K % 256 != 0 || a->K > (1 << 20) || !aligned16(a->x))
    return cudaErrorNotSupported;
  BulkParams p{};
  p.x = reinterpret_cast<const bf16*>(a->x);
  p.M = int(a->M);
  p.K = int(a->K);
  p.gs_act = a->gs_act;
  p.out_kind = a->out_kind;
  p.pdl = a->pdl;
  int64_t tiles = 0;
  auto add = [&](const uint8_t* w, const uint8_t* s, const float* g, void* y, int64_t n, int64_t x_off) {
    if (p.nmat >= kMaxMats || !aligned16(w) || !aligned16(s) || n <= 0) return false;
    const int j = p.nmat++;
    p.w[j] = w;
    p.s[j] = s;
    p.g[j] = g;
    p.y[j] = y;
    p.n[j] = int(n);
    p.x_off[j] = int(x_off);
    p.tile_start[j] = int(tiles);
    tiles += (n + 15) / 16;
    return true;
  };
  if (a->nseg > 0) {
    for (int i = 0; i < a->nseg; ++i)
      if (!add(a->seg_w[i], a->seg_s[i], a->seg_gs[i], a->seg_y[i], a->seg_n[i], 0)) return cudaErrorNotSupported;
    p.x_ld = p.K;
  } else {
    const int64_t G = a->G > 1 ? a->G : 1;
    for (int64_t j = 0; j < G; ++j) {
      const size_t wo = size_t(j) * size_t(a->N) * size_t(a->K / 2), so = size_t(j) * size_t(a->N) * size_t(a->K / 16);
      void* y = reinterpret_cast<uint8_t*>(a->y) + size_t(j) * size_t(a->N) * (a->out_kind == 2 ? 4 : 2);
      if (!add(a->w + wo, a->s + so, a->gs + j, y, a->N, j * a->K)) return cudaErrorNotSupported;
    }
    p.x_ld = int(G * a->K);
    p.y_ld_grouped = G > 1 ? int(G * a->N) : 0;
  }
  p.tile_start[p.nmat] = int(tiles);
  const int sms = dsv4_cuda::sm_count();
  p.n_ctas = int(std::min<int64_t>(sms, tiles));
  const int per_cta = int((tiles + p.n_ctas - 1) / p.n_ctas);
  if (per_cta > kMaxTiles) return cudaErrorNotSupported;
  p.tps = std::max(1, kStageK / p.K);
  p.stage_bytes = p.tps * 16 * (p.K / 2 + p.K / 16);
  // activation rows: the most matrices one CTA's tile range spans (grouped: each reads its own x slice)
  int span = 1;
  if (a->nseg == 0 && a->G > 1) {
    for (int c = 0; c < p.n_ctas; ++c) {
      const int64_t t0 = (int64_t(c) * tiles) / p.n_ctas, t1 = (int64_t(c + 1) * tiles) / p.n_ctas;
      if (t1 > t0) span = std::max<int>(span, int((t1 - 1) / ((a->N + 15) / 16) - t0 / ((a->N + 15) / 16) + 1));
    }
  }
  p.x_rows = span * p.M;
  p.x_stride = p.K * 2 + 16;
  int dev = 0, optin = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  const char* nm = std::getenv("DSV4_NVFP4_BULK_NOMATH");
  p.nomath = nm != nullptr && nm[0] == '1';
  return launch_bulk(p, per_cta, optin, dev, stream);
}

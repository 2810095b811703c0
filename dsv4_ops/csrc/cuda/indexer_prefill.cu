// CUDA kernel of dsv4::indexer_prefill_scores (sm_80+ mma.sync; sm_90a build). No torch headers:
// indexer_bindings.cpp checks and launches.
//
// The lightning indexer's prefill scores out[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]) (fp32), -inf
// where t >= n_visible[b, s]. The torch form materializes the fp32 products [B, S, H, T] (H = 64: 64x the output)
// and reads them three more times (relu, weight, head sum); here they never leave registers.
// One CTA = 64 queries x 128 keys of one row, 4 warps of 16 queries. The key tile (128 x D bf16) stays in shared
// memory for every head; each head's query tile (64 x D) streams through a 3-stage cp.async ring. Per head a warp
// holds its 16 x D query fragments in registers and walks the keys 16 at a time: D / 16 mma.sync m16n8k16 (bf16,
// fp32 accumulate) per 8 keys, then out += w * relu(dot) in registers. Heads are summed in order h = 0, 1, ...
// A key tile no query of the CTA sees is written -inf without a product (the causal half at long prompts).
// Shared memory rows are 256-byte (D = 128) with 16-byte pieces XOR-swizzled by row: ldmatrix conflict-free.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "launchers.h"
#include "mma.h"
#include "smem_copy.h"

namespace {

using namespace dsv4_cuda;  // mma.h, smem_copy.h

constexpr int kD = 128;                     // head dim (DeepSeek-V4 indexer)
constexpr int kPieces = kD / 8;             // 16-byte pieces per row
constexpr int kQ = 64;                      // queries per CTA
constexpr int kT = 128;                     // keys per CTA
constexpr int kThreads = 128;               // 4 warps x 16 queries
constexpr int kStages = 3;                  // query-tile ring depth
constexpr int kRowBytes = kD * 2;           // 256
constexpr int kKeyBytes = kT * kRowBytes;   // 32 KB
constexpr int kQBytes = kQ * kRowBytes;     // 16 KB per stage
constexpr int kSmem = kKeyBytes + kStages * kQBytes;

// Byte offset of piece p (16 bytes) of row r in a swizzled tile.
__device__ __forceinline__ uint32_t tile_off(int r, int p) { return uint32_t(r * kRowBytes + ((p ^ (r & 7)) << 4)); }

// n_visible clamped to [0, T] before it is narrowed to int.
__device__ __forceinline__ int visible(int64_t n, int T) { return int(n < 0 ? 0 : n < T ? n : int64_t(T)); }

struct PrefillArgs {
  const __nv_bfloat16* q;  // [B, S, H, D]
  const float* w;          // [B, S, H]
  const __nv_bfloat16* k;  // [B, T, D]
  const int64_t* nv;       // [B, S]
  float* out;              // [B, S, T]
  int S, H, T;
};

__global__ void __launch_bounds__(kThreads, 2) indexer_prefill_kernel(const PrefillArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int tile_vis;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int t0 = blockIdx.x * kT, s0 = blockIdx.y * kQ, b = blockIdx.z;
  const int S = a.S, H = a.H, T = a.T;
  const int64_t* nv = a.nv + int64_t(b) * S;

  // The most keys any query of the tile sees.
  if (tid == 0) tile_vis = 0;
  __syncthreads();
  int vis = 0;
  for (int i = tid; i < kQ; i += kThreads)
    if (s0 + i < S) vis = max(vis, visible(nv[s0 + i], T));
  atomicMax(&tile_vis, vis);
  __syncthreads();
  float* out = a.out + (int64_t(b) * S) * T;
  if (tile_vis <= t0) {  // no query sees a key of this tile
    for (int i = tid; i < kQ * kT; i += kThreads) {
      const int s = s0 + i / kT, t = t0 + i % kT;
      if (s < S && t < T) out[int64_t(s) * T + t] = -CUDART_INF_F;
    }
    return;
  }

  const uint32_t keys = smem_u32(smem), qring = keys + kKeyBytes;
  // The key tile (rows past T: zeros), then the ring's first stages; one cp.async group per head's stage.
  const __nv_bfloat16* kb = a.k + (int64_t(b) * T) * kD;
  for (int i = tid; i < kT * kPieces; i += kThreads) {
    const int r = i / kPieces, p = i % kPieces, t = t0 + r;
    cp_async16(keys + tile_off(r, p), kb + int64_t(min(t, T - 1)) * kD + p * 8, t < T ? 16 : 0);
  }
  const int64_t q_row = int64_t(H) * kD;  // elements between consecutive queries
  const __nv_bfloat16* qb = a.q + (int64_t(b) * S) * q_row;
  auto issue_q = [&](int h) {
    if (h < H) {
      const uint32_t st = qring + (h % kStages) * kQBytes;
      for (int i = tid; i < kQ * kPieces; i += kThreads) {
        const int r = i / kPieces, p = i % kPieces, s = s0 + r;
        cp_async16(st + tile_off(r, p), qb + int64_t(min(s, S - 1)) * q_row + int64_t(h) * kD + p * 8,
                   s < S ? 16 : 0);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int h = 0; h < kStages - 1; ++h) issue_q(h);

  // This thread's queries (rows g, g + 8 of the warp's 16) and their weight pointers.
  const int qa = s0 + warp * 16 + g, qb8 = qa + 8;
  const float* wa = a.w + (int64_t(b) * S + min(qa, S - 1)) * H;
  const float* wb = a.w + (int64_t(b) * S + min(qb8, S - 1)) * H;
  // ldmatrix lane roles: A (queries) matrix lane >> 3 = {rows 0-7, rows 8-15} x {piece 2kk, 2kk + 1}; B (keys)
  // matrix lane >> 3 = {piece 2kk, 2kk + 1} x {keys 0-7, keys 8-15} of a 16-key step.
  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, a_half = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_half = (lane >> 3) & 1;

  float acc[kT / 8][4];
#pragma unroll
  for (int j = 0; j < kT / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  for (int h = 0; h < H; ++h) {
    issue_q(h + kStages - 1);
    cp_async_wait<kStages - 1>();  // this thread's copies of head h (and the key tile) have landed
    __syncthreads();               // ... and every thread's
    const float w0 = __ldg(wa + h), w1 = __ldg(wb + h);
    const uint32_t st = qring + (h % kStages) * kQBytes;
    uint32_t af[kD / 16][4];
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) ldmatrix_x4(af[kk], st + tile_off(a_row, 2 * kk + a_half));
#pragma unroll
    for (int j = 0; j < kT / 16; ++j) {  // 16 keys: two n-tiles of 8
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t bf[4];  // {keys 0-7 piece 2kk, keys 0-7 piece 2kk + 1, keys 8-15 ..., ...}
        ldmatrix_x4(bf, keys + tile_off(j * 16 + b_row, 2 * kk + b_half));
        mma_bf16(c0, af[kk], bf[0], bf[1]);
        mma_bf16(c1, af[kk], bf[2], bf[3]);
      }
      acc[2 * j][0] += w0 * fmaxf(c0[0], 0.f);
      acc[2 * j][1] += w0 * fmaxf(c0[1], 0.f);
      acc[2 * j][2] += w1 * fmaxf(c0[2], 0.f);
      acc[2 * j][3] += w1 * fmaxf(c0[3], 0.f);
      acc[2 * j + 1][0] += w0 * fmaxf(c1[0], 0.f);
      acc[2 * j + 1][1] += w0 * fmaxf(c1[1], 0.f);
      acc[2 * j + 1][2] += w1 * fmaxf(c1[2], 0.f);
      acc[2 * j + 1][3] += w1 * fmaxf(c1[3], 0.f);
    }
    __syncthreads();  // every warp is done with this stage before a later head's copies refill it
  }
  cp_async_wait<0>();

  // Rows g / g + 8, keys 8j + 2tq, + 1; -inf past each query's visible keys.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int s = half ? qb8 : qa;
    if (s >= S) continue;
    const int n = visible(nv[s], T);
    float* row = out + int64_t(s) * T;
#pragma unroll
    for (int j = 0; j < kT / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = t0 + 8 * j + 2 * tq + e;
        if (t < T) row[t] = t < n ? acc[j][2 * half + e] : -CUDART_INF_F;
      }
    }
  }
}

}  // namespace

extern "C" int dsv4_indexer_prefill_head_dim() { return kD; }

extern "C" cudaError_t dsv4_indexer_prefill_scores_launch(const void* q, const float* w, const void* k,
                                                          const int64_t* n_visible, float* out, int B, int S, int H,
                                                          int T, cudaStream_t stream) {
  if (B == 0 || S == 0 || T == 0) return cudaSuccess;
  if (H == 0) return cudaErrorInvalidValue;  // the bindings refuse it; zero heads would leave out unwritten
  static bool smem_set[64] = {};  // per device; set before the first launch (never inside a capture)
  int dev = 0;
  cudaGetDevice(&dev);
  if (!smem_set[dev & 63]) {
    const cudaError_t err =
        cudaFuncSetAttribute(indexer_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    smem_set[dev & 63] = true;
  }
  PrefillArgs a{static_cast<const __nv_bfloat16*>(q), w, static_cast<const __nv_bfloat16*>(k), n_visible, out, S,
                H, T};
  const dim3 grid(unsigned((T + kT - 1) / kT), unsigned((S + kQ - 1) / kQ), unsigned(B));
  indexer_prefill_kernel<<<grid, kThreads, kSmem, stream>>>(a);
  return cudaGetLastError();
}

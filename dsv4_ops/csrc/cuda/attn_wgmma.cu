// The warpgroup-MMA partial kernel of dsv4::sparse_attn_decode (docs/ops.md "## Decode attention"), sm_90a: many
// rows of 64 heads x 512 dims, bf16 (prefill, where each query is a row). No torch headers: attn.cu's launcher
// calls it (use_mma 3, the attn_kernel override "wgmma"); same workspace and combine kernel as the other partial
// kernels. The mma.sync kernel splits a row's 512 dims over 4 warps and sums their partial scores through shared
// memory for every 32 keys, 82-85 TF/s on the H100 (bench/RESULTS.md, session 33); here the products are whole
// wgmma tiles. A CTA = (split, 64 heads, row), two warpgroups:
//   S = Q K^T: warpgroup w scores all 64 heads against keys 32w .. 32w + 31 of the chunk (wgmma m64n32k16, Q and
//     the staged keys both from shared memory, 32 k-steps of 16 dims);
//   the row maxima of the two halves meet in shared memory (online softmax: both warpgroups rescale by the same
//     maxima), P = exp(S - m) goes to shared memory as bf16 hi + lo parts (as the mma kernel: ~16 significant
//     bits, the fp32-level tolerance);
//   O += P V: warpgroup w accumulates dims 256w .. 256w + 255 of all 64 heads (m64n256k16, P and V from shared
//     memory; V = the staged keys read as an MN-major operand: the key tile's 128-byte rows serve both products).
// Keys and Q are staged by cp.async in 128-byte swizzle atoms (64 dims x 8 rows), the next chunk's keys in flight
// while this one is computed. Each half's sum of exponentials is kept apart and added once (warpgroup 0 + 1).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attn_common.h"
#include "launchers.h"
#include "pdl.h"
#include "smem_copy.h"
#include "wgmma.h"

namespace {

using namespace dsv4_cuda;

constexpr int kD = 512;                // head dim (K = V)
constexpr int kH = 64;                 // heads per CTA: the wgmma M
constexpr int kKeys = 64;              // listed rows per chunk
constexpr int kThreads = 256;          // two warpgroups
constexpr int kPieces = kD / 8;        // 16-byte pieces per row
constexpr int kRegion = 64 * 128;      // 64 dims of a 64-row tile: 8 swizzle atoms of 8 rows, 1 KB apart (8 KB)
constexpr int kTile = (kD / 64) * kRegion;  // 64 rows x 512 dims (64 KB)
constexpr int kPTile = kH * 128;       // 64 heads x 64 keys of bf16 (one region)
constexpr int kQOff = 0, kKOff = kTile, kPOff = 3 * kTile;  // Q, two key stages, P hi then P lo
constexpr int kMaxOff = kPOff + 2 * kPTile;                  // [2 warpgroups][64 heads] row maxima
constexpr int kSumOff = kMaxOff + 2 * kH * 4;                // [2][64] sums of exponentials
constexpr int kIdOff = kSumOff + 2 * kH * 4;                 // [2 stages][64] row ids (-1: none)
constexpr int kSmem = kIdOff + 2 * kKeys * 4 + 1024;         // + the slack that aligns the ring to 1 KB
static_assert(kKOff % 1024 == 0 && kPOff % 1024 == 0 && kPTile % 1024 == 0, "swizzled tiles start 1 KB aligned");
static_assert(kSmem <= 227 * 1024, "shared memory per CTA");

// Byte offset of 16-byte piece p of row r in a 64-row tile of 128-byte swizzle atoms.
__device__ __forceinline__ uint32_t tile_off(int r, int p) {
  return uint32_t((p >> 3) * kRegion + r * 128 + (((p & 7) ^ (r & 7)) << 4));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__global__ void __launch_bounds__(kThreads, 1) attn_partial_wgmma_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int32_t* __restrict__ idx,
    int J1, const int32_t* __restrict__ idx2, int idx2_offset, int H, int N, int J, int64_t kv_batch_stride,
    int kv_batch, int rows_per_split, float scale, float* __restrict__ ws_o, float* __restrict__ ws_ml, int pdl) {
  grid_dep_wait();
  if (pdl) grid_dep_launch();
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), sbase = (raw + 1023u) & ~1023u;
  uint8_t* base = smem_raw + (sbase - raw);
  int* ids = reinterpret_cast<int*>(base + kIdOff);
  float* red_max = reinterpret_cast<float*>(base + kMaxOff);
  float* red_sum = reinterpret_cast<float*>(base + kSumOff);
  const int split = blockIdx.x, h0 = blockIdx.y * kH, b = blockIdx.z, nsplit = gridDim.x;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const __nv_bfloat16* kvb = kv + int64_t(kv_batch ? b % kv_batch : b) * kv_batch_stride;
  const RowList rl = row_list(idx, J1, idx2, J, idx2_offset, b);
  const int j_begin = split * rows_per_split, j_end = min(J, j_begin + rows_per_split);

  // The rows of the chunk at c0 (those at j >= j_end or outside [0, N) zero-filled, id -1) into stage st: one
  // commit group, also when empty (the waits count groups).
  auto stage = [&](int c0, int st) {
    const uint32_t dst = sbase + kKOff + st * kTile;
    for (int e = tid; e < kKeys * kPieces; e += kThreads) {
      const int jj = e / kPieces, pc = e - jj * kPieces, j = c0 + jj;
      int r = j < j_end ? rl.at(j) : -1;
      r = (r >= 0 && r < N) ? r : -1;
      if (pc == 0) ids[st * kKeys + jj] = r;
      cp_async16(dst + tile_off(jj, pc), r >= 0 ? static_cast<const void*>(kvb + int64_t(r) * kD + pc * 8) : kvb,
                 r >= 0 ? 16 : 0);
    }
    cp_async_commit();
  };
  // Q of the CTA's heads (heads >= H zero), then the first chunk.
  for (int e = tid; e < kH * kPieces; e += kThreads) {
    const int hh = e / kPieces, pc = e - hh * kPieces;
    const bool ok = h0 + hh < H;
    const void* src = ok ? static_cast<const void*>(q + (int64_t(b) * H + h0 + hh) * kD + pc * 8) : q;
    cp_async16(sbase + kQOff + tile_off(hh, pc), src, ok ? 16 : 0);
  }
  cp_async_commit();
  stage(j_begin, 0);

  const int r0 = 16 * warp + g;  // this thread's rows (heads) r0, r0 + 8 of the 64
  float o[128];                  // dims 256 wg + 8 i + 2 t (+ 1) of rows r0 (o[4i], o[4i + 1]) and r0 + 8 (+ 2, + 3)
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  int st = 0;
  for (int c0 = j_begin; c0 < j_end; c0 += kKeys, st ^= 1) {
    __syncthreads();  // both warpgroups are done with stage st ^ 1, the P tiles and the maxima of the last chunk
    if (c0 + kKeys < j_end) {
      stage(c0 + kKeys, st ^ 1);
    } else {
      cp_async_commit();
    }
    cp_async_wait<1>();  // Q and this chunk landed (this thread's pieces)
    fence_proxy_async();
    __syncthreads();     // and every thread's
    const uint32_t ks = sbase + kKOff + st * kTile;
    const int* cid = ids + st * kKeys;

    // S over this warpgroup's 32 keys: accumulator 4i + e = row r0 + 8 (e >> 1), key 32 wg + 8 i + 2 t + (e & 1)
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.0f;
    fence_operands(s);  // the zeros are written before the fence, not moved past it
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t off = uint32_t((kk >> 2) * kRegion + (kk & 3) * 32);
      wgmma_ss<32, false>(s, smem_desc(sbase + kQOff + off, 16, 1024), smem_desc(ks + wg * 32 * 128 + off, 16, 1024));
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(s);

    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = cid[32 * wg + 8 * i + 2 * t + (e & 1)] >= 0 ? s[4 * i + e] * scale : -INFINITY;
        s[4 * i + e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = quad_max(mx[r]);
    if (t == 0) red_max[wg * kH + r0] = mx[0], red_max[wg * kH + r0 + 8] = mx[1];
    __syncthreads();
    float alpha[2], psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float cm = fmaxf(red_max[r0 + 8 * r], red_max[kH + r0 + 8 * r]);  // both halves, the same in both
      const float m_new = fmaxf(m_run[r], cm);
      alpha[r] = m_run[r] == -INFINITY ? 0.0f : expf(m_run[r] - m_new);
      m_run[r] = m_new;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float v = s[i];
      s[i] = v == -INFINITY ? 0.0f : expf(v - m_run[(i >> 1) & 1]);
      psum[(i >> 1) & 1] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + quad_sum(psum[r]);
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
    // P of this half as bf16 hi + lo into the K-major 64 x 64 tiles (row r, key k at byte r * 128 + 2k, swizzled)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = r0 + 8 * r, key = 32 * wg + 8 * i + 2 * t;
        const float a0 = s[4 * i + 2 * r], a1 = s[4 * i + 2 * r + 1];
        const uint32_t hi = pack_bf16(a0, a1);
        const __nv_bfloat162 hv = *reinterpret_cast<const __nv_bfloat162*>(&hi);
        const uint32_t lo = pack_bf16(a0 - __low2float(hv), a1 - __high2float(hv));
        const uint32_t off = tile_off(row, key >> 3) + ((2 * key) & 15);
        *reinterpret_cast<uint32_t*>(base + kPOff + off) = hi;
        *reinterpret_cast<uint32_t*>(base + kPOff + kPTile + off) = lo;
      }
    fence_proxy_async();
    __syncthreads();  // both halves of P are in shared memory

    // O += P V over this warpgroup's 256 dims: V rows = keys (K), 64-dim columns kRegion apart (MN-major)
    fence_operands(o);  // the rescaled accumulators are written before the fence
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint64_t v = smem_desc(ks + 4 * wg * kRegion + kk * 16 * 128, kRegion, 1024);
      wgmma_ss<256, true>(o, smem_desc(sbase + kPOff + kk * 32, 16, 1024), v);
      wgmma_ss<256, true>(o, smem_desc(sbase + kPOff + kPTile + kk * 32, 16, 1024), v);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(o);
  }
  cp_async_wait<0>();

  // the two halves' sums of exponentials, warpgroup 0's + 1's
  if (t == 0) red_sum[wg * kH + r0] = l_run[0], red_sum[wg * kH + r0 + 8] = l_run[1];
  __syncthreads();
  const int64_t wbase = (int64_t(b) * nsplit + split) * H;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + r0 + 8 * r;
    if (h >= H) continue;
    float* wo = ws_o + (wbase + h) * kD + 256 * wg + 2 * t;
#pragma unroll
    for (int i = 0; i < 32; ++i)
      *reinterpret_cast<float2*>(wo + 8 * i) = make_float2(o[4 * i + 2 * r], o[4 * i + 2 * r + 1]);
    if (wg == 0 && t == 0) {
      ws_ml[(wbase + h) * 2] = m_run[r];
      ws_ml[(wbase + h) * 2 + 1] = red_sum[r0 + 8 * r] + red_sum[kH + r0 + 8 * r];
    }
  }
}

}  // namespace

extern "C" int dsv4_attn_partial_wgmma_ok(int D) { return D == kD; }

// The partial kernel's launch (attn.cu's launcher, use_mma 3): grid (nsplit, ceil(H / 64), B).
extern "C" cudaError_t dsv4_attn_partial_wgmma_launch(const void* q, const void* kv, const int32_t* idx, int J1,
                                                      const int32_t* idx2, int idx2_offset, int B, int H, int N,
                                                      int J, int64_t kv_batch_stride, int kv_batch, float scale,
                                                      float* ws_o, float* ws_ml, int nsplit, int rows_per_split,
                                                      int pdl, cudaStream_t stream) {
  static bool opted_in[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!opted_in[dev]) {
    const cudaError_t e =
        cudaFuncSetAttribute(attn_partial_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return e;
    opted_in[dev] = true;
  }
  return launch_ex(pdl != 0, attn_partial_wgmma_kernel, dim3(nsplit, (H + kH - 1) / kH, B), dim3(kThreads),
                   size_t(kSmem), stream, static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(kv),
                   idx, J1, idx2, idx2_offset, H, N, J, kv_batch_stride, kv_batch, rows_per_split, scale, ws_o, ws_ml,
                   pdl);
}

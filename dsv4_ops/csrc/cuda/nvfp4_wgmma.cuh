// Hopper's warpgroup MMA for the NVFP4 tile kernels (nvfp4_wgmma.cu: dense and MoE): the wgmma primitives, the
// shared-memory ring of one CTA (TN = 128 features = two warpgroups of 64, or the wide tile's 256 = two blocks of
// 64 per warpgroup; TM tokens) and its K loop. Each warp decodes its 16 rows' (per block) weights into registers
// as wgmma's A operand (the m64k16 register fragment is, warp by warp, mma.sync's
// m16k16 one: nvfp4_mma.cuh's decode); B, the activations, is read by the tensor cores from shared memory (K-major,
// 128-byte swizzle atoms of 8 rows x 64 k: two atoms per 128-k chunk).
#pragma once
#include "nvfp4_tile.cuh"
#include "wgmma.h"

namespace {

constexpr int kWgStages = 4;  // chunk i in the tensor cores, i + 1 decoded, i + 2 .. i + 3 loading

// The wide tile (TN = 256) halves the activation bytes each output costs: every CTA reads its TM tokens' rows
// once per TN features, and past a few hundred tokens those L2 reads, not the weights, bound the 128-row tile.
template <int TM, int TN = kTileN>
struct WgCfg {
  static constexpr int kBlocks = TN / 128;     // 64-row wgmma blocks per warpgroup
  static constexpr int kXStage = TM * 256;     // bf16 activations: 2 atoms of TM rows x 64 k (128 B), swizzled
  static constexpr int kWStage = TN * 64;      // packed weights, TN rows x one chunk
  static constexpr int kSStage = TN * 8;       // scale bytes
  static constexpr int kStageBytes = kXStage + kWStage + kSStage;
  static constexpr int kSmem = kStageBytes * kWgStages + 1024;  // + the slack that aligns the ring to 1 KB
  static constexpr int kOcc = TM * kBlocks >= 128 ? 1 : 2;      // CTAs per SM the launch bounds allow
  static constexpr int kXLoads = TM * 16 / kThreads;            // 16-byte activation pieces per thread per stage
  static constexpr int kAcc = TM / 2 * kBlocks;                 // fp32 accumulators per thread
  static_assert(TN == 128 || TN == 256, "tile rows");
  static_assert(kStageBytes % 1024 == 0, "every stage's atoms start 1 KB aligned (the swizzle's period)");
  static_assert(kXLoads >= 1, "tile shape");
  static_assert(TM * out_stride<TN>() * 4 <= kStageBytes * kWgStages, "epilogue staging must fit in the ring");
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA");
};

using dsv4_cuda::fence_operands;
using dsv4_cuda::fence_proxy_async;
using dsv4_cuda::wgmma_commit;
using dsv4_cuda::wgmma_fence;
using dsv4_cuda::wgmma_rs;
using dsv4_cuda::wgmma_wait;

// Descriptor of the K-major activation operand (8-row groups 1 KB apart).
__device__ __forceinline__ uint64_t b_desc(uint32_t saddr) { return dsv4_cuda::smem_desc(saddr, 16, 1024); }

// One 128-k chunk of the CTA's tile in the stage at xs (generic pointer) / xs_s (shared-window address): decode
// its weights (this warp's 16 rows g, g + 8 of each 64-row block: r0 = 16 warp + g) into wgmma's A registers and
// issue the wgmmas. Per 64-row block of the warpgroup, two wgmma groups of 4 k-steps (order: half 0 of every
// block, then half 1); a pending wgmma's A registers must not be written (PTX ISA, wgmma.wait_group), so A
// fragments live in two slots used by alternate groups, and a group's slot is written only once the group before
// its predecessor has retired (wait_group 1): each group is decoded while the previous one runs. On return every
// group of the previous chunk has retired (a chunk has >= 2 groups) and this chunk's last group may still run.
// acc: this thread's accumulators, block b at acc[b * TM / 2 ..] (rows r0 + 128 b / + 8; D fragment: accumulator
// 4i + e = row + 8 (e >> 1), token 8i + 2 tq + (e & 1)).
template <int TM, int TN>
__device__ __forceinline__ void wgmma_chunk(const uint8_t* xs, uint32_t xs_s, int r0, int tq,
                                            float (&acc)[WgCfg<TM, TN>::kAcc]) {
  using Cfg = WgCfg<TM, TN>;
  constexpr int B = Cfg::kBlocks;
  const uint32_t w_ld = uint32_t(Cfg::kXStage + r0 * 64 + tq * 16);
  const uint32_t s_ld = uint32_t(Cfg::kXStage + Cfg::kWStage + r0 * 8);
  uint4 wa[B], wb[B];
  RowScales sa[B], sb[B];
#pragma unroll
  for (int b = 0; b < B; ++b) {  // block b: rows r0 + 128 b (wa, sa) and + 8 (wb, sb)
    wa[b] = *reinterpret_cast<const uint4*>(xs + w_ld + b * 128 * 64);
    wb[b] = *reinterpret_cast<const uint4*>(xs + w_ld + b * 128 * 64 + 8 * 64);
    sa[b] = row_scales(*reinterpret_cast<const uint2*>(xs + s_ld + b * 128 * 8));
    sb[b] = row_scales(*reinterpret_cast<const uint2*>(xs + s_ld + b * 128 * 8 + 8 * 8));
  }
  uint32_t a[2][4][4];  // [slot][k-step of the half]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int slot = (h * B + b) & 1;
      uint32_t ra[2][4], rb[2][4];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = 2 * h + jj;
        decode_word(j == 0 ? wa[b].x : j == 1 ? wa[b].y : j == 2 ? wa[b].z : wa[b].w, ra[jj]);
        decode_word(j == 0 ? wb[b].x : j == 1 ? wb[b].y : j == 2 ? wb[b].z : wb[b].w, rb[jj]);
      }
      wgmma_wait<1>();  // the group that last read this slot (two groups back) is done
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = 2 * h + jj;
        a_fragment_rs(ra[jj], rb[jj], sa[b], sb[b], 2 * j, a[slot][2 * jj]);
        a_fragment_rs(ra[jj], rb[jj], sa[b], sb[b], 2 * j + 1, a[slot][2 * jj + 1]);
      }
      wgmma_fence();
      float(&d)[TM / 2] = *reinterpret_cast<float(*)[TM / 2]>(acc + b * (TM / 2));
#pragma unroll
      for (int s = 4 * h; s < 4 * h + 4; ++s)
        wgmma_rs<TM>(d, a[slot][s & 3], b_desc(xs_s + uint32_t((s >> 2) * (TM * 128) + (s & 3) * 32)));
      wgmma_commit();
    }
  }
}

// The CTA's K loop over n_local chunks, loaded by every thread with cp.async: load_stage(stage pointer) issues one
// chunk's copies (weights at kXStage, scale bytes at kXStage + kWStage, activations at 0 in the swizzled atoms,
// this thread's share), two chunks ahead, one stage kept for the chunk in flight. Returns with every copy and
// wgmma done and the CTA synchronized (the ring is free). One CTA barrier per chunk: the refill of chunk i - 2's
// stage is issued after the barrier that publishes chunk i (a second barrier before the refill measured 1-10% slower,
// bench/RESULTS.md, session 50).
template <int TM, int TN, typename LoadStage>
__device__ __forceinline__ void wgmma_k_loop(uint8_t* smem, uint32_t smem_s, int n_local, int r0, int tq,
                                             LoadStage&& load_stage, float (&acc)[WgCfg<TM, TN>::kAcc]) {
  using Cfg = WgCfg<TM, TN>;
  constexpr int S = kWgStages;
#pragma unroll
  for (int st = 0; st < S - 2; ++st) {
    if (st < n_local) load_stage(smem + st * Cfg::kStageBytes);
    cp_async_commit();
  }
  for (int i = 0; i < n_local; ++i) {
    cp_async_wait<S - 3>();  // chunks up to i + S - 3 are committed: this thread's pieces of chunk i landed
    fence_proxy_async();
    __syncthreads();  // every thread's too; and every warp returned from chunk i - 1, so chunk i - 2 retired
    if (i + S - 2 < n_local) load_stage(smem + ((i + S - 2) % S) * Cfg::kStageBytes);
    cp_async_commit();
    const int st = i % S;
    wgmma_chunk<TM, TN>(smem + st * Cfg::kStageBytes, smem_s + uint32_t(st * Cfg::kStageBytes), r0, tq, acc);
  }
  wgmma_wait<0>();
  fence_operands(acc);
  cp_async_wait<0>();
  __syncthreads();
}

// The CTA's dynamic shared memory, aligned to 1 KB (the swizzle atoms' period): generic pointer and shared-window
// address (WgCfg::kSmem has the slack).
struct AlignedSmem {
  uint8_t* p;
  uint32_t s;
};
__device__ __forceinline__ AlignedSmem aligned_smem(uint8_t* raw_ptr) {
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(raw_ptr));
  const uint32_t s = (raw + 1023u) & ~1023u;
  return {raw_ptr + (s - raw), s};
}

// Shared-memory offset of activation piece (token row r, 16-byte piece ch of the chunk's 256 B): atom ch >> 3,
// row r, piece (ch & 7) ^ (r & 7).
template <int TM>
__device__ __forceinline__ uint32_t x_piece_offset(int r, int ch) {
  return uint32_t((ch >> 3) * (TM * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}

}  // namespace

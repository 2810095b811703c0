// The gemv kernel's per-warp ring as pieces for the two kernels that run it: the gemv kernel (nvfp4_gemv.cu) and
// the chain kernel (chain.cu), whose tasks must compute a gemv CTA's exact sums. A warp owns a 16-row tile over a
// K range; each ring stage holds one 128-wide chunk: the tile's codes, its scale bytes and the chunk's activation
// rows, filled by cp.async.
#pragma once
#include "nvfp4_kernels.cuh"

namespace {

template <int ROWS, int STAGES>  // activation rows per pass (2 or 8); the mma's other columns repeat them, dropped
struct GemvRing {
  static constexpr int kStages = STAGES;
  static constexpr int kW = 1024;        // [2][32 lanes] x 16 B: rows g / g + 8 of the chunk, lane order
  static constexpr int kS = 128;         // [16 rows] x 8 scale bytes
  static constexpr int kX = ROWS * 256;  // [ROWS] x 128 bf16, 16-byte pieces XOR-swizzled by row (ldmatrix)
  static constexpr int kStage = kW + kS + kX;
  static constexpr int kSmem = kStage * kStages * kWarps;
};

// This lane's fixed offsets in a stage: x_dst[i], where it copies piece lane & 15 (8 bf16) of activation row
// (lane >> 4) + 2i (XOR-swizzled); ldm[q], where its ldmatrix of k-steps 2q / 2q + 1 reads (matrix m = lane >> 3:
// k-step 2q + m / 2, half m & 1; token row lane & 7, repeating the pass rows).
template <int ROWS>
struct RingLane {
  uint32_t x_dst[ROWS / 2];
  uint32_t ldm[4];
};

template <int ROWS>
__device__ __forceinline__ RingLane<ROWS> ring_lane(int lane) {
  constexpr int kX0 = GemvRing<ROWS, 1>::kW + GemvRing<ROWS, 1>::kS;
  RingLane<ROWS> r;
  const int pc = lane & 15;
#pragma unroll
  for (int i = 0; i < ROWS / 2; ++i) {
    const int row = (lane >> 4) + 2 * i;
    r.x_dst[i] = kX0 + row * 256 + ((pc ^ (row & 7)) << 4);
  }
  const int xr = (lane & 7) & (ROWS - 1), xm = lane >> 3;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int piece = (2 * q + (xm >> 1)) * 2 + (xm & 1);
    r.ldm[q] = kX0 + xr * 256 + ((piece ^ xr) << 4);
  }
  return r;
}

// Chunk ci's codes (rows g / g + 8: wa / wb, this lane's 16 bytes each) and scale bytes (row `lane`, lanes < 16)
// into stage stg.
__device__ __forceinline__ void ring_copy_weights(uint8_t* stg, int lane, const uint8_t* wa, const uint8_t* wb,
                                                  const uint8_t* s, uint32_t ci, uint32_t wstep, uint32_t sstep) {
  cp_async16(stg + lane * 16, wa + ci * wstep, 16);
  cp_async16(stg + 512 + lane * 16, wb + ci * wstep, 16);
  if (lane < 16) cp_async8(stg + 1024 + lane * 8, s + ci * sstep, 8);
}

// The mma of a landed stage: codes, scales and the activation fragments (ldmatrix) into acc0 / acc1.
__device__ __forceinline__ void ring_chunk_mma(const uint8_t* st, int lane, const uint32_t (&ldm)[4],
                                               float (&acc0)[4], float (&acc1)[4]) {
  const int g = lane >> 2;
  const uint4 wa = *reinterpret_cast<const uint4*>(st + lane * 16);
  const uint4 wb = *reinterpret_cast<const uint4*>(st + 512 + lane * 16);
  const RowScales sa = row_scales(*reinterpret_cast<const uint2*>(st + 1024 + g * 8));
  const RowScales sb = row_scales(*reinterpret_cast<const uint2*>(st + 1024 + (g + 8) * 8));
  uint32_t b[4][4];  // k-steps 2q, 2q + 1: {b0, b1, b0', b1'}
#pragma unroll
  for (int q = 0; q < 4; ++q) ldmatrix_x4(b[q], st + ldm[q]);
  chunk_mma(wa, wb, sa, sb, b, acc0, acc1);
}

// The tile's sums: acc0 + acc1, then (nkw > 1 warps splitting K, a tile's warps consecutive, split kw of them)
// the other splits' added into split 0's in split order. Every thread of the CTA calls it (a CTA barrier inside
// when nkw > 1); only split 0's acc is the tile's.
__device__ __forceinline__ void reduce_k_splits(const float (&acc0)[4], const float (&acc1)[4], float (&acc)[4],
                                                float (&red)[kWarps][4][32], int warp, int kw, int nkw, int lane) {
#pragma unroll
  for (int r = 0; r < 4; ++r) acc[r] = acc0[r] + acc1[r];
  if (nkw > 1) {
    if (kw != 0) {
#pragma unroll
      for (int r = 0; r < 4; ++r) red[warp][r][lane] = acc[r];
    }
    __syncthreads();
    if (kw == 0) {
      for (int w2 = 1; w2 < nkw; ++w2) {
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r] += red[warp + w2][r][lane];
      }
    }
  }
}

}  // namespace

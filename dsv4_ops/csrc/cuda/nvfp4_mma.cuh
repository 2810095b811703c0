// Device primitives shared by the NVFP4 weight kernels (nvfp4_gemv.cu, nvfp4_skinny.cu, nvfp4_tiled.cu): the
// kernel-layout word decode to bf16x2, the block-scale pairs, the bf16 mma of one chunk,
// the output store. Layout and exactness argument: nvfp4_gemm.cu's file comment.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

#include "nvfp4_layout.h"

namespace dsv4_nvfp4 {

constexpr uint32_t kPairMask = 0x81C081C0u;   // sign + 3 exponent/mantissa bits of both bf16 halves
constexpr uint32_t kScaleBias = 0x76007600u;  // (236 << 7) per half: scale byte -> bf16(scale * 2^119)
constexpr float kUnbias = 128.0f;             // e2m1 * 2^-126 * scale * 2^119 = value * 2^-7

// ------------------------------------------------------------------------------------------ primitives
// Four bf16x2 registers (pairs q = 0..3) of one kernel-layout word, each half = +-e2m1 * 2^-126.
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t (&r)[4]) {
  r[0] = w & kPairMask;
  r[1] = (w << 3) & kPairMask;
  r[2] = (w << 6) & kPairMask;
  r[3] = ((w >> 4) & 0x00C000C0u) | ((w >> 5) & 0x01000100u) | ((w << 1) & 0x80008000u);
}

// bf16x2 {scale * 2^119, scale * 2^119} of scale byte b (0..3) of `word`.
__device__ __forceinline__ uint32_t scale_pair(uint32_t word, int b) {
  const uint32_t x = __byte_perm(word, 0u, 0x4040u | uint32_t(b) | (uint32_t(b) << 8));
  return x * 16u + kScaleBias;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// A fragment {a0, a1, a2, a3} of k-step s (0..7) of a 128-wide chunk: rows g / g + 8 as decode_word gave them
// for word s >> 1 (ra / rb), times each row's block scale s (scale bytes sa / sb of the chunk).
__device__ __forceinline__ void a_fragment(const uint32_t (&ra)[4], const uint32_t (&rb)[4], uint2 sa, uint2 sb,
                                           int s, uint32_t (&a)[4]) {
  const int hs = s & 1;
  const uint32_t sca = scale_pair(s < 4 ? sa.x : sa.y, s & 3);
  const uint32_t scb = scale_pair(s < 4 ? sb.x : sb.y, s & 3);
  a[0] = bf16x2_mul(ra[2 * hs], sca);
  a[1] = bf16x2_mul(rb[2 * hs], scb);
  a[2] = bf16x2_mul(ra[2 * hs + 1], sca);
  a[3] = bf16x2_mul(rb[2 * hs + 1], scb);
}

// The 8 block scales of one row of a chunk (scale bytes b) as bf16 scale * 2^119, two per register:
// {s0, s2}, {s1, s3}, {s4, s6}, {s5, s7} -- 5 instructions per 4 scales instead of a PRMT + IMAD per scale.
struct RowScales {
  uint32_t r[4];
};
__device__ __forceinline__ RowScales row_scales(uint2 b) {
  RowScales s;
  s.r[0] = (b.x & 0x00FF00FFu) * 16u + kScaleBias;
  s.r[1] = ((b.x >> 8) & 0x00FF00FFu) * 16u + kScaleBias;
  s.r[2] = (b.y & 0x00FF00FFu) * 16u + kScaleBias;
  s.r[3] = ((b.y >> 8) & 0x00FF00FFu) * 16u + kScaleBias;
  return s;
}
// {x.lo, x.lo} / {x.hi, x.hi}: ptxas folds these into the multiply's operand selector (HMUL2 ... R.H0_H0).
__device__ __forceinline__ uint32_t bcast_lo(uint32_t x) {
  uint32_t d;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {l, l};}" : "=r"(d) : "r"(x));
  return d;
}
__device__ __forceinline__ uint32_t bcast_hi(uint32_t x) {
  uint32_t d;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {h, h};}" : "=r"(d) : "r"(x));
  return d;
}
// a_fragment with the scales from row_scales (the same products).
__device__ __forceinline__ void a_fragment_rs(const uint32_t (&ra)[4], const uint32_t (&rb)[4], const RowScales& sa,
                                              const RowScales& sb, int s, uint32_t (&a)[4]) {
  const int hs = s & 1, reg = (s >> 2) * 2 + (s & 1);
  const uint32_t sca = (s >> 1) & 1 ? bcast_hi(sa.r[reg]) : bcast_lo(sa.r[reg]);
  const uint32_t scb = (s >> 1) & 1 ? bcast_hi(sb.r[reg]) : bcast_lo(sb.r[reg]);
  a[0] = bf16x2_mul(ra[2 * hs], sca);
  a[1] = bf16x2_mul(rb[2 * hs], scb);
  a[2] = bf16x2_mul(ra[2 * hs + 1], sca);
  a[3] = bf16x2_mul(rb[2 * hs + 1], scb);
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// v into element idx of an output of kind 0 bf16 / 1 fp16 / 2 fp32 (the launchers' out_kind).
__device__ __forceinline__ void store_out(void* y, size_t idx, float v, int kind) {
  if (kind == 0)
    reinterpret_cast<__nv_bfloat16*>(y)[idx] = __float2bfloat16(v);
  else if (kind == 1)
    reinterpret_cast<__half*>(y)[idx] = __float2half(v);
  else
    reinterpret_cast<float*>(y)[idx] = v;
}

// One 128-wide chunk of a 16-row tile: the codes of rows g / g + 8 (wa / wb, this lane's 4 words each) times
// their block scales, against the B fragments b[q] = {b0, b1, b0', b1'} of k-steps 2q / 2q + 1; even k-steps
// accumulate into acc0, odd ones into acc1 (two independent mma chains).
__device__ __forceinline__ void chunk_mma(uint4 wa, uint4 wb, const RowScales& sa, const RowScales& sb,
                                          const uint32_t (&b)[4][4], float (&acc0)[4], float (&acc1)[4]) {
  const uint32_t wra[4] = {wa.x, wa.y, wa.z, wa.w};
  const uint32_t wrb[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t ra[4], rb[4], a[4];
    decode_word(wra[q], ra);
    decode_word(wrb[q], rb);
    a_fragment_rs(ra, rb, sa, sb, 2 * q, a);
    mma16816(acc0, a[0], a[1], a[2], a[3], b[q][0], b[q][1]);
    a_fragment_rs(ra, rb, sa, sb, 2 * q + 1, a);
    mma16816(acc1, a[0], a[1], a[2], a[3], b[q][2], b[q][3]);
  }
}

}  // namespace dsv4_nvfp4

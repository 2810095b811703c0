// Device-side pieces of the NVFP4 quantization kernels (nvfp4_quant.cu, their only includer): the element
// sources, the exact numerics, the reductions and the grid barrier. No torch headers.
//
// Numerics are bit-identical to the CPU kernel and to dsv4_ops/reference.py: every fp32 step uses an explicit
// _rn intrinsic (never contracted into an FMA, never approximate), and the E2M1 encoder below is exact RNE.
//
// E2M1 encoder: in "code space" the E2M1 grid {0,.5,1,1.5,2,3,4,6} -> {0..7} is piecewise linear and concave,
// so code(a) = round(min(2a, a+2, a/2+4)) saturated at 7. Rounding is monotone, hence it commutes with min:
// each piece is rounded on its own by one FFMA/FADD with 2^23 (integer grid, ties to even = even code), then
// three FMNMX. fminf makes NaN -> 7. Checked equal to the threshold form for every fp32 in [0, 8].
// The code's sign bit is the input element's raw sign bit (gathered with PRMT sign replication).

#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "pdl.h"

namespace cg = cooperative_groups;
using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;
using dsv4_cuda::set_pdl_attribute;

namespace dsv4::nvfp4 {
// Must match nvfp4_quant_bindings.cpp.
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
}  // namespace dsv4::nvfp4

namespace {

using dsv4::nvfp4::DType;

constexpr int kThreads = 512;  // largest CTA of the fused kernels (launch bounds)
constexpr float kFltMax = 3.40282347e38f;

// ------------------------------------------------------------------------------------- small helpers

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

enum class Ld { kNormal, kEvictFirst };

template <Ld kPolicy>
__device__ __forceinline__ uint4 ldg16(const void* p) {
  uint4 r;
  if constexpr (kPolicy == Ld::kEvictFirst) {
    asm volatile(
        "{\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
        " ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], pol;\n}"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  }
  return r;
}

// n / d for n < 2^31 with a precomputed magic (Granlund-Montgomery, as in ATen's IntDivider).
struct FastDiv {
  uint32_t d = 1, m = 0, s = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t div) : d(div) {
    while ((1ull << s) < div) ++s;
    m = (uint32_t)((((1ull << 32) * ((1ull << s) - div)) / div) + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
};

// Row index of quant block q (qbpr blocks per row); fast path when everything fits in 31 bits.
struct RowOf {
  FastDiv fd;
  int64_t qbpr = 1;
  bool fast = true;
  __device__ __forceinline__ int64_t operator()(int64_t q) const {
    return fast ? (int64_t)fd.div((uint32_t)q) : q / qbpr;
  }
};

RowOf make_row_of(int64_t qbpr, int64_t n_qb) {
  RowOf r;
  r.qbpr = qbpr;
  r.fast = n_qb < (1ll << 31) && qbpr < (1ll << 31);
  if (r.fast) r.fd = FastDiv((uint32_t)qbpr);
  return r;
}

// ----------------------------------------------------------------------------------- the numerics

__device__ __forceinline__ float gs_enc_of(float gs) { return gs > 0.0f ? fminf(__frcp_rn(gs), kFltMax) : 0.0f; }

__device__ __forceinline__ float e4m3_to_f32(uint32_t b) {  // b in [0, 0x7E]; subnormals handled by fp32 denormals
  return __fmul_rn(__uint_as_float((b & 0x7Fu) << 20), 0x1p120f);
}

// 8 codes of v[0..7] * s, packed (element 0 in the low nibble), sign bits from `signs` (0x88888888 positions).
__device__ __forceinline__ uint32_t encode8(const float* v, float s, uint32_t signs) {
  uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float a = fabsf(__fmul_rn(v[j], s));
    const float c = fminf(fminf(__fmaf_rn(a, 2.0f, 8388608.0f), __fadd_rn(a, 8388610.0f)),
                          fminf(__fmaf_rn(a, 0.5f, 8388612.0f), 8388615.0f));
    acc += __float_as_uint(c) << (4 * j);  // = (0x4B000000 + code) << 4j; the constant part is removed below
  }
  constexpr uint32_t kBias = 0x4B000000u * 0x11111111u;
  return (acc - kBias) | (signs & 0x88888888u);
}

// Sign masks from 16-bit storage: w[0..3] hold elements 0..7 (element 2i in the low half of w[i]).
__device__ __forceinline__ uint32_t signs16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t a = prmt(w0, w1, 0xFBD9);  // bytes: sign-replicated s0, s2, s1, s3
  const uint32_t b = prmt(w2, w3, 0xFBD9);  // s4, s6, s5, s7
  const uint32_t e = prmt(a, b, 0x5410);    // s0, s2, s4, s6
  const uint32_t o = prmt(a, b, 0x7632);    // s1, s3, s5, s7
  return (e & 0x0F0F0F0Fu) | (o & 0xF0F0F0F0u);
}

// Sign masks from 8 fp32 values.
__device__ __forceinline__ uint32_t signs32(const float* f) {
  const uint32_t e = prmt(prmt(__float_as_uint(f[0]), __float_as_uint(f[2]), 0x00FB),
                          prmt(__float_as_uint(f[4]), __float_as_uint(f[6]), 0x00FB), 0x5410);
  const uint32_t o = prmt(prmt(__float_as_uint(f[1]), __float_as_uint(f[3]), 0x00FB),
                          prmt(__float_as_uint(f[5]), __float_as_uint(f[7]), 0x00FB), 0x5410);
  return (e & 0x0F0F0F0Fu) | (o & 0xF0F0F0F0u);
}

// A decoded 16-element block.
struct Block {
  float v[16];
  uint32_t sg[2];
};

__device__ __forceinline__ float block_absmax(const Block& b) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(b.v[i]));  // fmaxf skips NaN
  return m;
}

// Quantizes one block given the dequant-direction global scale and its encode-direction inverse.
__device__ __forceinline__ void quant_block(const Block& b, float vmax, float gs, float gs_enc, uint2* packed,
                                            uint8_t* sf) {
  float s = __fdiv_rn(__fmul_rn(gs_enc, vmax), 6.0f);
  s = fminf(s, 448.0f);  // satfinite; NaN (0 * inf) -> 448
  const uint32_t sf8 = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
  const float sff = e4m3_to_f32(sf8);
  const float os = sff == 0.0f ? 0.0f : fminf(__frcp_rn(__fmul_rn(sff, gs)), kFltMax);
  uint2 r;
  r.x = encode8(b.v, os, b.sg[0]);
  r.y = encode8(b.v + 8, os, b.sg[1]);
  *packed = r;
  *sf = (uint8_t)sf8;
}

// ------------------------------------------------------------------------------------ element sources
// Raw: what a thread keeps in registers for one 16-element quant block (q = global block index).

template <typename T>
struct Src16 {  // bf16 / fp16 input [rows, K]: block q = elements [16q, 16q + 16)
  static constexpr bool kHeavyLoad = false;
  struct Raw {
    uint4 a, b;
  };
  const T* x;
  template <Ld kPolicy>
  __device__ __forceinline__ void load(Raw& r, int64_t q, int64_t /*row*/) const {
    const uint4* p = reinterpret_cast<const uint4*>(x) + 2 * q;
    r.a = ldg16<kPolicy>(p);
    r.b = ldg16<kPolicy>(p + 1);
  }
  __device__ __forceinline__ static float lo(uint32_t w) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(w << 16);
    else return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu)));
  }
  __device__ __forceinline__ static float hi(uint32_t w) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(w & 0xFFFF0000u);
    else return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
  }
  __device__ __forceinline__ void decode(const Raw& r, Block& b) const {
    const uint32_t w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      b.v[2 * i] = lo(w[i]);
      b.v[2 * i + 1] = hi(w[i]);
    }
    b.sg[0] = signs16(w[0], w[1], w[2], w[3]);
    b.sg[1] = signs16(w[4], w[5], w[6], w[7]);
  }
};

struct SrcF32 {  // fp32 input
  static constexpr bool kHeavyLoad = false;
  struct Raw {
    uint4 v[4];
  };
  const float* x;
  template <Ld kPolicy>
  __device__ __forceinline__ void load(Raw& r, int64_t q, int64_t /*row*/) const {
    const uint4* p = reinterpret_cast<const uint4*>(x) + 4 * q;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.v[i] = ldg16<kPolicy>(p + i);
  }
  __device__ __forceinline__ void decode(const Raw& r, Block& b) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      b.v[4 * i] = __uint_as_float(r.v[i].x);
      b.v[4 * i + 1] = __uint_as_float(r.v[i].y);
      b.v[4 * i + 2] = __uint_as_float(r.v[i].z);
      b.v[4 * i + 3] = __uint_as_float(r.v[i].w);
    }
    b.sg[0] = signs32(b.v);
    b.sg[1] = signs32(b.v + 8);
  }
};

// exp from IEEE mul/add only: same steps as reference.exp_portable and the CPU kernel.
__device__ __forceinline__ float exp_portable(float t) {
  t = fminf(fmaxf(t, -104.0f), 89.0f);
  const float kf = __fsub_rn(__fadd_rn(__fmul_rn(t, 0x1.715476p+0f), 12582912.0f), 12582912.0f);
  const float r = __fsub_rn(__fsub_rn(t, __fmul_rn(kf, 0x1.63p-1f)), __fmul_rn(kf, -0x1.bd0106p-13f));
  float p = 0x1.a01a02p-13f;
  p = __fadd_rn(__fmul_rn(p, r), 0x1.6c16c2p-10f);
  p = __fadd_rn(__fmul_rn(p, r), 0x1.111112p-7f);
  p = __fadd_rn(__fmul_rn(p, r), 0x1.555556p-5f);
  p = __fadd_rn(__fmul_rn(p, r), 0x1.555556p-3f);
  p = __fadd_rn(__fmul_rn(p, r), 0.5f);
  p = __fadd_rn(__fmul_rn(p, r), 1.0f);
  p = __fadd_rn(__fmul_rn(p, r), 1.0f);
  const int k = (int)kf;
  const int k1 = k >> 1;
  return __fmul_rn(__fmul_rn(p, __uint_as_float((uint32_t)(k - k1 + 127) << 23)),
                   __uint_as_float((uint32_t)(k1 + 127) << 23));
}

__device__ __forceinline__ float swiglu_limited(float g, float u, float limit) {
  g = g > limit ? limit : g;  // keeps NaN, like torch.clamp
  u = u > limit ? limit : (u < -limit ? -limit : u);
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, exp_portable(-g))), u);
}

template <typename T>
struct SrcDeint {  // gate_up [rows, 2I], element-wise pairs; h block q reads elements [32q, 32q + 32)
  static constexpr bool kHeavyLoad = true;  // loads twice the bytes and computes swiglu in registers
  struct Raw {
    float h[16];
  };
  const T* gu;
  const float* w;  // [rows] or nullptr
  float limit;
  __device__ __forceinline__ static float2 pair(uint32_t word) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xFFFF0000u));
    else return __half22float2(*reinterpret_cast<const __half2*>(&word));
  }
  template <Ld kPolicy>
  __device__ __forceinline__ void load(Raw& r, int64_t q, int64_t row) const {
    float g[16], u[16];
    if constexpr (std::is_same_v<T, float>) {
      const uint4* p = reinterpret_cast<const uint4*>(gu) + 8 * q;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint4 v = ldg16<kPolicy>(p + i);
        g[2 * i] = __uint_as_float(v.x);
        u[2 * i] = __uint_as_float(v.y);
        g[2 * i + 1] = __uint_as_float(v.z);
        u[2 * i + 1] = __uint_as_float(v.w);
      }
    } else {
      const uint4* p = reinterpret_cast<const uint4*>(gu) + 4 * q;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = ldg16<kPolicy>(p + i);
        const uint32_t ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = pair(ws[j]);
          g[4 * i + j] = f.x;
          u[4 * i + j] = f.y;
        }
      }
    }
    const float wr = w ? __ldg(w + row) : 1.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float h = swiglu_limited(g[i], u[i], limit);
      if (w) h = __fmul_rn(h, wr);
      r.h[i] = h != h ? __uint_as_float(0x7FC00000u) : h;  // +NaN: a made NaN's sign is platform-dependent
    }
  }
  __device__ __forceinline__ void decode(const Raw& r, Block& b) const {
#pragma unroll
    for (int i = 0; i < 16; ++i) b.v[i] = r.h[i];
    b.sg[0] = signs32(b.v);
    b.sg[1] = signs32(b.v + 8);
  }
};

// Blocks a thread keeps in registers (~64 registers of data) and blocks it streams at once.
template <class Src>
constexpr int kRegBlocks = sizeof(typename Src::Raw) <= 32 ? 8 : 4;
template <class Src>
constexpr int kStreamUnroll = sizeof(typename Src::Raw) <= 32 ? 4 : Src::kHeavyLoad ? 1 : 2;

// ------------------------------------------------------------------- reductions and the grid barrier

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Max over the CTA; every thread gets the result. `red` holds >= 33 floats.
__device__ __forceinline__ float cta_max(float v, float* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float m = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0f;
    m = warp_max(m);
    if (lane == 0) red[32] = m;
  }
  __syncthreads();
  return red[32];
}

// Per user: {max bits of even / odd generations, arrivals, pad, published {max bits, generation} (64-bit)}; zero at
// module load. A launch of generation g collects maxima in word g & 1; its last arrival publishes the max with
// generation g + 1 in one 64-bit store and zeroes the arrivals and the other parity's max (the next launch's), so
// no CTA has to leave through a second counter.
__device__ __align__(16) unsigned int g_grid_sync[2][8];

__device__ __forceinline__ unsigned long long ld_acquire_u64(const unsigned int* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// The current generation (thread 0, at the kernel's start: the previous launch has completed).
__device__ __forceinline__ unsigned int grid_generation(const unsigned int* s) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(s + 4) : "memory");
  return (unsigned int)(v >> 32);
}

// Grid-wide max of nonnegative floats (thread 0 of each CTA calls it, with the generation read at its start).
// All CTAs must be co-resident. The arrival is acq_rel, so the last one sees every CTA's max; the waiters take
// the max from the same 64-bit word whose generation they wait for (no second load, no departure counter).
__device__ float grid_max_arrive_wait(float v, unsigned int* s, unsigned int gen) {
  const unsigned int par = gen & 1u;
  asm volatile("red.relaxed.gpu.global.max.u32 [%0], %1;" ::"l"(s + par), "r"(__float_as_uint(v)) : "memory");
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(s + 2) : "memory");
  if (old + 1 == gridDim.x) {
    unsigned int m;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(m) : "l"(s + par) : "memory");
    asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(s + 2) : "memory");
    asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(s + (par ^ 1u)) : "memory");
    const unsigned long long pub = ((unsigned long long)(gen + 1u) << 32) | m;
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(s + 4), "l"(pub) : "memory");
    return __uint_as_float(m);
  }
  unsigned long long pub;
  while ((unsigned int)((pub = ld_acquire_u64(s + 4)) >> 32) == gen) __nanosleep(20);
  return __uint_as_float((unsigned int)pub);
}

}  // namespace

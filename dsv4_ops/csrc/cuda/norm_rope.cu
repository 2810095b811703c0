// CUDA kernel of dsv4::rms_norm_rope (docs/ops.md "## RMSNorm + RoPE"), sm_90a. No torch headers:
// norm_rope_bindings.cpp checks and allocates. One launch instead of the decode step's 2-3 Inductor kernels per
// normalised vector set (q's per-head norm + RoPE; kv's norm, RoPE and simulated FP8 rounding).
// A CTA per vector of d elements, a thread per 4 consecutive elements (whole warps): a RoPE pair never straddles
// threads (d - rope_dim is a multiple of 4) and an FP8 block of 64 is 16 lanes of one warp (shuffles within them).
// Every step is the CPU kernel's, rounded at the same points (the products and differences of the rotation as
// separate IEEE operations, not fused); the sum of squares is reduced in another order (one ulp of rs).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cache_slot.h"
#include "float_cast.h"
#include "launchers.h"
#include "pdl.h"

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;

using dsv4_cuda::pow2_ceil;
using dsv4_cuda::round_to;

constexpr float kFp8Max = 448.0f, kFp8AmaxFloor = 1e-4f;

__device__ __forceinline__ void load4(const float* p, float (&f)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&f)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  f[0] = __uint_as_float(u.x << 16); f[1] = __uint_as_float(u.x & 0xFFFF0000u);
  f[2] = __uint_as_float(u.y << 16); f[3] = __uint_as_float(u.y & 0xFFFF0000u);
}
__device__ __forceinline__ void store4(float* p, const float (&f)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&f)[4]) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(f[0], f[1]), b = __floats2bfloat162_rn(f[2], f[3]);
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&a);
  u.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = u;
}


// Where vector v goes: out + v * d, or with a store (positions non-null, one head) row v's cache slot (offset +
// dsv4::cache_slot), null where that row writes nothing.
struct Dest {
  const void* positions;  // int64 / int32 [rows] or null
  int pos_i32, ratio, offset, slots;
  int64_t row_stride;  // the cache's elements per row
  int64_t kv_batch;    // > 0: row v writes cache row v % kv_batch (T tokens of kv_batch sequences), else v
};

template <typename T>
__device__ __forceinline__ T* dest(T* out, const Dest& st, int64_t v, int d) {
  if (st.positions == nullptr) return out + v * d;
  const int64_t pos = st.pos_i32 ? int64_t(static_cast<const int32_t*>(st.positions)[v])
                                 : static_cast<const int64_t*>(st.positions)[v];
  const int64_t slot = dsv4::cache_slot(pos, st.ratio, st.slots);
  return slot < 0 ? nullptr : out + (st.kv_batch ? v % st.kv_batch : v) * st.row_stride + (st.offset + slot) * d;
}

template <typename T>
__global__ void __launch_bounds__(1024) rms_norm_rope_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                                             const float* __restrict__ cs, T* __restrict__ out,
                                                             int heads, int d, int rope_dim, float eps,
                                                             int fp8_nope, const Dest st, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  __shared__ float wsum[32];
  const int64_t v = blockIdx.x;
  T* const dst = dest(out, st, v, d);
  if (dst == nullptr) return;  // the whole CTA: no barrier is left waiting
  const int t = threadIdx.x, e0 = 4 * t, nope = d - rope_dim, lane = t & 31, warp = t >> 5;
  const bool live = e0 < d;  // the block is padded to whole warps (full-mask shuffles)
  float f[4] = {}, wt[4] = {1.0f, 1.0f, 1.0f, 1.0f}, c[4] = {};
  if (live) {
    load4(x + v * d + e0, f);
    if (w != nullptr) load4(w + e0, wt);
    if (e0 >= nope) load4(cs + (v / heads) * rope_dim + (e0 - nope), c);  // (cos, sin) of the thread's 2 pairs
  }
  float ss = fmaf(f[3], f[3], fmaf(f[2], f[2], fmaf(f[1], f[1], f[0] * f[0])));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (lane == 0) wsum[warp] = ss;
  __syncthreads();
  float tot = 0.0f;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) tot += wsum[i];
  const float rs = 1.0f / sqrtf(__fadd_rn(__fdiv_rn(tot, float(d)), eps));
  float y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float n = __fmul_rn(f[i], rs);
    y[i] = round_to(w != nullptr ? __fmul_rn(wt[i], n) : n, static_cast<T*>(nullptr));
  }
  if (live && e0 >= nope) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float x0 = y[2 * k], x1 = y[2 * k + 1], co = c[2 * k], si = c[2 * k + 1];
      y[2 * k] = round_to(__fsub_rn(__fmul_rn(x0, co), __fmul_rn(x1, si)), static_cast<T*>(nullptr));
      y[2 * k + 1] = round_to(__fadd_rn(__fmul_rn(x0, si), __fmul_rn(x1, co)), static_cast<T*>(nullptr));
    }
  }
  if (fp8_nope) {  // every lane shuffles (blocks of 64 = 16 lanes); only the non-RoPE ones use the result
    float amax = fmaxf(fmaxf(fabsf(y[0]), fabsf(y[1])), fmaxf(fabsf(y[2]), fabsf(y[3])));
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (live && e0 < nope) {
      const float s = pow2_ceil(__fmul_rn(fmaxf(amax, kFp8AmaxFloor), 1.0f / kFp8Max));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float q = fminf(fmaxf(__fdiv_rn(y[i], s), -kFp8Max), kFp8Max);
        const __nv_fp8_e4m3 q8(q);  // round to nearest even
        y[i] = round_to(__fmul_rn(float(q8), s), static_cast<T*>(nullptr));
      }
    }
  }
  if (live) store4(dst + e0, y);
}

cudaError_t launch(const void* x, int x_fp32, const float* w, const float* cs, void* out, int64_t vectors,
                   int heads, int d, int rope_dim, float eps, int fp8_nope, const Dest& st, cudaStream_t stream) {
  if (vectors == 0) return cudaSuccess;
  if (d % 4 != 0 || d > dsv4_limits::kNormRopeCudaMaxDim || d < 4 || rope_dim % 4 != 0 || vectors > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const int threads = (d / 4 + 31) / 32 * 32;
  const bool pdl = decode_pdl();
  if (x_fp32)
    launch_ex(pdl, rms_norm_rope_kernel<float>, dim3(unsigned(vectors)), dim3(threads), 0, stream,
              static_cast<const float*>(x), w, cs, static_cast<float*>(out), heads, d, rope_dim, eps, fp8_nope, st,
              int(pdl));
  else
    launch_ex(pdl, rms_norm_rope_kernel<__nv_bfloat16>, dim3(unsigned(vectors)), dim3(threads), 0, stream,
              static_cast<const __nv_bfloat16*>(x), w, cs, static_cast<__nv_bfloat16*>(out), heads, d, rope_dim, eps,
              fp8_nope, st, int(pdl));
  return cudaGetLastError();
}

}  // namespace

// x / out [rows * heads, d] (x_fp32: float32, else bf16), w fp32 [d] or null, cs fp32 [rows, rope_dim / 2, 2];
// d % 4 == 0, d <= 4096, rope_dim % 4 == 0, fp8_nope: (d - rope_dim) % 64 == 0; 16-byte aligned x, w, cs.
extern "C" cudaError_t dsv4_rms_norm_rope_launch(const void* x, int x_fp32, const float* w, const float* cs, void* out,
                                                 int64_t vectors, int heads, int d, int rope_dim, float eps,
                                                 int fp8_nope, cudaStream_t stream) {
  return launch(x, x_fp32, w, cs, out, vectors, heads, d, rope_dim, eps, fp8_nope, Dest{}, stream);
}

// The store form: x [rows, d], cache [>= rows, row_stride / d, d] (16-byte aligned), positions int64 (or int32 when
// pos_i32) [rows]; slots per dsv4::cache_slot; kv_batch > 0: row v writes cache row v % kv_batch.
extern "C" cudaError_t dsv4_rms_norm_rope_store_launch(const void* x, int x_fp32, const float* w, const float* cs,
                                                       int64_t rows, int d, int rope_dim, float eps, int fp8_nope,
                                                       const void* positions, int pos_i32, int ratio, int offset,
                                                       int slots, void* cache, int64_t row_stride, int64_t kv_batch,
                                                       cudaStream_t stream) {
  const Dest st{positions, pos_i32, ratio, offset, slots, row_stride, kv_batch};
  return launch(x, x_fp32, w, cs, cache, rows, 1, d, rope_dim, eps, fp8_nope, st, stream);
}

// CUDA kernel of dsv4::hadamard_fp4 (docs/ops.md "## Hadamard + FP4"), sm_90a. No torch headers:
// hadamard_bindings.cpp checks and allocates. One launch for the indexer's RoPE + Walsh-Hadamard rotation + FP4
// rounding of its queries / keys (the tensor-op form: a RoPE kernel, an fp32 GEMM against the 128 x 128 matrix
// and its split-K reduction, two FP4 kernels).
// A warp per vector, lane l holding elements l E .. l E + E - 1 (E = d / 32): butterfly strides below E inside the
// lane, the rest with the partner lane l ^ (stride / E). Every add, multiply and rounding is the CPU kernel's
// (no fused multiply-adds), so the two give the same bits.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "float_cast.h"
#include "launchers.h"
#include "pdl.h"

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;

using dsv4_cuda::load_one;
using dsv4_cuda::pow2_ceil;
using dsv4_cuda::round_to;
using dsv4_cuda::store_one;

constexpr int kWarpsPerCta = 4;



__device__ __forceinline__ float round_e2m1(float v) {
  const float a = fabsf(v);
  const float q = a < 2.0f ? __fmul_rn(rintf(__fmul_rn(a, 2.0f)), 0.5f)
                           : a < 4.0f ? rintf(a) : __fmul_rn(rintf(__fmul_rn(a, 0.5f)), 2.0f);
  return v < 0.0f ? -q : q;
}

template <typename T, int E>
__global__ void __launch_bounds__(32 * kWarpsPerCta) hadamard_fp4_kernel(const T* __restrict__ x,
                                                                          const float* __restrict__ cs,
                                                                          T* __restrict__ out, int64_t vectors,
                                                                          int heads, int rope_dim, float scale,
                                                                          int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  constexpr int D = 32 * E;
  const int lane = threadIdx.x & 31;
  const int64_t v = int64_t(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (v >= vectors) return;  // whole warps leave: the shuffles below stay within live warps
  const int nope = D - rope_dim, i0 = lane * E;
  float y[E];
#pragma unroll
  for (int e = 0; e < E; ++e) y[e] = load_one(x + v * D + i0 + e);
  if (cs != nullptr) {  // pairs (2k, 2k + 1) never straddle lanes: E and nope are even
    const float* c = cs + (v / heads) * rope_dim;
#pragma unroll
    for (int e = 0; e < E; e += 2) {
      const int i = i0 + e;
      if (i >= nope) {
        const float x0 = y[e], x1 = y[e + 1], co = c[i - nope], si = c[i - nope + 1];
        y[e] = round_to(__fsub_rn(__fmul_rn(x0, co), __fmul_rn(x1, si)), static_cast<T*>(nullptr));
        y[e + 1] = round_to(__fadd_rn(__fmul_rn(x0, si), __fmul_rn(x1, co)), static_cast<T*>(nullptr));
      }
    }
  }
#pragma unroll
  for (int h = 1; h < E; h *= 2) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if ((e & h) == 0) {
        const float a = y[e], b = y[e + h];
        y[e] = __fadd_rn(a, b);
        y[e + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int h = E; h < D; h *= 2) {
    const int m = h / E;
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float other = __shfl_xor_sync(0xffffffffu, y[e], m);
      y[e] = upper ? __fsub_rn(other, y[e]) : __fadd_rn(y[e], other);
    }
  }
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    y[e] = round_to(__fmul_rn(y[e], scale), static_cast<T*>(nullptr));
    amax = fmaxf(amax, fabsf(y[e]));
  }
#pragma unroll
  for (int m = 16 / E; m >= 1; m /= 2)  // a block of 32 = 32 / E lanes
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const float s = pow2_ceil(__fmul_rn(fmaxf(amax, 6.0f * 0x1p-126f), 1.0f / 6.0f));
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float q = round_e2m1(fminf(fmaxf(__fdiv_rn(y[e], s), -6.0f), 6.0f));
    store_one(out + v * D + i0 + e, round_to(__fmul_rn(q, s), static_cast<T*>(nullptr)));
  }
}

template <typename T>
cudaError_t launch_t(const void* x, const float* cs, void* out, int64_t vectors, int heads, int d, int rope_dim,
                     float scale, cudaStream_t stream) {
  const unsigned grid = unsigned((vectors + kWarpsPerCta - 1) / kWarpsPerCta);
  const T* xp = static_cast<const T*>(x);
  T* op = static_cast<T*>(out);
  const dim3 block(32 * kWarpsPerCta);
  const bool pdl = decode_pdl();
  switch (d) {
    case 64:
      launch_ex(pdl, hadamard_fp4_kernel<T, 2>, grid, block, 0, stream, xp, cs, op, vectors, heads, rope_dim,
                scale, int(pdl));
      break;
    case 128:
      launch_ex(pdl, hadamard_fp4_kernel<T, 4>, grid, block, 0, stream, xp, cs, op, vectors, heads, rope_dim,
                scale, int(pdl));
      break;
    case 256:
      launch_ex(pdl, hadamard_fp4_kernel<T, 8>, grid, block, 0, stream, xp, cs, op, vectors, heads, rope_dim,
                scale, int(pdl));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

// x / out [vectors, d] (x_fp32: float32, else bf16), d in {64, 128, 256}; cs fp32 [vectors / heads, rope_dim / 2,
// 2] or null (rope_dim 0), rope_dim even; scale: the fp32 d^-0.5.
extern "C" int dsv4_hadamard_fp4_kernel_ok(int d) { return dsv4_limits::hadamard_fp4_dim_ok(d); }

extern "C" cudaError_t dsv4_hadamard_fp4_launch(const void* x, int x_fp32, const float* cs, void* out,
                                                int64_t vectors, int heads, int d, int rope_dim, float scale,
                                                cudaStream_t stream) {
  if (vectors == 0) return cudaSuccess;
  const int64_t ctas = (vectors + kWarpsPerCta - 1) / kWarpsPerCta;
  if (!dsv4_hadamard_fp4_kernel_ok(d) || rope_dim % 2 != 0 || ctas > 0x7FFFFFFF) return cudaErrorInvalidValue;
  return x_fp32 ? launch_t<float>(x, cs, out, vectors, heads, d, rope_dim, scale, stream)
                : launch_t<__nv_bfloat16>(x, cs, out, vectors, heads, d, rope_dim, scale, stream);
}

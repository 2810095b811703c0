// One element of a kernel's storage dtype (fp32 / bf16 / fp16) to and from fp32, shared by the CUDA kernels (no
// torch headers). round_to(v, p) is v rounded to *p's dtype (p only picks the overload: a null pointer will do).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace dsv4_cuda {

__device__ __forceinline__ float load_one(const float* p) { return *p; }
__device__ __forceinline__ float load_one(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_one(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store_one(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_one(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_one(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ float round_to(float v, const float*) { return v; }
__device__ __forceinline__ float round_to(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(v));
}
__device__ __forceinline__ float round_to(float v, const __half*) { return __half2float(__float2half_rn(v)); }

// 2^ceil(log2(v)) for positive normal v by its exponent bits (the official kernels' power-of-two scale rounding).
__device__ __forceinline__ float pow2_ceil(float v) {
  const uint32_t b = __float_as_uint(v);
  return __uint_as_float((((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u ? 1u : 0u)) << 23);
}

}  // namespace dsv4_cuda

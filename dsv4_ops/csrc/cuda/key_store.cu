// CUDA kernel of dsv4::indexer_store_keys (docs/ops.md "## Indexer key store"), sm_90a. No torch headers:
// key_store_bindings.cpp checks. One launch writes a closed window's indexer key into the float cache and, as
// FP4 codes + UE8M0 exponents, into the packed caches (the tensor-op form: the packing kernels and three
// index_put kernels). A warp per row, lane l holding elements [l E, l E + E) (E = D / 32, even): a block of 32
// is 32 / E lanes (its amax by shuffles); the same steps and rounding as the CPU kernel (the same bytes).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cache_slot.h"
#include "launchers.h"
#include "pdl.h"

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;

constexpr int kWarpsPerCta = 4;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ uint32_t e2m1_code(float y) {  // y in [-6, 6]; ties to the even code
  const float a = fabsf(y);
  const uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                       (a > 5.0f);
  return mag | ((y < 0.0f && mag > 0) ? 8u : 0u);
}

template <typename T, typename P, int E>
__global__ void __launch_bounds__(32 * kWarpsPerCta) store_keys_kernel(const T* __restrict__ keys,
                                                                        const P* __restrict__ positions, int B,
                                                                        int ratio, int n, int kv_batch,
                                                                        T* __restrict__ cache,
                                                                        uint8_t* __restrict__ codes,
                                                                        uint8_t* __restrict__ scales, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  constexpr int D = 32 * E, kLanesPerBlock = 32 / E;
  const int b = blockIdx.x * kWarpsPerCta + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (b >= B) return;
  const int64_t slot = dsv4::entry_slot(int64_t(positions[b]), ratio, n);
  if (slot < 0) return;  // whole warps leave: no window closed in this row
  const int64_t at = int64_t(kv_batch ? b % kv_batch : b) * n + slot;  // the row's sequence's cache row
  T v[E];
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    v[e] = keys[int64_t(b) * D + lane * E + e];
    cache[at * D + lane * E + e] = v[e];
    amax = fmaxf(amax, fabsf(to_f(v[e])));
  }
#pragma unroll
  for (int m = kLanesPerBlock / 2; m >= 1; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const uint32_t bits = __float_as_uint(__fmul_rn(fmaxf(amax, 6.0f * 0x1p-126f), 1.0f / 6.0f));
  const uint32_t e8 = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u ? 1u : 0u);
  const float s = __uint_as_float(e8 > 0 ? e8 << 23 : 1u << 22);
  if (lane % kLanesPerBlock == 0) scales[at * (D / 32) + lane / kLanesPerBlock] = uint8_t(e8);
#pragma unroll
  for (int e = 0; e < E; e += 2) {
    const float y0 = fminf(fmaxf(__fdiv_rn(to_f(v[e]), s), -6.0f), 6.0f);
    const float y1 = fminf(fmaxf(__fdiv_rn(to_f(v[e + 1]), s), -6.0f), 6.0f);
    codes[at * (D / 2) + (lane * E + e) / 2] = uint8_t(e2m1_code(y0) | (e2m1_code(y1) << 4));
  }
}

template <typename T, typename P>
cudaError_t launch_t(const void* keys, const void* positions, int B, int D, int ratio, int n, int kv_batch,
                     void* cache, uint8_t* codes, uint8_t* scales, cudaStream_t stream) {
  const unsigned grid = unsigned((B + kWarpsPerCta - 1) / kWarpsPerCta);
  const dim3 block(32 * kWarpsPerCta);
  const T* k = static_cast<const T*>(keys);
  const P* p = static_cast<const P*>(positions);
  T* c = static_cast<T*>(cache);
  const bool pdl = decode_pdl();
  switch (D) {
    case 64:
      launch_ex(pdl, store_keys_kernel<T, P, 2>, grid, block, 0, stream, k, p, B, ratio, n, kv_batch, c, codes,
                scales, int(pdl));
      break;
    case 128:
      launch_ex(pdl, store_keys_kernel<T, P, 4>, grid, block, 0, stream, k, p, B, ratio, n, kv_batch, c, codes,
                scales, int(pdl));
      break;
    case 256:
      launch_ex(pdl, store_keys_kernel<T, P, 8>, grid, block, 0, stream, k, p, B, ratio, n, kv_batch, c, codes,
                scales, int(pdl));
      break;
    case 512:
      launch_ex(pdl, store_keys_kernel<T, P, 16>, grid, block, 0, stream, k, p, B, ratio, n, kv_batch, c, codes,
                scales, int(pdl));
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" int dsv4_store_keys_kernel_ok(int D) { return dsv4_limits::store_keys_dim_ok(D); }

// keys [B, D] (keys_fp32: float32, else bf16), positions [B] (pos_i32: int32, else int64), cache [>= B, n, D]
// of the keys' dtype, codes uint8 [>= B, n, D / 2], scales uint8 [>= B, n, D / 32]; all contiguous. kv_batch > 0:
// row b writes cache row b % kv_batch (the caches need kv_batch rows).
extern "C" cudaError_t dsv4_store_keys_launch(const void* keys, int keys_fp32, const void* positions, int pos_i32,
                                              int B, int D, int ratio, int n, int kv_batch, void* cache,
                                              uint8_t* codes, uint8_t* scales, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  if (!dsv4_store_keys_kernel_ok(D) || ratio < 1 || n < 1) return cudaErrorInvalidValue;
  using bf16 = __nv_bfloat16;
  if (keys_fp32)
    return pos_i32 ? launch_t<float, int32_t>(keys, positions, B, D, ratio, n, kv_batch, cache, codes, scales, stream)
                   : launch_t<float, int64_t>(keys, positions, B, D, ratio, n, kv_batch, cache, codes, scales, stream);
  return pos_i32 ? launch_t<bf16, int32_t>(keys, positions, B, D, ratio, n, kv_batch, cache, codes, scales, stream)
                 : launch_t<bf16, int64_t>(keys, positions, B, D, ratio, n, kv_batch, cache, codes, scales, stream);
}

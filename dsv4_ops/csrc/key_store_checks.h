// Argument checks shared by the CPU and CUDA kernels of dsv4::indexer_store_keys (docs/ops.md "## Indexer key
// store"): every problem is reported, naming the argument, before any cache is written.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace dsv4_key_store {

struct Shape {
  int64_t B, D, n;
};

// kv_batch > 0 (a divisor of B): row b writes cache row b % kv_batch (T tokens of kv_batch sequences,
// token-major), and the caches need kv_batch rows.
inline Shape check(const at::Tensor& keys, const at::Tensor& positions, int64_t ratio, const at::Tensor& kv_cache,
                   const at::Tensor& k_codes, const at::Tensor& k_scales, int64_t kv_batch) {
  const char* op = "dsv4::indexer_store_keys";
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 || keys.scalar_type() == at::kFloat, op,
              ": keys must be bfloat16 or float32, got ", keys.scalar_type());
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) % 32 == 0 && keys.size(1) > 0, op,
              ": keys must be [B, D] with D a positive multiple of 32, got ", keys.sizes());
  const int64_t B = keys.size(0), D = keys.size(1);
  TORCH_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt, op,
              ": positions must be int64 or int32, got ", positions.scalar_type());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == B, op, ": positions must be [B = ", B, "], got ",
              positions.sizes());
  TORCH_CHECK(ratio >= 1, op, ": ratio must be >= 1, got ", ratio);
  TORCH_CHECK(kv_batch >= 0 && (kv_batch == 0 || B % kv_batch == 0), op, ": kv_batch must be 0 or divide B = ", B,
              ", got ", kv_batch);
  const int64_t seqs = kv_batch ? kv_batch : B;
  TORCH_CHECK(kv_cache.scalar_type() == keys.scalar_type() && kv_cache.dim() == 3 && kv_cache.size(0) >= seqs &&
                  kv_cache.size(2) == D && kv_cache.size(1) >= 1 && kv_cache.is_contiguous(),
              op, ": kv_cache must be a contiguous ", keys.scalar_type(), " [>= ", kv_batch ? "kv_batch" : "B", " = ",
              seqs, ", n >= 1, D = ", D, "], got ", kv_cache.scalar_type(), " ", kv_cache.sizes());
  const int64_t n = kv_cache.size(1);
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && k_codes.dim() == 3 && k_codes.size(0) == kv_cache.size(0) &&
                  k_codes.size(1) == n && k_codes.size(2) == D / 2 && k_codes.is_contiguous(),
              op, ": k_codes must be a contiguous uint8 [", kv_cache.size(0), ", ", n, ", D / 2 = ", D / 2,
              "], got ", k_codes.scalar_type(), " ", k_codes.sizes());
  TORCH_CHECK(k_scales.scalar_type() == at::kByte && k_scales.dim() == 3 && k_scales.size(0) == kv_cache.size(0) &&
                  k_scales.size(1) == n && k_scales.size(2) == D / 32 && k_scales.is_contiguous(),
              op, ": k_scales must be a contiguous uint8 [", kv_cache.size(0), ", ", n, ", D / 32 = ", D / 32,
              "], got ", k_scales.scalar_type(), " ", k_scales.sizes());
  for (const at::Tensor* t : {&positions, &kv_cache, &k_codes, &k_scales})
    TORCH_CHECK(t->device() == keys.device(), op, ": every tensor must be on keys' device (", keys.device(), ")");
  return {B, D, n};
}

}  // namespace dsv4_key_store

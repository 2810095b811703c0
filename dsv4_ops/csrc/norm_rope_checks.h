// Argument checks shared by the CPU and CUDA kernels of dsv4::rms_norm_rope (docs/ops.md "## RMSNorm + RoPE"),
// and the constants of the simulated FP8 KV quantization both kernels apply.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace dsv4_norm_rope {

constexpr int64_t kFp8Block = 64;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;

struct Shape {
  int64_t rows, heads, d, nope;
};

inline Shape check(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& cs, double eps,
                   int64_t rope_dim, bool fp8_nope) {
  const char* op = "dsv4::rms_norm_rope";
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3, op, ": x must be [rows, heads, d], got ", x.sizes());
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(rope_dim >= 0 && rope_dim <= d && rope_dim % 4 == 0 && d % 4 == 0, op,
              ": rope_dim must be a multiple of 4 in [0, d], d a multiple of 4; got rope_dim ", rope_dim, ", d ", d);
  TORCH_CHECK(cs.scalar_type() == at::kFloat && cs.dim() == 3 && cs.size(0) == rows && cs.size(1) == rope_dim / 2 &&
                  cs.size(2) == 2,
              op, ": cs must be float32 [rows = ", rows, ", rope_dim / 2 = ", rope_dim / 2, ", 2], got ",
              cs.scalar_type(), " ", cs.sizes());
  TORCH_CHECK(cs.device() == x.device(), op, ": cs is on ", cs.device(), ", x on ", x.device());
  if (weight.has_value()) {
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->dim() == 1 && weight->size(0) == d, op,
                ": weight must be float32 [d = ", d, "], got ", weight->scalar_type(), " ", weight->sizes());
    TORCH_CHECK(weight->device() == x.device(), op, ": weight is on ", weight->device(), ", x on ", x.device());
  }
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  const int64_t nope = d - rope_dim;
  TORCH_CHECK(!fp8_nope || nope % kFp8Block == 0, op, ": fp8_nope needs d - rope_dim (", nope,
              ") to be a multiple of ", kFp8Block);
  return {rows, heads, d, nope};
}

// dsv4::rms_norm_rope_store: x [rows, d] (as one head), positions int64 / int32 [rows], cache a contiguous
// [>= rows, >= offset + slots, d] tensor of x's dtype; kv_batch > 0 (a divisor of rows): row r writes cache row
// r % kv_batch (T tokens of kv_batch sequences, token-major), and the cache needs kv_batch rows.
inline Shape check_store(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& cs,
                         double eps, int64_t rope_dim, bool fp8_nope, const at::Tensor& positions, int64_t ratio,
                         int64_t offset, int64_t slots, const at::Tensor& cache, int64_t kv_batch) {
  const char* op = "dsv4::rms_norm_rope_store";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, d], got ", x.sizes());
  const Shape sh = check(x.unsqueeze(1), weight, cs, eps, rope_dim, fp8_nope);
  TORCH_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt, op,
              ": positions must be int64 or int32, got ", positions.scalar_type());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == sh.rows, op, ": positions must be [rows = ", sh.rows,
              "], got ", positions.sizes());
  TORCH_CHECK(ratio >= 0 && offset >= 0 && slots >= 1, op, ": need ratio >= 0, offset >= 0, slots >= 1; got ",
              ratio, ", ", offset, ", ", slots);
  TORCH_CHECK(kv_batch >= 0 && (kv_batch == 0 || sh.rows % kv_batch == 0), op,
              ": kv_batch must be 0 or divide rows = ", sh.rows, ", got ", kv_batch);
  const int64_t seqs = kv_batch ? kv_batch : sh.rows;
  TORCH_CHECK(cache.scalar_type() == x.scalar_type() && cache.dim() == 3 && cache.size(0) >= seqs &&
                  cache.size(1) >= offset + slots && cache.size(2) == sh.d && cache.is_contiguous(),
              op, ": cache must be a contiguous ", x.scalar_type(), " [>= ", kv_batch ? "kv_batch" : "rows", " = ",
              seqs, ", >= offset + slots = ", offset + slots, ", d = ", sh.d, "], got ", cache.scalar_type(), " ",
              cache.sizes());
  for (const at::Tensor* t : {&positions, &cache})
    TORCH_CHECK(t->device() == x.device(), op, ": every tensor must be on x's device (", x.device(), ")");
  return sh;
}

}  // namespace dsv4_norm_rope

// Argument checks shared by the CPU and CUDA kernels of dsv4::indexer_score_topk and dsv4::indexer_prefill_scores
// (docs/ops.md "## Indexer"); the CUDA kernels' own limits (D, H, B, topk) stay in their bindings.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace dsv4_indexer {

// kv_batch > 0: query row b scores the keys of sequence b % kv_batch (T tokens of kv_batch sequences,
// token-major), so the keys hold kv_batch rows and B is a multiple of it; 0: row b's own.
inline void check(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_codes,
                  const at::Tensor& k_scales, const at::Tensor& n_valid, int64_t topk,
                  std::optional<at::ScalarType> weights_dtype, int64_t kv_batch) {
  const char* op = "dsv4::indexer_score_topk: ";
  TORCH_CHECK(q.dim() == 3, op, "q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, op,
              "q must be bfloat16 or float32, got ", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D > 0 && D % 32 == 0, op, "q's last dim D must be a positive multiple of 32, got ", D);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == B && weights.size(1) == H, op, "weights must be [B, H] = [",
              B, ", ", H, "], got ", weights.sizes());
  TORCH_CHECK(weights.scalar_type() == at::kFloat, op, "weights must be float32, got ", weights.scalar_type());
  TORCH_CHECK(kv_batch >= 0 && kv_batch < (int64_t(1) << 31) && (kv_batch == 0 || B % kv_batch == 0), op,
              "kv_batch must be 0 or divide B = ", B, ", got ", kv_batch);
  const int64_t S = kv_batch ? kv_batch : B;
  TORCH_CHECK(k_codes.dim() == 3 && k_codes.size(0) == S && k_codes.size(2) == D / 2, op, "k_codes must be [",
              kv_batch ? "kv_batch" : "B", ", N, D/2] = [", S, ", N, ", D / 2, "], got ", k_codes.sizes());
  TORCH_CHECK(k_codes.scalar_type() == at::kByte, op, "k_codes must be uint8, got ", k_codes.scalar_type());
  const int64_t N = k_codes.size(1);
  TORCH_CHECK(N < (int64_t(1) << 31), op, "at most 2^31-1 keys per row, got N = ", N);
  TORCH_CHECK(k_scales.dim() == 3 && k_scales.size(0) == S && k_scales.size(1) == N && k_scales.size(2) == D / 32, op,
              "k_scales must be [", kv_batch ? "kv_batch" : "B", ", N, D/32] = [", S, ", ", N, ", ", D / 32, "], got ",
              k_scales.sizes());
  TORCH_CHECK(k_scales.scalar_type() == at::kByte, op, "k_scales must be uint8 (UE8M0 exponents), got ",
              k_scales.scalar_type());
  TORCH_CHECK(n_valid.dim() == 1 && n_valid.size(0) == B, op, "n_valid must be [B] = [", B, "], got ",
              n_valid.sizes());
  TORCH_CHECK(n_valid.scalar_type() == at::kInt || n_valid.scalar_type() == at::kLong, op,
              "n_valid must be int32 or int64, got ", n_valid.scalar_type());
  TORCH_CHECK(topk >= 0, op, "topk must be >= 0, got ", topk);
  TORCH_CHECK(!weights_dtype || *weights_dtype == at::kBFloat16 || *weights_dtype == at::kHalf, op,
              "weights_dtype must be bfloat16, float16 or None, got ", *weights_dtype);
  for (const at::Tensor* t : {&weights, &k_codes, &k_scales, &n_valid})
    TORCH_CHECK(t->device() == q.device(), op, "all inputs must be on ", q.device(), ", got one on ", t->device());
}

// dsv4::indexer_prefill_scores: q [B, S, H, D] and keys [B, T, D] of one dtype (bf16 / fp32), weights fp32
// [B, S, H], n_visible int64 [B, S].
inline void check_prefill(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& keys,
                          const at::Tensor& n_visible) {
  const char* op = "dsv4::indexer_prefill_scores: ";
  TORCH_CHECK(q.dim() == 4, op, "q must be [B, S, H, D], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, op,
              "q must be bfloat16 or float32, got ", q.scalar_type());
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
  TORCH_CHECK(H > 0 && D > 0, op, "q must have at least one head of width > 0, got ", q.sizes());
  TORCH_CHECK(weights.dim() == 3 && weights.size(0) == B && weights.size(1) == S && weights.size(2) == H, op,
              "weights must be [B, S, H] = [", B, ", ", S, ", ", H, "], got ", weights.sizes());
  TORCH_CHECK(weights.scalar_type() == at::kFloat, op, "weights must be float32, got ", weights.scalar_type());
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == B && keys.size(2) == D, op, "keys must be [B, T, D] = [", B,
              ", T, ", D, "], got ", keys.sizes());
  TORCH_CHECK(keys.scalar_type() == q.scalar_type(), op, "keys must have q's dtype ", q.scalar_type(), ", got ",
              keys.scalar_type());
  TORCH_CHECK(keys.size(1) < (int64_t(1) << 31) && S < (int64_t(1) << 31), op, "at most 2^31-1 queries / keys per row");
  TORCH_CHECK(n_visible.dim() == 2 && n_visible.size(0) == B && n_visible.size(1) == S, op,
              "n_visible must be [B, S] = [", B, ", ", S, "], got ", n_visible.sizes());
  TORCH_CHECK(n_visible.scalar_type() == at::kLong, op, "n_visible must be int64, got ", n_visible.scalar_type());
  for (const at::Tensor* t : {&weights, &keys, &n_visible})
    TORCH_CHECK(t->device() == q.device(), op, "all inputs must be on ", q.device(), ", got one on ", t->device());
}

// dsv4::indexer_topk: scores fp32 [..., N] (N >= 1), 1 <= topk <= N.
inline void check_topk(const at::Tensor& scores, int64_t topk) {
  const char* op = "dsv4::indexer_topk: ";
  TORCH_CHECK(scores.dim() >= 1 && scores.size(-1) >= 1, op, "scores must be [..., N] with N >= 1, got ",
              scores.sizes());
  TORCH_CHECK(scores.scalar_type() == at::kFloat, op, "scores must be float32, got ", scores.scalar_type());
  TORCH_CHECK(scores.size(-1) < (int64_t(1) << 31), op, "at most 2^31-1 scores per row, got ", scores.size(-1));
  TORCH_CHECK(topk >= 1 && topk <= scores.size(-1), op, "topk must be in [1, N = ", scores.size(-1), "], got ",
              topk);
}

}  // namespace dsv4_indexer

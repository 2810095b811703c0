// Argument checks and the ATen form shared by the CPU and CUDA kernels of dsv4::sparse_attn_decode (docs/ops.md
// "## Decode attention").
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace dsv4_attn {

// Returns nothing; names the argument that is wrong. kv_batch > 0: query row b reads kv[b % kv_batch] (T tokens of
// kv_batch sequences, token-major: a speculative step's verification), so kv needs kv_batch rows and B a multiple
// of it; 0: kv[b].
inline void check(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const at::Tensor& sink,
                  int64_t kv_batch) {
  const char* op = "dsv4::sparse_attn_decode";
  TORCH_CHECK(q.dim() == 3, op, ": q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf || q.scalar_type() == at::kFloat, op,
              ": q must be bfloat16, float16 or float32, got ", q.scalar_type());
  TORCH_CHECK(kv_batch >= 0 && kv_batch < (int64_t(1) << 31) && (kv_batch == 0 || q.size(0) % kv_batch == 0), op,
              ": kv_batch must be 0 or divide B = ", q.size(0), ", got ", kv_batch);
  const int64_t rows = kv_batch ? kv_batch : q.size(0);
  TORCH_CHECK(kv.dim() == 3 && kv.size(2) == q.size(2) && kv.size(0) >= rows, op, ": kv must be [B' >= ",
              kv_batch ? "kv_batch = " : "B = ", rows, ", N, D = ", q.size(2), "], got ", kv.sizes());
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), op, ": kv must have q's dtype ", q.scalar_type(), ", got ",
              kv.scalar_type());
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == q.size(0), op, ": idx must be [B = ", q.size(0), ", J], got ",
              idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, op,
              ": idx must be int32 or int64, got ", idx.scalar_type());
  TORCH_CHECK(sink.scalar_type() == at::kFloat && sink.dim() == 1 && sink.size(0) == q.size(1), op,
              ": sink must be float32 [H = ", q.size(1), "], got ", sink.scalar_type(), " ", sink.sizes());
  for (const at::Tensor* t : {&kv, &idx, &sink})
    TORCH_CHECK(t->device() == q.device(), op, ": all tensors must be on q's device ", q.device(), ", got ",
                t->device());
}

// idx2 (optional): int32 / int64 [B, J2], listed after idx as rows idx2 + offset where idx2 >= 0; offset >= 0.
inline void check_idx2(const at::Tensor& q, const std::optional<at::Tensor>& idx2, int64_t offset) {
  const char* op = "dsv4::sparse_attn_decode";
  TORCH_CHECK(offset >= 0 && offset < (int64_t(1) << 31), op, ": idx2_offset must be in [0, 2^31), got ", offset);
  if (!idx2.has_value()) return;
  TORCH_CHECK(idx2->dim() == 2 && idx2->size(0) == q.size(0), op, ": idx2 must be [B = ", q.size(0), ", J2], got ",
              idx2->sizes());
  TORCH_CHECK(idx2->scalar_type() == at::kInt || idx2->scalar_type() == at::kLong, op,
              ": idx2 must be int32 or int64, got ", idx2->scalar_type());
  TORCH_CHECK(idx2->device() == q.device(), op, ": idx2 is on ", idx2->device(), ", q on ", q.device());
}

// The whole row list as one int64 tensor: idx, then idx2 + offset where idx2 >= 0, else -1.
inline at::Tensor joined_rows(const at::Tensor& idx, const std::optional<at::Tensor>& idx2, int64_t offset) {
  const at::Tensor a = idx.to(at::kLong);
  if (!idx2.has_value()) return a;
  const at::Tensor b = idx2->to(at::kLong);
  return at::cat({a, at::where(b.ge(0), b + offset, at::full({}, -1, b.options()))}, 1);
}

// out_rope (optional): cs fp32 [B, rope_dim / 2, (cos, sin)] of each row's position; rope_dim a multiple of 4 in
// (0, D] when given, 0 without.
inline void check_out_rope(const at::Tensor& q, const std::optional<at::Tensor>& cs, int64_t rope_dim) {
  const char* op = "dsv4::sparse_attn_decode";
  if (!cs.has_value()) {
    TORCH_CHECK(rope_dim == 0, op, ": rope_dim must be 0 without out_rope, got ", rope_dim);
    return;
  }
  TORCH_CHECK(rope_dim > 0 && rope_dim <= q.size(2) && rope_dim % 4 == 0, op,
              ": rope_dim must be a multiple of 4 in (0, D = ", q.size(2), "] with out_rope, got ", rope_dim);
  TORCH_CHECK(cs->scalar_type() == at::kFloat && cs->dim() == 3 && cs->size(0) == q.size(0) &&
                  cs->size(1) == rope_dim / 2 && cs->size(2) == 2,
              op, ": out_rope must be float32 [B = ", q.size(0), ", rope_dim / 2 = ", rope_dim / 2, ", 2], got ",
              cs->scalar_type(), " ", cs->sizes());
  TORCH_CHECK(cs->device() == q.device(), op, ": out_rope is on ", cs->device(), ", q on ", q.device());
}

// The inverse RoPE of the output's trailing rope_dim dims as ATen ops (dsv4_model.layers.apply_rope with
// inverse=True: sin negated, the rotation in fp32 from out's values, rounded to out's dtype).
inline at::Tensor inverse_rope_aten(const at::Tensor& out, const at::Tensor& cs, int64_t rope_dim) {
  const int64_t nope = out.size(2) - rope_dim;
  const at::Tensor r = out.narrow(2, nope, rope_dim).to(at::kFloat).unflatten(-1, {rope_dim / 2, 2});
  const at::Tensor c = cs.unsqueeze(1);
  const at::Tensor co = c.select(-1, 0), si = c.select(-1, 1).neg(), x0 = r.select(-1, 0), x1 = r.select(-1, 1);
  const at::Tensor rot = at::stack({x0 * co - x1 * si, x0 * si + x1 * co}, -1).flatten(-2);
  return at::cat({out.narrow(2, 0, nope), rot.to(out.scalar_type())}, -1);
}

// The op as ATen ops (the reference's steps): fp32 scores of the gathered rows, masked where idx is outside
// [0, N), times scale, one softmax with the per-head sink, fp32 weighted sum, q's dtype.
inline at::Tensor attend_aten(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx,
                              const at::Tensor& sink, double scale, int64_t kv_batch) {
  const int64_t B = q.size(0), N = kv.size(1);
  const at::Tensor valid = idx.ge(0).logical_and(idx.lt(N));  // [B, J]
  const at::Tensor rows = at::where(valid, idx, at::zeros({}, idx.options())).to(at::kLong);
  const at::Tensor seqs = kv_batch ? kv.narrow(0, 0, kv_batch).repeat({B / kv_batch, 1, 1}) : kv.narrow(0, 0, B);
  const at::Tensor keys = seqs.to(at::kFloat).gather(
      1, rows.unsqueeze(-1).expand({B, rows.size(1), kv.size(2)}));           // [B, J, D]
  at::Tensor s = at::matmul(q.to(at::kFloat), keys.transpose(1, 2));          // [B, H, J]
  s = s.masked_fill(valid.logical_not().unsqueeze(1), -INFINITY).mul(scale);
  const at::Tensor sk = sink.view({1, -1, 1}).expand({B, q.size(1), 1});
  const at::Tensor p = at::cat({s, sk}, -1).softmax(-1);
  return at::matmul(p.narrow(-1, 0, s.size(-1)), keys).to(q.scalar_type());  // [B, H, D]
}

}  // namespace dsv4_attn

// Argument checks shared by the CPU and CUDA kernels of dsv4::compressor_decode (docs/ops.md "## Compressor
// decode"): every problem is reported, naming the argument, before any state is written.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace dsv4_comp {

struct Shape {
  int64_t B;   // rows of this step (kv.size(0))
  int64_t S;   // sequences whose states they advance: B, or kv_batch (T = B / S tokens each, token-major)
  int64_t C;   // projected width: coff * hd
  int64_t m;   // compression ratio (ape.size(0))
  int64_t R;   // state rows: coff * m (shifted), more (indexed by position)
  int64_t hd;  // entry width
  bool overlap;
  bool by_position;  // R > coff * m: token p in row p mod R, the window read by position, no shift
};

// kv_batch > 0 (a divisor of B): the rows are T = B / kv_batch tokens of kv_batch sequences, token-major (row
// t * kv_batch + b: token t of sequence b), each sequence's tokens advancing its state in order; 0: one per row.
inline Shape check(const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape, const at::Tensor& positions,
                   const at::Tensor& kv_state, const at::Tensor& score_state, const at::Tensor& pooled,
                   int64_t kv_batch) {
  const char* op = "dsv4::compressor_decode";
  auto f32 = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.device() == kv.device(), op, ": ", name, " is on ", t.device(), ", kv on ", kv.device());
  };
  f32(kv, "kv");
  f32(score, "score");
  f32(ape, "ape");
  f32(kv_state, "kv_state");
  f32(score_state, "score_state");
  // pooled: the fp32 pooling rounded once to its dtype (the caller's .to(dtype), without its kernel)
  TORCH_CHECK(pooled.scalar_type() == at::kFloat || pooled.scalar_type() == at::kBFloat16 ||
                  pooled.scalar_type() == at::kHalf,
              op, ": pooled must be float32, bfloat16 or float16, got ", pooled.scalar_type());
  TORCH_CHECK(pooled.device() == kv.device(), op, ": pooled is on ", pooled.device(), ", kv on ", kv.device());
  TORCH_CHECK(kv.dim() == 2, op, ": kv must be [B, C], got ", kv.sizes());
  TORCH_CHECK(score.sizes() == kv.sizes(), op, ": score must match kv ", kv.sizes(), ", got ", score.sizes());
  const int64_t B = kv.size(0), C = kv.size(1);
  TORCH_CHECK(ape.dim() == 2 && ape.size(1) == C && ape.size(0) >= 1, op, ": ape must be [m >= 1, C = ", C,
              "], got ", ape.sizes());
  const int64_t m = ape.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt, op,
              ": positions must be int64 or int32, got ", positions.scalar_type());
  TORCH_CHECK(positions.device() == kv.device(), op, ": positions is on ", positions.device(), ", kv on ",
              kv.device());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == B, op, ": positions must be [B = ", B, "], got ",
              positions.sizes());
  // overlapping windows (coff = 2) when pooled is half as wide as kv (C = 2 hd), else coff = 1 (hd = C)
  const bool overlap = pooled.dim() == 2 && pooled.size(1) * 2 == C && C > 0;
  const int64_t hd = overlap ? C / 2 : C, cm = overlap ? 2 * m : m;
  TORCH_CHECK(pooled.dim() == 2 && pooled.size(0) == B && (pooled.size(1) == C || overlap) && pooled.is_contiguous(),
              op, ": pooled must be a contiguous [B = ", B, ", C = ", C, " or C / 2 (overlapping windows)], got ",
              pooled.sizes());
  TORCH_CHECK(kv_batch >= 0 && (kv_batch == 0 || B % kv_batch == 0), op, ": kv_batch must be 0 or divide B = ", B,
              ", got ", kv_batch);
  const int64_t S = kv_batch ? kv_batch : B;
  TORCH_CHECK(kv_state.dim() == 3 && kv_state.size(0) >= S && kv_state.size(2) == C && kv_state.size(1) >= cm,
              op, ": kv_state must be [>= ", kv_batch ? "kv_batch" : "B", " = ", S, ", >= ", cm, " (",
              overlap ? "2m" : "m", ", m = ", m, "), C = ", C, "], got ", kv_state.sizes());
  TORCH_CHECK(score_state.sizes() == kv_state.sizes(), op, ": score_state must match kv_state ", kv_state.sizes(),
              ", got ", score_state.sizes());
  TORCH_CHECK(kv_state.is_contiguous() && score_state.is_contiguous(), op,
              ": kv_state and score_state must be contiguous (written in place)");
  TORCH_CHECK(!pooled.is_same(kv_state) && !pooled.is_same(score_state) && !kv_state.is_same(score_state), op,
              ": pooled, kv_state and score_state must be distinct tensors");
  return {B, S, C, m, kv_state.size(1), hd, overlap, kv_state.size(1) > cm};
}

}  // namespace dsv4_comp

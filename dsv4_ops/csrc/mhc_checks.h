// Argument checks shared by the CPU and CUDA kernels of dsv4::hc_sinkhorn, dsv4::hc_pre and dsv4::hc_post_pre
// (docs/ops.md "## mHC"), and hc_pre / hc_post as ATen ops (the CUDA registration's form for shapes its kernels do
// not take).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <tuple>
#include <vector>

#include "row_matmul.h"

namespace dsv4_mhc {

constexpr int64_t kMaxHc = 8;  // hc_mult of DeepSeek-V4 is 4

// Returns hc.
inline int64_t check_hc_sinkhorn(const at::Tensor& logits, int64_t iters, double eps) {
  const char* op = "dsv4::hc_sinkhorn";
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32, got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() >= 2 && logits.size(-1) == logits.size(-2), op,
              ": logits must be [..., hc, hc], got ", logits.sizes());
  const int64_t hc = logits.size(-1);
  TORCH_CHECK(hc >= 1 && hc <= kMaxHc, op, ": hc must be in [1, ", kMaxHc, "], got ", hc);
  TORCH_CHECK(iters >= 1, op, ": iters must be >= 1, got ", iters);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  return hc;
}

struct HcPreShape {
  int64_t hc, d, mix, tokens;
};

inline HcPreShape check_hc_pre(const at::Tensor& x, const at::Tensor& fn, const at::Tensor& scale,
                               const at::Tensor& base, const std::optional<at::Tensor>& norm_weight, int64_t iters,
                               double hc_eps, double norm_eps, double out_eps, const char* op = "dsv4::hc_pre") {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat,
              op, ": x must be bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 2, op, ": x must be [..., hc, d], got ", x.sizes());
  HcPreShape sh;
  sh.hc = x.size(-2), sh.d = x.size(-1), sh.mix = (2 + sh.hc) * sh.hc;
  sh.tokens = x.numel() == 0 ? 0 : x.numel() / (sh.hc * sh.d);
  TORCH_CHECK(sh.hc >= 1 && sh.hc <= kMaxHc, op, ": hc (x.size(-2)) must be in [1, ", kMaxHc, "], got ", sh.hc);
  TORCH_CHECK(sh.d >= 1, op, ": d must be >= 1");
  TORCH_CHECK(fn.scalar_type() == at::kFloat || fn.scalar_type() == at::kBFloat16, op,
              ": fn must be float32 or bfloat16, got ", fn.scalar_type());
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == sh.mix && fn.size(1) == sh.hc * sh.d, op, ": fn must be [(2 + hc) * hc = ",
              sh.mix, ", hc * d = ", sh.hc * sh.d, "], got ", fn.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == 3, op,
              ": scale must be float32 [3], got ", scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK(base.scalar_type() == at::kFloat && base.dim() == 1 && base.size(0) == sh.mix, op,
              ": base must be float32 [", sh.mix, "], got ", base.scalar_type(), " ", base.sizes());
  if (norm_weight) {
    TORCH_CHECK(norm_weight->scalar_type() == at::kFloat && norm_weight->dim() == 1 && norm_weight->size(0) == sh.d,
                op, ": norm_weight must be float32 [d = ", sh.d, "], got ", norm_weight->scalar_type(), " ",
                norm_weight->sizes());
    TORCH_CHECK(norm_weight->device() == x.device(), op, ": norm_weight must be on x's device");
  }
  TORCH_CHECK(fn.device() == x.device() && scale.device() == x.device() && base.device() == x.device(), op,
              ": fn, scale and base must be on x's device (", x.device(), ")");
  TORCH_CHECK(iters >= 1 && iters < (int64_t(1) << 31), op, ": iters must be in [1, 2^31), got ", iters);
  TORCH_CHECK(hc_eps >= 0.0 && norm_eps >= 0.0 && out_eps >= 0.0, op, ": eps values must be >= 0");
  return sh;
}

// Outputs of hc_pre: y [..., d] (x's dtype), post fp32 [..., hc], comb fp32 [..., hc, hc].
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_outputs(const at::Tensor& x, const HcPreShape& sh) {
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  auto shape = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> v(lead);
    v.insert(v.end(), tail);
    return v;
  };
  return {at::empty(shape({sh.d}), x.options()), at::empty(shape({sh.hc}), x.options().dtype(at::kFloat)),
          at::empty(shape({sh.hc, sh.hc}), x.options().dtype(at::kFloat))};
}

// The op as ATen ops, every step in fp32 (the CUDA registration's form outside its kernels' shapes); sinkhorn
// maps the comb logits to the mixing matrix (hc_sinkhorn with the call's iters and hc_eps).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_aten(
    const at::Tensor& x, const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base,
    const std::optional<at::Tensor>& norm_weight, double hc_eps, double norm_eps, double out_eps,
    const HcPreShape& sh, const std::function<at::Tensor(const at::Tensor&)>& sinkhorn) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor flat = xf.flatten(-2);
  const at::Tensor rs = at::rsqrt(flat.square().mean(-1, true) + norm_eps);
  std::vector<int64_t> mshape(flat.sizes().begin(), flat.sizes().end() - 1);
  mshape.push_back(fn.size(0));
  const at::Tensor mixes = dsv4_cpu::row_matmul(flat.reshape({-1, flat.size(-1)}), fn.to(at::kFloat)).view(mshape) * rs;
  const int64_t hc = sh.hc;
  const at::Tensor pre = at::sigmoid(mixes.narrow(-1, 0, hc) * scale[0] + base.narrow(0, 0, hc)) + hc_eps;
  const at::Tensor post = 2 * at::sigmoid(mixes.narrow(-1, hc, hc) * scale[1] + base.narrow(0, hc, hc));
  std::vector<int64_t> cshape(mixes.sizes().begin(), mixes.sizes().end() - 1);
  cshape.push_back(hc);
  cshape.push_back(hc);
  const at::Tensor comb = sinkhorn(
      (mixes.narrow(-1, 2 * hc, hc * hc) * scale[2] + base.narrow(0, 2 * hc, hc * hc)).reshape(cshape).contiguous());
  at::Tensor y = (pre.unsqueeze(-1) * xf).sum(-2).to(x.scalar_type());
  if (norm_weight) {
    const at::Tensor yf = y.to(at::kFloat);
    y = (*norm_weight * (yf * at::rsqrt(yf.square().mean(-1, true) + out_eps))).to(x.scalar_type());
  }
  return {y, post.contiguous(), comb};
}

// hc_post_pre's sublayer output given as the MoE's uncombined rows (out_ids): out [T*k (+ T), d], slot j of
// token t at row t*k + j, the shared expert's row (shared) at T*k + t; only slots whose id is in [0, experts)
// count.
struct HcPostRows {
  int64_t k = 0, experts = 0;
  bool shared = false;
};

// hc_post_pre's extra inputs: out [..., d] and res [..., hc, d] of one dtype (bf16 / fp16 / fp32), post fp32
// [..., hc], comb fp32 [..., hc, hc], all on res's device (res is checked as hc_pre's x). With out_ids (int32 /
// int64 [T, k], T = res's tokens) out is instead the rows of HcPostRows, their count telling whether the shared
// row is there. Returns the rows' layout (k = 0, experts = 0 without out_ids).
inline HcPostRows check_hc_post(const at::Tensor& out, const at::Tensor& res, const at::Tensor& post,
                                const at::Tensor& comb, const std::optional<at::Tensor>& out_ids,
                                int64_t out_experts) {
  const char* op = "dsv4::hc_post_pre";
  TORCH_CHECK(out.scalar_type() == res.scalar_type(), op, ": out must have res's dtype ", res.scalar_type(),
              ", got ", out.scalar_type());
  const int64_t hc = res.size(-2), d = res.size(-1);
  std::vector<int64_t> lead(res.sizes().begin(), res.sizes().end() - 2);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> v(lead);
    v.insert(v.end(), tail);
    return v;
  };
  HcPostRows rows;
  if (out_ids) {
    const at::Tensor& ids = *out_ids;
    const int64_t T = res.numel() == 0 ? 0 : res.numel() / (hc * d);
    TORCH_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, op,
                ": out_ids must be int32 or int64, got ", ids.scalar_type());
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T, op, ": out_ids must be [T = ", T, " (res's tokens), k], got ",
                ids.sizes());
    TORCH_CHECK(ids.device() == res.device(), op, ": out_ids must be on res's device (", res.device(), "), got ",
                ids.device());
    TORCH_CHECK(out_experts >= 1 && out_experts < (int64_t(1) << 31), op,
                ": out_experts must be in [1, 2^31) with out_ids, got ", out_experts);
    rows.k = ids.size(1);
    rows.experts = out_experts;
    const int64_t routed = T * rows.k;
    TORCH_CHECK(out.dim() == 2 && out.size(1) == d && (out.size(0) == routed || out.size(0) == routed + T), op,
                ": with out_ids [", T, ", ", rows.k, "] out must be the expert rows [T*k = ", routed,
                " or T*k + T = ", routed + T, " (a shared row per token), d = ", d, "], got ", out.sizes());
    rows.shared = T > 0 && out.size(0) == routed + T;
  } else {
    TORCH_CHECK(out_experts == 0, op, ": out_experts (", out_experts, ") is only read with out_ids");
    TORCH_CHECK(out.sizes() == at::IntArrayRef(with({d})), op, ": out must be ", at::IntArrayRef(with({d})),
                " (res without its hc dim), got ", out.sizes());
  }
  TORCH_CHECK(post.scalar_type() == at::kFloat && post.sizes() == at::IntArrayRef(with({hc})), op,
              ": post must be float32 ", at::IntArrayRef(with({hc})), ", got ", post.scalar_type(), " ", post.sizes());
  TORCH_CHECK(comb.scalar_type() == at::kFloat && comb.sizes() == at::IntArrayRef(with({hc, hc})), op,
              ": comb must be float32 ", at::IntArrayRef(with({hc, hc})), ", got ", comb.scalar_type(), " ",
              comb.sizes());
  TORCH_CHECK(out.device() == res.device() && post.device() == res.device() && comb.device() == res.device(), op,
              ": out, post and comb must be on res's device (", res.device(), ")");
  return rows;
}

// The sublayer output [T, d] from the MoE's rows as ATen ops, in the combine kernel's order: fp32 from 0, the
// valid slots in order, then the shared row; one rounding to the rows' dtype. A skipped slot's row (possibly NaN:
// the expert kernels leave it unwritten) is read but never reaches acc.
inline at::Tensor hc_post_rows_aten(const at::Tensor& rows, const at::Tensor& ids, const HcPostRows& r) {
  const int64_t T = ids.size(0), d = rows.size(1);
  at::Tensor acc = at::zeros({T, d}, rows.options().dtype(at::kFloat));
  const at::Tensor valid = at::logical_and(ids >= 0, ids < r.experts);
  for (int64_t j = 0; j < r.k; ++j) {
    const at::Tensor slot = rows.narrow(0, 0, T * r.k).view({T, r.k, d}).select(1, j).to(at::kFloat);
    acc = at::where(valid.select(1, j).unsqueeze(-1), acc + slot, acc);
  }
  if (r.shared) acc = acc + rows.narrow(0, T * r.k, T).to(at::kFloat);
  return acc.to(rows.scalar_type());
}

// hc_post as ATen ops (dsv4_model.layers.hc_post): new stream j = post_j * out + sum_i comb[i, j] * res_i in
// fp32, rounded to out's dtype.
inline at::Tensor hc_post_aten(const at::Tensor& out, const at::Tensor& res, const at::Tensor& post,
                               const at::Tensor& comb) {
  const at::Tensor mixed = (comb.unsqueeze(-1) * res.to(at::kFloat).unsqueeze(-2)).sum(-3);
  return (post.unsqueeze(-1) * out.to(at::kFloat).unsqueeze(-2) + mixed).to(out.scalar_type());
}

}  // namespace dsv4_mhc

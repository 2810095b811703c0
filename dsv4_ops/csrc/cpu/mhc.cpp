// CPU kernels of dsv4::hc_sinkhorn (the mHC residual-mixing matrix of DeepSeek-V4, one matrix per token, every
// step in fp32 in the order the reference (dsv4_ops/reference.py) writes it), dsv4::hc_pre and dsv4::hc_post_pre
// (docs/ops.md "## mHC"; per token: the sums in index order, then the same steps).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "mhc_checks.h"

namespace {

using dsv4_mhc::kMaxHc;

// Divides every row (rows) or column of c by its sum + eps; sums in index order.
void normalise(float (&c)[kMaxHc][kMaxHc], int hc, float eps, bool rows) {
  for (int a = 0; a < hc; ++a) {
    float s = 0.0f;
    for (int b = 0; b < hc; ++b) s += rows ? c[a][b] : c[b][a];
    s += eps;
    for (int b = 0; b < hc; ++b) (rows ? c[a][b] : c[b][a]) /= s;
  }
}

// softmax over each row + eps, then columns, then (iters - 1) x (rows, columns).
void sinkhorn_one(const float* x, float* y, int hc, int iters, float eps) {
  float c[kMaxHc][kMaxHc];
  for (int i = 0; i < hc; ++i) {
    float m = x[i * hc];
    for (int j = 1; j < hc; ++j) m = std::max(m, x[i * hc + j]);
    float s = 0.0f;
    for (int j = 0; j < hc; ++j) {
      c[i][j] = std::exp(x[i * hc + j] - m);
      s += c[i][j];
    }
    for (int j = 0; j < hc; ++j) c[i][j] = c[i][j] / s + eps;
  }
  normalise(c, hc, eps, false);
  for (int it = 1; it < iters; ++it) {
    normalise(c, hc, eps, true);
    normalise(c, hc, eps, false);
  }
  for (int i = 0; i < hc; ++i)
    for (int j = 0; j < hc; ++j) y[i * hc + j] = c[i][j];
}

at::Tensor hc_sinkhorn_cpu(const at::Tensor& logits, int64_t iters, double eps) {
  const int64_t hc = dsv4_mhc::check_hc_sinkhorn(logits, iters, eps);
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel() / (hc * hc);
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      sinkhorn_one(xp + t * hc * hc, yp + t * hc * hc, int(hc), int(iters), float(eps));
  });
  return out;
}

template <typename T>
void hc_pre_token(const T* x, const float* fn, const c10::BFloat16* fn16, const float* scale, const float* base,
                  const float* norm_w, const dsv4_mhc::HcPreShape& sh, int iters, float hc_eps, float norm_eps,
                  float out_eps, T* y, float* post, float* comb) {
  const int64_t hc = sh.hc, d = sh.d, K = hc * d, M = sh.mix;
  std::vector<float> xf(K);
  float ss = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    xf[k] = static_cast<float>(x[k]);
    ss += xf[k] * xf[k];
  }
  const float rs = 1.0f / std::sqrt(ss / float(K) + norm_eps);
  std::vector<float> mix(M);
  for (int64_t m = 0; m < M; ++m) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc += xf[k] * (fn ? fn[m * K + k] : static_cast<float>(fn16[m * K + k]));
    mix[m] = acc * rs;
  }
  float pre[dsv4_mhc::kMaxHc];
  for (int64_t i = 0; i < hc; ++i) {
    pre[i] = 1.0f / (1.0f + std::exp(-(mix[i] * scale[0] + base[i]))) + hc_eps;
    post[i] = 2.0f / (1.0f + std::exp(-(mix[hc + i] * scale[1] + base[hc + i])));
  }
  float logits[dsv4_mhc::kMaxHc * dsv4_mhc::kMaxHc];
  for (int64_t e = 0; e < hc * hc; ++e) logits[e] = mix[2 * hc + e] * scale[2] + base[2 * hc + e];
  sinkhorn_one(logits, comb, int(hc), iters, hc_eps);
  std::vector<T> yr(d);
  float ss2 = 0.0f;
  for (int64_t j = 0; j < d; ++j) {
    float acc = 0.0f;
    for (int64_t i = 0; i < hc; ++i) acc += pre[i] * xf[i * d + j];
    yr[j] = static_cast<T>(acc);  // y in x's dtype, as the unfused model rounds it before the sublayer's norm
    const float r = static_cast<float>(yr[j]);
    ss2 += r * r;
  }
  if (norm_w == nullptr) {
    std::copy(yr.begin(), yr.end(), y);
    return;
  }
  const float rs2 = 1.0f / std::sqrt(ss2 / float(d) + out_eps);
  for (int64_t j = 0; j < d; ++j) y[j] = static_cast<T>(norm_w[j] * (static_cast<float>(yr[j]) * rs2));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_cpu(const at::Tensor& x, const at::Tensor& fn,
                                                           const at::Tensor& scale, const at::Tensor& base,
                                                           const std::optional<at::Tensor>& norm_weight,
                                                           int64_t iters, double hc_eps, double norm_eps,
                                                           double out_eps) {
  const dsv4_mhc::HcPreShape sh = dsv4_mhc::check_hc_pre(x, fn, scale, base, norm_weight, iters, hc_eps, norm_eps,
                                                         out_eps);
  const at::Tensor xc = x.contiguous(), fc = fn.contiguous(), sc = scale.contiguous(), bc = base.contiguous();
  const at::Tensor wc = norm_weight ? norm_weight->contiguous() : at::Tensor();
  at::Tensor y, post, comb;
  std::tie(y, post, comb) = dsv4_mhc::hc_pre_outputs(x, sh);
  const float* fp = fc.scalar_type() == at::kFloat ? fc.data_ptr<float>() : nullptr;
  const c10::BFloat16* fp16 = fp ? nullptr : fc.data_ptr<c10::BFloat16>();
  const float* wp = wc.defined() ? wc.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "dsv4::hc_pre", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, sh.tokens, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        hc_pre_token(xp + t * sh.hc * sh.d, fp, fp16, sc.data_ptr<float>(), bc.data_ptr<float>(), wp, sh,
                     int(iters), float(hc_eps), float(norm_eps), float(out_eps), yp + t * sh.d,
                     post.data_ptr<float>() + t * sh.hc, comb.data_ptr<float>() + t * sh.hc * sh.hc);
    });
  });
  return {y, post, comb};
}

// hc_post (per token: new stream j = post_j * out + sum_i comb[i, j] * res_i, fp32 in index order, rounded to the
// dtype; with out_ids out is first summed from the MoE's rows), then hc_pre of the new streams.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre_cpu(
    const at::Tensor& out, const at::Tensor& res, const at::Tensor& post_in, const at::Tensor& comb_in,
    const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base, const std::optional<at::Tensor>& norm_weight,
    int64_t iters, double hc_eps, double norm_eps, double out_eps, const std::optional<at::Tensor>& out_ids,
    int64_t out_experts) {
  const dsv4_mhc::HcPreShape sh = dsv4_mhc::check_hc_pre(res, fn, scale, base, norm_weight, iters, hc_eps, norm_eps,
                                                         out_eps, "dsv4::hc_post_pre");
  const dsv4_mhc::HcPostRows rows = dsv4_mhc::check_hc_post(out, res, post_in, comb_in, out_ids, out_experts);
  // with out_ids: the rows' sum [T, d] first (the combine's order; rows of other ids are never picked)
  const at::Tensor oc = out_ids ? dsv4_mhc::hc_post_rows_aten(out.contiguous(), *out_ids, rows) : out.contiguous();
  const at::Tensor rc = res.contiguous(), pc = post_in.contiguous(), cc = comb_in.contiguous();
  at::Tensor h = at::empty(res.sizes(), res.options());
  const int64_t hc = sh.hc, d = sh.d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, res.scalar_type(), "dsv4::hc_post_pre", [&] {
    const scalar_t* op = oc.data_ptr<scalar_t>();
    const scalar_t* rp = rc.data_ptr<scalar_t>();
    const float* pp = pc.data_ptr<float>();
    const float* cp = cc.data_ptr<float>();
    scalar_t* hp = h.data_ptr<scalar_t>();
    at::parallel_for(0, sh.tokens, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t j = 0; j < hc; ++j)
          for (int64_t k = 0; k < d; ++k) {
            float s = 0.0f;
            for (int64_t i = 0; i < hc; ++i)
              s += cp[(t * hc + i) * hc + j] * static_cast<float>(rp[(t * hc + i) * d + k]);
            hp[(t * hc + j) * d + k] = static_cast<scalar_t>(pp[t * hc + j] * static_cast<float>(op[t * d + k]) + s);
          }
    });
  });
  at::Tensor y, post, comb;
  std::tie(y, post, comb) = hc_pre_cpu(h, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps);
  return {h, y, post, comb};
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("hc_sinkhorn", &hc_sinkhorn_cpu);
  m.impl("hc_pre", &hc_pre_cpu);
  m.impl("hc_post_pre", &hc_post_pre_cpu);
}

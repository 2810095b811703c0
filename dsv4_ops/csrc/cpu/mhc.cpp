// CPU kernel of dsv4::hc_sinkhorn: the mHC residual-mixing matrix of DeepSeek-V4 (docs/ops.md "## mHC"), one
// matrix per token, every step in fp32 in the order the reference (dsv4_ops/reference.py) writes it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

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

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("hc_sinkhorn", &hc_sinkhorn_cpu); }

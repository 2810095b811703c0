// CPU kernel of dsv4::router_topk (docs/ops.md "## Router"): per row, the k largest scores + bias (NaN above
// every number, ties to the lower expert index), their unbiased scores, optionally divided by their sum, times
// scale. With sqrt_softplus the scores are sqrt(softplus(input)) first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "router_checks.h"

namespace {

// Total order of the selection: NaN above +inf, then the numbers (-0 == +0).
bool before(float a, int64_t ia, float b, int64_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

std::tuple<at::Tensor, at::Tensor> router_topk_cpu(const at::Tensor& scores, const c10::optional<at::Tensor>& bias,
                                                   int64_t k, bool renormalize, double scale,
                                                   bool sqrt_softplus) {
  dsv4_router::check(scores, bias, k);
  const at::Tensor s = scores.contiguous();
  const int64_t N = s.size(0), E = s.size(1);
  at::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  at::Tensor weights = at::empty({N, k}, s.options());
  at::Tensor indices = at::empty({N, k}, s.options().dtype(at::kLong));
  const float* sp = s.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* wp = weights.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> order(E);
    std::vector<float> key(E), score(E);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = sp + r * E;
      if (sqrt_softplus) {
        for (int64_t e = 0; e < E; ++e) score[e] = dsv4_router::sqrt_softplus(row[e]);
        row = score.data();
      }
      for (int64_t e = 0; e < E; ++e) key[e] = bp ? row[e] + bp[e] : row[e];
      std::iota(order.begin(), order.end(), int64_t(0));
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t x, int64_t y) { return before(key[x], x, key[y], y); });
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += row[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        const float w = renormalize ? row[order[j]] / sum : row[order[j]];
        wp[r * k + j] = w * float(scale);
        ip[r * k + j] = order[j];
      }
    }
  });
  return {weights, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("router_topk", &router_topk_cpu); }

// CPU kernels of dsv4::indexer_score_topk (DeepSeek-V4 lightning indexer at decode) and
// dsv4::indexer_prefill_scores (its scores over a prefill chunk) and dsv4::indexer_topk (their top-k), at the end of
// this file.
// Scores are fp32: per key the dot products run sequentially over d, the head sum sequentially over h
// (the CUDA kernel sums in another order, so scores may differ in the last bits; exact-input results agree).
// Ranking uses the same total order as the CUDA kernel: the float mapped to an order-preserving uint32
// (with -0 folded onto +0) descending, then the index ascending.
// The head weights are rounded to weights_dtype (RNE, as Tensor.to) and multiplied by fp32(weights_scale) once
// per (b, h), the same fp32 operations as the model's `proj.to(bf16).float() * scale`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "indexer_checks.h"

namespace {

constexpr float kE2M1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

inline float ue8m0(uint8_t e) { return std::ldexp(1.0f, int(e) - 127); }

inline uint32_t order_key(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u << 1) == 0) u = 0;  // -0 == +0
  return (u >> 31) ? ~u : (u | 0x80000000u);
}

// float(w.to(dtype)) * scale in fp32, for every head weight.
std::vector<float> effective_weights(const at::Tensor& weights, double weights_scale,
                                     std::optional<at::ScalarType> weights_dtype) {
  const at::Tensor wc = weights.contiguous();
  const float* src = wc.data_ptr<float>();
  const float scale = static_cast<float>(weights_scale);
  std::vector<float> w(wc.numel());
  for (size_t i = 0; i < w.size(); ++i) {
    float v = src[i];
    if (weights_dtype == at::kBFloat16) v = static_cast<float>(c10::BFloat16(v));
    else if (weights_dtype == at::kHalf) v = static_cast<float>(c10::Half(v));
    w[i] = v * scale;
  }
  return w;
}

at::Tensor indexer_score_topk_cpu(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_codes,
                                  const at::Tensor& k_scales, const at::Tensor& n_valid, int64_t topk,
                                  double weights_scale, std::optional<at::ScalarType> weights_dtype,
                                  int64_t kv_batch) {
  dsv4_indexer::check(q, weights, k_codes, k_scales, n_valid, topk, weights_dtype, kv_batch);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), N = k_codes.size(1);
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const std::vector<float> wf = effective_weights(weights, weights_scale, weights_dtype);
  const at::Tensor kc = k_codes.contiguous(), ks = k_scales.contiguous();
  const at::Tensor nv64 = n_valid.to(at::kLong).contiguous();
  at::Tensor out = at::full({B, topk}, -1, q.options().dtype(at::kInt));
  const float* qp = qf.data_ptr<float>();
  const float* wp = wf.data();
  const uint8_t* cp = kc.data_ptr<uint8_t>();
  const uint8_t* sp = ks.data_ptr<uint8_t>();
  const int64_t* nvp = nv64.data_ptr<int64_t>();
  int32_t* op = out.data_ptr<int32_t>();

  std::vector<uint32_t> keys(N);
  std::vector<int32_t> order(N);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nv = std::min<int64_t>(std::max<int64_t>(nvp[b], 0), N);
    const int64_t kb = kv_batch ? b % kv_batch : b;  // the sequence whose keys row b scores
    const float* qb = qp + b * H * D;
    const float* wb = wp + b * H;
    at::parallel_for(0, nv, 16, [&](int64_t i0, int64_t i1) {
      std::vector<float> k(D);
      for (int64_t i = i0; i < i1; ++i) {
        const uint8_t* c = cp + (kb * N + i) * (D / 2);
        const uint8_t* s = sp + (kb * N + i) * (D / 32);
        for (int64_t d = 0; d < D; ++d) {
          const int nib = (d & 1) ? (c[d / 2] >> 4) : (c[d / 2] & 0xF);
          const float v = kE2M1[nib & 7] * ue8m0(s[d / 32]);
          k[d] = (nib & 8) ? -v : v;
        }
        float score = 0.0f;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qb + h * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
          score += wb[h] * std::max(dot, 0.0f);
        }
        keys[i] = order_key(score);
      }
    });
    const int64_t take = std::min<int64_t>(topk, nv);
    for (int64_t i = 0; i < nv; ++i) order[i] = int32_t(i);
    std::partial_sort(order.begin(), order.begin() + take, order.begin() + nv, [&](int32_t a, int32_t c) {
      return keys[a] != keys[c] ? keys[a] > keys[c] : a < c;
    });
    std::copy(order.begin(), order.begin() + take, op + b * topk);
  }
  return out;
}

// dsv4::indexer_prefill_scores: per (b, s) every visible key's score, dot products sequential over d, the head
// sum sequential over h (fp32); -inf for keys t >= n_visible[b, s].
at::Tensor indexer_prefill_scores_cpu(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& keys,
                                      const at::Tensor& n_visible) {
  dsv4_indexer::check_prefill(q, weights, keys, n_visible);
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), T = keys.size(1);
  const at::Tensor qf = q.to(at::kFloat).contiguous(), kf = keys.to(at::kFloat).contiguous(),
                   wc = weights.contiguous(), nc = n_visible.contiguous();
  at::Tensor out = at::empty({B, S, T}, q.options().dtype(at::kFloat));
  const float *qp = qf.data_ptr<float>(), *kp = kf.data_ptr<float>(), *wp = wc.data_ptr<float>();
  const int64_t* np = nc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bs = begin; bs < end; ++bs) {
      const int64_t b = bs / S, n = std::min(std::max(np[bs], int64_t(0)), T);
      const float* qrow = qp + bs * H * D;
      const float* w = wp + bs * H;
      float* orow = op + bs * T;
      for (int64_t t = 0; t < T; ++t) {
        if (t >= n) {
          orow[t] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const float* k = kp + (b * T + t) * D;
        float score = 0.f;
        for (int64_t h = 0; h < H; ++h) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qrow[h * D + d] * k[d];
          score += w[h] * std::max(dot, 0.f);
        }
        orow[t] = score;
      }
    }
  });
  return out;
}

// dsv4::indexer_topk: per row the topk largest composites (order_key(score) << 32 | N - 1 - i), descending.
at::Tensor indexer_topk_cpu(const at::Tensor& scores, int64_t topk) {
  dsv4_indexer::check_topk(scores, topk);
  const int64_t N = scores.size(-1), R = scores.numel() / N;
  const at::Tensor sc = scores.contiguous();
  std::vector<int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = topk;
  at::Tensor out = at::empty(shape, scores.options().dtype(at::kLong));
  const float* sp = sc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<uint64_t> comp(N);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = sp + r * N;
      for (int64_t i = 0; i < N; ++i) comp[i] = (uint64_t(order_key(row[i])) << 32) | uint64_t(N - 1 - i);
      std::partial_sort(comp.begin(), comp.begin() + topk, comp.end(), std::greater<uint64_t>());
      for (int64_t j = 0; j < topk; ++j) op[r * topk + j] = N - 1 - int64_t(comp[j] & 0xFFFFFFFFu);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("indexer_score_topk", &indexer_score_topk_cpu);
  m.impl("indexer_prefill_scores", &indexer_prefill_scores_cpu);
  m.impl("indexer_topk", &indexer_topk_cpu);
}

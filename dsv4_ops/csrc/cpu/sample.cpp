// CPU kernel of dsv4::sample. Same definitions as the CUDA kernel (sample_math.h); thresholds are found
// by sorting here and by a radix search on the GPU, both computing the same exact integer criterion.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "sample_checks.h"
#include "sample_math.h"

namespace {

using namespace dsv4_sample;

// Smallest present key v (among keys >= lower) with W(key > v) < target, W = sum of weights; keys sorted
// descending with their weights. This is the k-th largest key for unit weights and target k.
uint32_t threshold_sorted(const std::vector<std::pair<uint32_t, uint64_t>>& desc, double target) {
  uint64_t above = 0;
  uint32_t best = desc.front().first;
  size_t i = 0;
  while (i < desc.size()) {
    const uint32_t key = desc[i].first;
    if (!((double)above < target)) break;
    best = key;
    for (; i < desc.size() && desc[i].first == key; ++i) above += desc[i].second;
  }
  return best;
}

int64_t sample_row(const float* l, int64_t V, float t, int64_t k, float p, uint64_t seed, uint64_t offset) {
  float best_v = -INFINITY;
  int64_t best_i = std::numeric_limits<int64_t>::max();
  if (!(t > 0.0f)) {
    for (int64_t i = 0; i < V; ++i) {
      const float v = sanitize(l[i]);
      if (better(v, i, best_v, best_i)) best_v = v, best_i = i;
    }
    return best_i;
  }
  const bool use_k = k > 0 && k < V;
  const bool use_p = p < 1.0f;
  uint32_t tau = 0;
  if (use_k || use_p) {
    std::vector<std::pair<uint32_t, uint64_t>> desc((size_t)V);
    float row_max = -INFINITY;
    for (int64_t i = 0; i < V; ++i) {
      desc[i] = {order_key(l[i]), 1};
      row_max = std::max(row_max, sanitize(l[i]));
    }
    std::sort(desc.begin(), desc.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    if (use_k) tau = threshold_sorted(desc, (double)k);
    if (use_p) {
      std::vector<std::pair<uint32_t, uint64_t>> kept;
      std::vector<float> vals((size_t)V);
      uint64_t total = 0;
      for (int64_t i = 0; i < V; ++i) {
        if (order_key(l[i]) < tau) continue;
        const uint64_t w = fixed_mass(l[i], row_max, t);
        kept.push_back({order_key(l[i]), w});
        total += w;
      }
      if (total > 0) {
        std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        tau = std::max(tau, threshold_sorted(kept, top_p_target(p, total)));
      }
    }
  }
  uint32_t words[4];
  for (int64_t i = 0; i < V; ++i) {
    if ((i & 3) == 0) philox_group(seed, offset, (uint64_t)i >> 2, words);
    if (order_key(l[i]) < tau) continue;
    const float v = sanitize(l[i]) / t + gumbel_from_word(words[i & 3]);
    if (better(v, i, best_v, best_i)) best_v = v, best_i = i;
  }
  return best_i;
}

at::Tensor sample_cpu(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                      const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& offset) {
  dsv4_sample::check(logits, temperature, top_k, top_p, seed, offset);
  const int64_t B = logits.size(0), V = logits.size(1);
  const at::Tensor lc = logits.contiguous(), tc = temperature.contiguous(), kc = top_k.contiguous(),
                   pc = top_p.contiguous(), sc = seed.contiguous(), oc = offset.contiguous();
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  const float* pp = pc.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* op = oc.data_ptr<int64_t>();
  int64_t* outp = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      outp[b] = sample_row(lp + b * V, V, tp[b], kp[b], pp[b], (uint64_t)sp[b], (uint64_t)op[b]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("sample", &sample_cpu); }

// Argument checks and the selection order shared by the CPU and CUDA kernels of dsv4::router_topk (docs/ops.md
// "## Router").
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernel_limits.h"

namespace dsv4_router {

constexpr int64_t kMaxExperts = dsv4_limits::kRouterMaxExperts;
constexpr int64_t kMaxTopk = dsv4_limits::kRouterMaxTopk;

inline void check(const at::Tensor& scores, const c10::optional<at::Tensor>& bias, int64_t k) {
  const char* op = "dsv4::router_topk";
  TORCH_CHECK(scores.scalar_type() == at::kFloat, op, ": scores must be float32, got ", scores.scalar_type());
  TORCH_CHECK(scores.dim() == 2, op, ": scores must be [N, E], got ", scores.sizes());
  const int64_t E = scores.size(1);
  TORCH_CHECK(E >= 1 && E <= kMaxExperts, op, ": E must be in [1, ", kMaxExperts, "], got ", E);
  TORCH_CHECK(k >= 1 && k <= std::min(E, kMaxTopk), op, ": k must be in [1, min(E, ", kMaxTopk, ")], got ", k);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == E, op,
                ": bias must be float32 [E = ", E, "], got ", bias->scalar_type(), " ", bias->sizes());
    TORCH_CHECK(bias->device() == scores.device(), op, ": bias is on ", bias->device(), ", scores on ",
                scores.device());
  }
}

// V4's score function, as torch computes it in fp32: F.softplus (beta 1, threshold 20) then sqrt, each rounded.
inline float sqrt_softplus(float x) { return std::sqrt(x > 20.0f ? x : std::log1p(std::exp(x))); }

}  // namespace dsv4_router

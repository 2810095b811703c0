// Argument checks shared by the CPU and CUDA kernels of dsv4::fp32_linear (docs/ops.md "## fp32 linear").
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "row_matmul.h"

namespace dsv4_fp32_linear {

constexpr int64_t kMaxWeights = 8;

// Returns N of every weight. op, name: the op and the argument the errors name (nvfp4_fp32_linear_multi checks its
// fp32_weight here too).
inline std::vector<int64_t> check(const at::Tensor& x, at::TensorList w, const char* op = "dsv4::fp32_linear",
                                  const char* name = "weight") {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat,
              op, ": x must be bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must be [..., K] with K >= 1, got ", x.sizes());
  TORCH_CHECK(!w.empty() && int64_t(w.size()) <= kMaxWeights, op, ": ", name, " must list 1 to ", kMaxWeights,
              " matrices, got ", w.size());
  std::vector<int64_t> ns;
  for (size_t i = 0; i < w.size(); ++i) {
    TORCH_CHECK(w[i].scalar_type() == at::kBFloat16 || w[i].scalar_type() == at::kFloat, op, ": ", name, "[", i,
                "] must be bfloat16 or float32, got ", w[i].scalar_type());
    TORCH_CHECK(w[i].dim() == 2 && w[i].size(1) == x.size(-1), op, ": ", name, "[", i, "] must be [N, K = ",
                x.size(-1), "], got ", w[i].sizes());
    TORCH_CHECK(w[i].device() == x.device(), op, ": ", name, "[", i, "] is on ", w[i].device(), ", x on ",
                x.device());
    ns.push_back(w[i].size(0));
  }
  return ns;
}

// y_i = float(x) @ float(w_i)^T as separate fp32 matmuls (the CPU kernel; the CUDA fallback beyond the GEMV).
inline std::vector<at::Tensor> matmul_each(const at::Tensor& x, at::TensorList w) {
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  std::vector<at::Tensor> out;
  for (const at::Tensor& wi : w) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = wi.size(0);
    out.push_back(dsv4_cpu::row_matmul(xf, wi.to(at::kFloat)).view(shape));
  }
  return out;
}

}  // namespace dsv4_fp32_linear

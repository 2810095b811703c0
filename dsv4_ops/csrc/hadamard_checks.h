// Argument checks and the rounding helpers shared by the CPU and CUDA kernels of dsv4::hadamard_fp4 (docs/ops.md
// "## Hadamard + FP4").
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace dsv4_hadamard {

constexpr int64_t kFp4Block = 32;

struct Shape {
  int64_t rows, heads, d, nope;
};

inline Shape check(const at::Tensor& x, const std::optional<at::Tensor>& cs, int64_t rope_dim) {
  const char* op = "dsv4::hadamard_fp4";
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3, op, ": x must be [rows, heads, d], got ", x.sizes());
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d >= kFp4Block && d <= 4096 && (d & (d - 1)) == 0, op,
              ": d must be a power of two in [32, 4096], got ", d);
  TORCH_CHECK(cs.has_value() == (rope_dim > 0), op, ": cs must be given exactly when rope_dim > 0 (rope_dim ",
              rope_dim, ")");
  TORCH_CHECK(rope_dim >= 0 && rope_dim <= d && rope_dim % 2 == 0, op,
              ": rope_dim must be even and in [0, d], got ", rope_dim);
  if (cs.has_value()) {
    TORCH_CHECK(cs->scalar_type() == at::kFloat && cs->dim() == 3 && cs->size(0) == rows &&
                    cs->size(1) == rope_dim / 2 && cs->size(2) == 2,
                op, ": cs must be float32 [rows = ", rows, ", rope_dim / 2 = ", rope_dim / 2, ", 2], got ",
                cs->scalar_type(), " ", cs->sizes());
    TORCH_CHECK(cs->device() == x.device(), op, ": cs is on ", cs->device(), ", x on ", x.device());
  }
  return {rows, heads, d, d - rope_dim};
}

// The fp32 d^-0.5 the butterfly's result is multiplied by (Python's d ** -0.5 rounded to fp32).
inline float rotate_scale(int64_t d) { return static_cast<float>(std::pow(double(d), -0.5)); }

}  // namespace dsv4_hadamard

// CPU kernel of dsv4::hadamard_fp4 (docs/ops.md "## Hadamard + FP4"): per vector, RoPE of the trailing pairs
// (optional), the Walsh-Hadamard butterfly in fp32 (stride 1, 2, 4, ...), the fp32 d^-0.5, then FP4 e2m1 with a
// power-of-two scale per 32, each step rounded to x's dtype where the model's steps round.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "hadamard_checks.h"
#include "pow2_scale.h"

namespace {

template <typename T>
float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// Nearest e2m1 value of v in [-6, 6], ties to the even code (round-half-even of v / step in each binade).
float round_e2m1(float v) {
  const float a = std::fabs(v);
  const float q = a < 2.0f ? std::nearbyint(a * 2.0f) * 0.5f : a < 4.0f ? std::nearbyint(a)
                                                                        : std::nearbyint(a * 0.5f) * 2.0f;
  return v < 0.0f ? -q : q;
}

template <typename T>
void run(const at::Tensor& x, const float* cs, int64_t rope_dim, const dsv4_hadamard::Shape& sh, at::Tensor& out) {
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float scale = dsv4_hadamard::rotate_scale(sh.d);
  const float inv6 = 1.0f / 6.0f, floor = 6.0f * std::ldexp(1.0f, -126);
  at::parallel_for(0, sh.rows * sh.heads, 16, [&](int64_t v0, int64_t v1) {
    std::vector<float> y(sh.d);
    for (int64_t v = v0; v < v1; ++v) {
      for (int64_t i = 0; i < sh.d; ++i) y[i] = static_cast<float>(xp[v * sh.d + i]);
      if (cs != nullptr) {
        const float* c = cs + (v / sh.heads) * rope_dim;
        for (int64_t k = 0; k < rope_dim / 2; ++k) {
          const float x0 = y[sh.nope + 2 * k], x1 = y[sh.nope + 2 * k + 1], co = c[2 * k], si = c[2 * k + 1];
          y[sh.nope + 2 * k] = round_to<T>(x0 * co - x1 * si);
          y[sh.nope + 2 * k + 1] = round_to<T>(x0 * si + x1 * co);
        }
      }
      for (int64_t h = 1; h < sh.d; h *= 2)
        for (int64_t i = 0; i < sh.d; ++i)
          if ((i & h) == 0) {
            const float a = y[i], b = y[i + h];
            y[i] = a + b;
            y[i + h] = a - b;
          }
      for (int64_t i = 0; i < sh.d; ++i) y[i] = round_to<T>(y[i] * scale);
      for (int64_t b = 0; b < sh.d; b += dsv4_hadamard::kFp4Block) {
        float amax = 0.0f;
        for (int64_t i = b; i < b + dsv4_hadamard::kFp4Block; ++i) amax = std::max(amax, std::fabs(y[i]));
        const float s = dsv4::pow2_ceil(std::max(amax, floor) * inv6);
        for (int64_t i = b; i < b + dsv4_hadamard::kFp4Block; ++i)
          y[i] = round_to<T>(round_e2m1(std::min(std::max(y[i] / s, -6.0f), 6.0f)) * s);
      }
      for (int64_t i = 0; i < sh.d; ++i) op[v * sh.d + i] = static_cast<T>(y[i]);
    }
  });
}

at::Tensor hadamard_fp4_cpu(const at::Tensor& x, const std::optional<at::Tensor>& cs, int64_t rope_dim) {
  const dsv4_hadamard::Shape sh = dsv4_hadamard::check(x, cs, rope_dim);
  TORCH_CHECK(x.device().is_cpu(), "dsv4::hadamard_fp4: expected CPU tensors, got ", x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor cc = cs.has_value() ? cs->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* c = cc.defined() ? cc.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(xc, c, rope_dim, sh, out);
  else
    run<float>(xc, c, rope_dim, sh, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("hadamard_fp4", &hadamard_fp4_cpu); }

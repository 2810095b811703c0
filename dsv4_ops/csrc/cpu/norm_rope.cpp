// CPU kernel of dsv4::rms_norm_rope (docs/ops.md "## RMSNorm + RoPE"): per vector, the model's steps at its
// rounding points: RMSNorm in fp32 (optional weight) rounded to x's dtype, RoPE of the trailing pairs in fp32
// rounded again, and optionally the simulated FP8 rounding of the leading (non-RoPE) dims.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "cache_slot.h"
#include "norm_rope_checks.h"
#include "pow2_scale.h"

namespace {

template <typename T>
float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// dst(v): where vector v goes (d elements), or null to skip it
template <typename T, typename Dst>
void run(const at::Tensor& x, const float* w, const float* cs, float eps, int64_t rope_dim, bool fp8_nope,
         const dsv4_norm_rope::Shape& sh, const Dst& dst) {
  const T* xp = x.data_ptr<T>();
  const float inv_max = 1.0f / dsv4_norm_rope::kFp8Max;  // the fp32 reciprocal the official kernel multiplies by
  at::parallel_for(0, sh.rows * sh.heads, 16, [&](int64_t v0, int64_t v1) {
    std::vector<float> y(sh.d);
    for (int64_t v = v0; v < v1; ++v) {
      T* out = dst(v);
      if (out == nullptr) continue;
      const T* xv = xp + v * sh.d;
      const float* c = cs + (v / sh.heads) * rope_dim;
      float ss = 0.0f;
      for (int64_t i = 0; i < sh.d; ++i) {
        const float f = static_cast<float>(xv[i]);
        ss += f * f;
      }
      const float rs = 1.0f / std::sqrt(ss / float(sh.d) + eps);
      for (int64_t i = 0; i < sh.d; ++i) {
        const float n = static_cast<float>(xv[i]) * rs;
        y[i] = round_to<T>(w != nullptr ? w[i] * n : n);
      }
      for (int64_t k = 0; k < rope_dim / 2; ++k) {
        const float x0 = y[sh.nope + 2 * k], x1 = y[sh.nope + 2 * k + 1], co = c[2 * k], si = c[2 * k + 1];
        y[sh.nope + 2 * k] = round_to<T>(x0 * co - x1 * si);
        y[sh.nope + 2 * k + 1] = round_to<T>(x0 * si + x1 * co);
      }
      if (fp8_nope) {
        for (int64_t b = 0; b < sh.nope; b += dsv4_norm_rope::kFp8Block) {
          float amax = 0.0f;
          for (int64_t i = b; i < b + dsv4_norm_rope::kFp8Block; ++i) amax = std::max(amax, std::fabs(y[i]));
          const float s = dsv4::pow2_ceil(std::max(amax, dsv4_norm_rope::kFp8AmaxFloor) * inv_max);
          for (int64_t i = b; i < b + dsv4_norm_rope::kFp8Block; ++i) {
            const float q = std::min(std::max(y[i] / s, -dsv4_norm_rope::kFp8Max), dsv4_norm_rope::kFp8Max);
            y[i] = round_to<T>(static_cast<float>(c10::Float8_e4m3fn(q)) * s);
          }
        }
      }
      for (int64_t i = 0; i < sh.d; ++i) out[i] = static_cast<T>(y[i]);
    }
  });
}

at::Tensor rms_norm_rope_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& cs,
                             double eps, int64_t rope_dim, bool fp8_nope) {
  const dsv4_norm_rope::Shape sh = dsv4_norm_rope::check(x, weight, cs, eps, rope_dim, fp8_nope);
  TORCH_CHECK(x.device().is_cpu(), "dsv4::rms_norm_rope: expected CPU tensors, got ", x.device());
  const at::Tensor xc = x.contiguous(), cc = cs.contiguous();
  const at::Tensor wc = weight.has_value() ? weight->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* w = wc.defined() ? wc.data_ptr<float>() : nullptr;
  const int64_t d = sh.d;
  if (x.scalar_type() == at::kBFloat16) {
    auto* op = out.data_ptr<c10::BFloat16>();
    run<c10::BFloat16>(xc, w, cc.data_ptr<float>(), float(eps), rope_dim, fp8_nope, sh,
                       [&](int64_t v) { return op + v * d; });
  } else {
    auto* op = out.data_ptr<float>();
    run<float>(xc, w, cc.data_ptr<float>(), float(eps), rope_dim, fp8_nope, sh, [&](int64_t v) { return op + v * d; });
  }
  return out;
}

void rms_norm_rope_store_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& cs,
                             double eps, int64_t rope_dim, bool fp8_nope, const at::Tensor& positions, int64_t ratio,
                             int64_t offset, int64_t slots, const at::Tensor& cache, int64_t kv_batch) {
  const dsv4_norm_rope::Shape sh = dsv4_norm_rope::check_store(x, weight, cs, eps, rope_dim, fp8_nope, positions,
                                                               ratio, offset, slots, cache, kv_batch);
  TORCH_CHECK(x.device().is_cpu(), "dsv4::rms_norm_rope_store: expected CPU tensors, got ", x.device());
  const at::Tensor xc = x.contiguous(), cc = cs.contiguous(), pc = positions.to(at::kLong).contiguous();
  const at::Tensor wc = weight.has_value() ? weight->contiguous() : at::Tensor();
  const float* w = wc.defined() ? wc.data_ptr<float>() : nullptr;
  const int64_t* pos = pc.data_ptr<int64_t>();
  const int64_t d = sh.d, row = cache.size(1) * d;
  auto dst = [&](auto* base) {
    return [=](int64_t v) -> decltype(base) {
      const int64_t slot = dsv4::cache_slot(pos[v], ratio, slots);  // row v's slot past offset
      return slot < 0 ? nullptr : base + (kv_batch ? v % kv_batch : v) * row + (offset + slot) * d;
    };
  };
  if (x.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(xc, w, cc.data_ptr<float>(), float(eps), rope_dim, fp8_nope, sh,
                       dst(cache.data_ptr<c10::BFloat16>()));
  else
    run<float>(xc, w, cc.data_ptr<float>(), float(eps), rope_dim, fp8_nope, sh, dst(cache.data_ptr<float>()));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("rms_norm_rope", &rms_norm_rope_cpu);
  m.impl("rms_norm_rope_store", &rms_norm_rope_store_cpu);
}

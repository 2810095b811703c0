// Argument checks shared by the CPU and CUDA kernels of dsv4::sample (docs/ops.md "## Sampler"); the CUDA kernel's
// own limits (V < 2^31, B < 65536) stay in its bindings.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace dsv4_sample {

// logits fp32 [B, V > 0]; temperature / top_p fp32 [B], top_k / seed / offset int64 [B], all on logits' device.
inline void check(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& offset) {
  TORCH_CHECK(logits.dim() == 2, "dsv4::sample: logits must be [B, V], got ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "dsv4::sample: logits must be float32, got ",
              logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0, "dsv4::sample: logits must have V > 0 columns");
  const int64_t B = logits.size(0);
  auto param = [&](const at::Tensor& x, const char* name, at::ScalarType dtype) {
    TORCH_CHECK(x.dim() == 1 && x.size(0) == B, "dsv4::sample: ", name, " must have shape [B] = [", B, "], got ",
                x.sizes());
    TORCH_CHECK(x.scalar_type() == dtype, "dsv4::sample: ", name, " must be ", dtype, ", got ", x.scalar_type());
    TORCH_CHECK(x.device() == logits.device(), "dsv4::sample: ", name, " must be on ", logits.device(),
                " like logits, got ", x.device());
  };
  param(temperature, "temperature", at::kFloat);
  param(top_k, "top_k", at::kLong);
  param(top_p, "top_p", at::kFloat);
  param(seed, "seed", at::kLong);
  param(offset, "offset", at::kLong);
}

}  // namespace dsv4_sample

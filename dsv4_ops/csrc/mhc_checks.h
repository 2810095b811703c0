// Argument checks shared by the CPU and CUDA kernels of dsv4::hc_sinkhorn (docs/ops.md "## mHC").
#pragma once
#include <ATen/ATen.h>

namespace dsv4_mhc {

constexpr int64_t kMaxHc = 8;  // hc_mult of DeepSeek-V4 is 4

// Returns hc.
inline int64_t check_hc_sinkhorn(const at::Tensor& logits, int64_t iters, double eps) {
  const char* op = "dsv4::hc_sinkhorn";
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32, got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() >= 2 && logits.size(-1) == logits.size(-2), op,
              ": logits must be [..., hc, hc], got ", logits.sizes());
  const int64_t hc = logits.size(-1);
  TORCH_CHECK(hc >= 1 && hc <= kMaxHc, op, ": hc must be in [1, ", kMaxHc, "], got ", hc);
  TORCH_CHECK(iters >= 1, op, ": iters must be >= 1, got ", iters);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  return hc;
}

}  // namespace dsv4_mhc

// Argument checks shared by the CPU and CUDA kernels of dsv4::prefetch_l2 (docs/ops.md "## L2 prefetch"): every
// problem is reported, naming the argument, before anything is issued.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "kernel_limits.h"

namespace dsv4_prefetch {

// The bytes of each tensor (numel * element size) and their sum.
struct Plan {
  std::vector<int64_t> bytes;
  int64_t total = 0;
};

inline Plan check(const at::Tensor& after, at::TensorList weights, const at::Tensor& marker) {
  const char* op = "dsv4::prefetch_l2";
  TORCH_CHECK(marker.scalar_type() == at::kLong && marker.numel() == 1 && marker.is_contiguous(), op,
              ": marker must be a contiguous int64 tensor of one element, got ", marker.scalar_type(), " ",
              marker.sizes());
  TORCH_CHECK(after.device() == marker.device(), op, ": after must be on marker's device (", marker.device(),
              "), got ", after.device());
  TORCH_CHECK(int64_t(weights.size()) <= dsv4_limits::kPrefetchMaxTensors, op, ": at most ",
              dsv4_limits::kPrefetchMaxTensors, " weights per call, got ", weights.size());
  Plan plan;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device() == marker.device(), op, ": weights[", i, "] must be on marker's device (",
                marker.device(), "), got ", w.device());
    TORCH_CHECK(w.is_contiguous(), op, ": weights[", i, "] must be contiguous (its bytes one range), got strides ",
                w.strides());
    plan.bytes.push_back(w.numel() * int64_t(w.element_size()));
    plan.total += plan.bytes.back();
  }
  return plan;
}

}  // namespace dsv4_prefetch

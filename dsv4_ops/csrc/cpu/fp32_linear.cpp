// CPU kernel of dsv4::fp32_linear: fp32 matmuls of the widened operands (docs/ops.md "## fp32 linear").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fp32_linear_checks.h"

namespace {

std::vector<at::Tensor> fp32_linear_cpu(const at::Tensor& x, at::TensorList w) {
  dsv4_fp32_linear::check(x, w);
  return dsv4_fp32_linear::matmul_each(x, w);
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("fp32_linear", &fp32_linear_cpu); }

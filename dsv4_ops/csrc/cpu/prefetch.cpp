// CPU kernel of dsv4::prefetch_l2 (docs/ops.md "## L2 prefetch"): a CPU has no L2 to ask, so only the marker is
// written (the bytes the CUDA kernel would ask for), which keeps the op's one observable effect on every device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "prefetch_checks.h"

namespace {

void prefetch_l2_cpu(const at::Tensor& after, at::TensorList weights, const at::Tensor& marker) {
  const dsv4_prefetch::Plan plan = dsv4_prefetch::check(after, weights, marker);
  TORCH_CHECK(marker.device().is_cpu(), "dsv4::prefetch_l2: expected CPU tensors, got ", marker.device());
  *marker.data_ptr<int64_t>() = plan.total;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("prefetch_l2", &prefetch_l2_cpu); }

// CPU kernel of dsv4::nvfp4_linear_chain: the stages as the per-op CPU kernels in order (the reference the CUDA
// chain's one launch is held to); the sync counters are the CUDA launch's alone and stay as they are.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "chain_checks.h"

namespace {

void nvfp4_linear_chain_cpu(const at::Tensor& x, at::TensorList w, at::TensorList s, at::TensorList gs,
                            const at::Tensor& out, const at::Tensor& sync) {
  const dsv4_chain::ChainDims d = dsv4_chain::check_chain(x, w, s, gs, out, sync, "dsv4::nvfp4_linear_chain");
  if (d.M == 0) return;
  out.copy_(dsv4_chain::chain_per_op(x, w, s, gs, d).view(d.out_shape));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("nvfp4_linear_chain", &nvfp4_linear_chain_cpu); }

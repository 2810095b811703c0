// CUDA registration of dsv4::hadamard_fp4: checks, output from the caching allocator, launch on the current
// stream. The kernel (hadamard.cu) takes d = 64 / 128 / 256 (V4's indexer: 128).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>

#include "cuda/launchers.h"
#include "hadamard_checks.h"

namespace {

at::Tensor hadamard_fp4_cuda(const at::Tensor& x, const std::optional<at::Tensor>& cs, int64_t rope_dim) {
  const char* op = "dsv4::hadamard_fp4";
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  const dsv4_hadamard::Shape sh = dsv4_hadamard::check(x, cs, rope_dim);
  TORCH_CHECK(dsv4_hadamard_fp4_kernel_ok(int(sh.d)), op, ": the CUDA kernel takes d = 64, 128 or 256, got ", sh.d);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor cc = cs.has_value() ? cs->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const cudaError_t err = dsv4_hadamard_fp4_launch(
      xc.data_ptr(), x.scalar_type() == at::kFloat, cc.defined() ? cc.data_ptr<float>() : nullptr, out.data_ptr(),
      sh.rows * sh.heads, int(sh.heads), int(sh.d), int(rope_dim), dsv4_hadamard::rotate_scale(sh.d),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("hadamard_fp4", &hadamard_fp4_cuda); }

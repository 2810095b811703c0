// CUDA registration of dsv4::rms_norm_rope: checks, output from the caching allocator, launch on the current
// stream. The kernel lives in norm_rope.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>

#include "norm_rope_checks.h"

extern "C" cudaError_t dsv4_rms_norm_rope_launch(const void* x, int x_fp32, const float* w, const float* cs, void* out,
                                                 int64_t vectors, int heads, int d, int rope_dim, float eps,
                                                 int fp8_nope, cudaStream_t stream);

namespace {

at::Tensor rms_norm_rope_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& cs,
                              double eps, int64_t rope_dim, bool fp8_nope) {
  const char* op = "dsv4::rms_norm_rope";
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  const dsv4_norm_rope::Shape sh = dsv4_norm_rope::check(x, weight, cs, eps, rope_dim, fp8_nope);
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(sh.d <= 4096, op, ": the CUDA kernel takes d <= 4096, got ", sh.d);
  // 16-byte loads: a view at an odd offset is copied (the allocator's blocks are aligned)
  auto aligned = [](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
  };
  const at::Tensor xc = aligned(x), cc = aligned(cs);
  const at::Tensor wc = weight.has_value() ? aligned(*weight) : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const cudaError_t err = dsv4_rms_norm_rope_launch(
      xc.data_ptr(), x.scalar_type() == at::kFloat, wc.defined() ? wc.data_ptr<float>() : nullptr,
      cc.data_ptr<float>(), out.data_ptr(), sh.rows * sh.heads, int(sh.heads), int(sh.d), int(rope_dim), float(eps),
      fp8_nope, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("rms_norm_rope", &rms_norm_rope_cuda); }

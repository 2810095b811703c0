// CUDA registration of dsv4::rms_norm_rope: checks, output from the caching allocator, launch on the current
// stream. The kernel lives in norm_rope.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>

#include "cuda/launchers.h"
#include "norm_rope_checks.h"

namespace {

// 16-byte loads: a view at an odd offset is copied (the allocator's blocks are aligned)
at::Tensor aligned(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

at::Tensor rms_norm_rope_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& cs,
                              double eps, int64_t rope_dim, bool fp8_nope) {
  const char* op = "dsv4::rms_norm_rope";
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  const dsv4_norm_rope::Shape sh = dsv4_norm_rope::check(x, weight, cs, eps, rope_dim, fp8_nope);
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(sh.d <= dsv4_limits::kNormRopeCudaMaxDim, op, ": the CUDA kernel takes d <= ",
              dsv4_limits::kNormRopeCudaMaxDim, ", got ", sh.d);
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

void rms_norm_rope_store_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& cs,
                              double eps, int64_t rope_dim, bool fp8_nope, const at::Tensor& positions, int64_t ratio,
                              int64_t offset, int64_t slots, const at::Tensor& cache, int64_t kv_batch) {
  const char* op = "dsv4::rms_norm_rope_store";
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  const dsv4_norm_rope::Shape sh = dsv4_norm_rope::check_store(x, weight, cs, eps, rope_dim, fp8_nope, positions,
                                                               ratio, offset, slots, cache, kv_batch);
  TORCH_CHECK(sh.d <= dsv4_limits::kNormRopeCudaMaxDim, op, ": the CUDA kernel takes d <= ",
              dsv4_limits::kNormRopeCudaMaxDim, ", got ", sh.d);
  TORCH_CHECK(ratio < (int64_t(1) << 31) && offset + slots < (int64_t(1) << 31), op,
              ": ratio / offset / slots past the kernel's int range");
  // d % 4 == 0: every 4-element store is aligned to its size (8 bytes bf16, 16 fp32)
  TORCH_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0, op,
              ": the CUDA kernel needs a 16-byte aligned cache (a view at an offset: pass the whole buffer)");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = aligned(x), cc = aligned(cs), pc = positions.contiguous();
  const at::Tensor wc = weight.has_value() ? aligned(*weight) : at::Tensor();
  const cudaError_t err = dsv4_rms_norm_rope_store_launch(
      xc.data_ptr(), x.scalar_type() == at::kFloat, wc.defined() ? wc.data_ptr<float>() : nullptr,
      cc.data_ptr<float>(), sh.rows, int(sh.d), int(rope_dim), float(eps), fp8_nope, pc.data_ptr(),
      pc.scalar_type() == at::kInt, int(ratio), int(offset), int(slots), cache.data_ptr(), cache.size(1) * sh.d,
      kv_batch, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("rms_norm_rope", &rms_norm_rope_cuda);
  m.impl("rms_norm_rope_store", &rms_norm_rope_store_cuda);
}

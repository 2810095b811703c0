// CUDA registration of dsv4::hc_sinkhorn: checks, output from the caching allocator, launch on the current
// stream. The kernel lives in mhc.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "mhc_checks.h"

extern "C" cudaError_t dsv4_hc_sinkhorn_launch(const float* x, float* y, int64_t n, int hc, int iters, float eps,
                                               cudaStream_t stream);

namespace {

at::Tensor hc_sinkhorn_cuda(const at::Tensor& logits, int64_t iters, double eps) {
  TORCH_CHECK(logits.is_cuda(), "dsv4::hc_sinkhorn: logits must be a CUDA tensor, got ", logits.device());
  const int64_t hc = dsv4_mhc::check_hc_sinkhorn(logits, iters, eps);
  TORCH_CHECK(iters < (int64_t(1) << 31), "dsv4::hc_sinkhorn: iters must fit in int32");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty_like(x);
  const cudaError_t err = dsv4_hc_sinkhorn_launch(x.data_ptr<float>(), out.data_ptr<float>(),
                                                  x.numel() / (hc * hc), int(hc), int(iters), float(eps),
                                                  c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "dsv4::hc_sinkhorn: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("hc_sinkhorn", &hc_sinkhorn_cuda); }

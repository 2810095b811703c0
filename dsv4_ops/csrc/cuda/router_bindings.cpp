// CUDA registration of dsv4::router_topk: checks, outputs from the caching allocator, launch on the current
// stream. The kernel lives in router.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/launchers.h"
#include "router_checks.h"

namespace {

std::tuple<at::Tensor, at::Tensor> router_topk_cuda(const at::Tensor& scores, const c10::optional<at::Tensor>& bias,
                                                    int64_t k, bool renormalize, double scale,
                                                    bool sqrt_softplus) {
  TORCH_CHECK(scores.is_cuda(), "dsv4::router_topk: scores must be a CUDA tensor, got ", scores.device());
  dsv4_router::check(scores, bias, k);
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor s = scores.contiguous();
  at::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  const int64_t N = s.size(0);
  at::Tensor weights = at::empty({N, k}, s.options());
  at::Tensor indices = at::empty({N, k}, s.options().dtype(at::kLong));
  const cudaError_t err = dsv4_router_topk_launch(
      s.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr, N, int(s.size(1)), int(k), renormalize ? 1 : 0,
      float(scale), sqrt_softplus ? 1 : 0, weights.data_ptr<float>(), indices.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "dsv4::router_topk: kernel launch failed: ", cudaGetErrorString(err));
  return {weights, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("router_topk", &router_topk_cuda); }

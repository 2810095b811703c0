// CUDA registration of dsv4::prefetch_l2: checks, one launch on the current stream (nothing allocated; the weights'
// addresses and sizes travel as a kernel parameter).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <vector>

#include "cuda/launchers.h"
#include "prefetch_checks.h"

namespace {

void prefetch_l2_cuda(const at::Tensor& after, at::TensorList weights, const at::Tensor& marker) {
  const char* op = "dsv4::prefetch_l2";
  TORCH_CHECK(marker.is_cuda(), op, ": marker must be a CUDA tensor, got ", marker.device());
  const dsv4_prefetch::Plan plan = dsv4_prefetch::check(after, weights, marker);
  const c10::cuda::CUDAGuard guard(marker.device());
  std::vector<const void*> ptrs;
  for (const at::Tensor& w : weights) ptrs.push_back(w.data_ptr());
  const cudaError_t err = dsv4_prefetch_l2_launch(ptrs.data(), plan.bytes.data(), int(ptrs.size()),
                                                  marker.data_ptr<int64_t>(), plan.total,
                                                  c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("prefetch_l2", &prefetch_l2_cuda); }

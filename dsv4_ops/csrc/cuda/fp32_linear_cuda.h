// The CUDA side of dsv4::fp32_linear for the other ops' bindings (nvfp4_gemm_bindings.cpp's
// nvfp4_fp32_linear_multi): fp32_linear_bindings.cpp.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace dsv4_fp32_linear {

// dsv4::fp32_linear's CUDA kernel. beside: the kernel enqueued just before this call lets its successor launch as
// soon as its own inputs are final and reads nothing this call writes (nvfp4_fp32_linear_multi's gemv, launched
// with trigger_now): the first GEMV launch then runs beside it (fp32_linear.cu, kBeside) rather than after it.
std::vector<at::Tensor> cuda_impl(const at::Tensor& x, at::TensorList w, bool beside);

}  // namespace dsv4_fp32_linear

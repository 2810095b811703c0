// CUDA registration of dsv4::fp32_linear: the GEMV kernel (fp32_linear.cu) for up to 8 token rows of bf16 / fp32
// x and bf16 / fp32 weights with 16-byte aligned rows (one launch per weight dtype in the list), but for one token
// row only where every operand is bf16 and the weights are large (the head). Beyond that
// (prefill, large batches): a bf16 weight with bf16 x is one cuBLAS bf16 GEMM with fp32 output (aten::mm.dtype:
// exact products, fp32 sums, as the widened matmul computes them), so the bf16 head is never widened (1 GB of
// fp32 per call on V4-Flash); other pairs are fp32 matmuls of the widened operands.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "cuda/device_info.h"

#include "cuda/launchers.h"
#include "cuda/mm_dtype.h"
#include "cuda/fp32_linear_cuda.h"
#include "fp32_linear_checks.h"

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

using dsv4_cuda::sm_count;

std::vector<at::Tensor> matmul_fallback(const at::Tensor& x, const at::Tensor& x2, at::TensorList w,
                                        const std::vector<int64_t>& ns) {
  const auto* mm = dsv4_cuda::mm_dtype_op();
  at::Tensor xf;  // x widened once, for the weights that need it
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < w.size(); ++i) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = ns[i];
    if (mm != nullptr && x2.scalar_type() == at::kBFloat16 && w[i].scalar_type() == at::kBFloat16) {
      out.push_back(mm->call(x2, w[i].t(), at::kFloat).view(shape));
      continue;
    }
    if (!xf.defined()) xf = x2.to(at::kFloat);
    out.push_back(at::matmul(xf, w[i].to(at::kFloat).t()).view(shape));
  }
  return out;
}

}  // namespace

namespace dsv4_fp32_linear {

std::vector<at::Tensor> cuda_impl(const at::Tensor& x, at::TensorList w, bool beside) {
  const char* op = "dsv4::fp32_linear";
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  const std::vector<int64_t> ns = check(x, w);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t K = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  bool gemv = M >= 1 && M <= 8 && K % 8 == 0 && K < (int64_t(1) << 30) && x2.scalar_type() != at::kHalf &&
              aligned16(x2);
  for (size_t i = 0; i < w.size() && gemv; ++i)
    gemv = w[i].is_contiguous() && aligned16(w[i]) && ns[i] < (int64_t(1) << 30);
  // A large bf16 x bf16 product (the head) at M >= 2: the GEMV's fp32 FMAs on CUDA cores cost more than the
  // tensor cores' GEMM of the same exact products (bench/bench_fp32_linear.py, head rows).
  bool all_bf16 = x2.scalar_type() == at::kBFloat16;
  int64_t elems = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    all_bf16 = all_bf16 && w[i].scalar_type() == at::kBFloat16;
    elems += ns[i] * K;
  }
  if (M >= 2 && all_bf16 && elems >= (int64_t(1) << 26)) gemv = false;
  if (!gemv) return matmul_fallback(x, x2, w, ns);  // stream-ordered: nothing runs beside a cuBLAS call

  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < w.size(); ++i) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = ns[i];
    outs.push_back(at::empty(shape, x.options().dtype(at::kFloat)));
  }
  // One launch per weight dtype present (the kernel is compiled per dtype): bf16 weights, then fp32 ones.
  const int sms = sm_count();
  for (const at::ScalarType wt : {at::kBFloat16, at::kFloat}) {
    const void* wp[dsv4_fp32_linear::kMaxWeights];
    float* yp[dsv4_fp32_linear::kMaxWeights];
    int n[dsv4_fp32_linear::kMaxWeights];
    int nseg = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      if (w[i].scalar_type() != wt) continue;
      wp[nseg] = w[i].data_ptr();
      yp[nseg] = outs[i].data_ptr<float>();
      n[nseg++] = int(ns[i]);
    }
    if (nseg == 0) continue;
    const cudaError_t err = dsv4_fp32_linear_launch(x2.data_ptr(), x2.scalar_type() == at::kFloat, int(M), int(K),
                                                    wp, wt == at::kFloat, yp, n, nseg, sms, int(beside),
                                                    c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
    beside = false;  // a second launch (the other weight dtype) follows the first one as usual
  }
  return outs;
}

}  // namespace dsv4_fp32_linear

namespace {

std::vector<at::Tensor> fp32_linear_cuda(const at::Tensor& x, at::TensorList w) {
  return dsv4_fp32_linear::cuda_impl(x, w, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("fp32_linear", &fp32_linear_cuda); }

// CUDA registration of dsv4::hc_sinkhorn and dsv4::hc_pre: checks, outputs and workspace from the caching
// allocator, launches on the current stream. The kernels live in mhc.cu; hc_pre runs as ATen ops outside its
// kernels' shapes (hc > 4, more than 16 tokens, d % 8 != 0, d > 12288, unaligned x / fn / norm weight).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "mhc_checks.h"

extern "C" cudaError_t dsv4_hc_sinkhorn_launch(const float* x, float* y, int64_t n, int hc, int iters, float eps,
                                               cudaStream_t stream);
extern "C" int dsv4_hc_pre_splits(int hc, int d);
extern "C" cudaError_t dsv4_hc_pre_launch(const void* x, int x_kind, const void* fn, int fn_bf16, const float* scale,
                                          const float* base, const float* norm_w, int T, int hc, int d, int iters,
                                          float hc_eps, float norm_eps, float out_eps, float* ws, void* y,
                                          float* post, float* comb, cudaStream_t stream);

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_cuda(const at::Tensor& x, const at::Tensor& fn,
                                                            const at::Tensor& scale, const at::Tensor& base,
                                                            const std::optional<at::Tensor>& norm_weight,
                                                            int64_t iters, double hc_eps, double norm_eps,
                                                            double out_eps) {
  const char* op = "dsv4::hc_pre";
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  const dsv4_mhc::HcPreShape sh =
      dsv4_mhc::check_hc_pre(x, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor fc = fn.contiguous();
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = norm_weight ? norm_weight->contiguous() : at::Tensor();
  auto aligned = [](const at::Tensor& t) { return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const bool kernel = sh.hc <= 4 && sh.tokens <= 16 && sh.d % 8 == 0 && sh.d <= 12288 && aligned(fc) &&
                      aligned(xc) && aligned(wc);  // 16-byte loads
  if (!kernel) {
    auto sinkhorn = [&](const at::Tensor& logits) { return hc_sinkhorn_cuda(logits, iters, hc_eps); };
    return dsv4_mhc::hc_pre_aten(x, fc, scale, base, norm_weight, hc_eps, norm_eps, out_eps, sh, sinkhorn);
  }
  const at::Tensor sc = scale.contiguous(), bc = base.contiguous();
  at::Tensor y, post, comb;
  std::tie(y, post, comb) = dsv4_mhc::hc_pre_outputs(x, sh);
  const int nsplit = dsv4_hc_pre_splits(int(sh.hc), int(sh.d));
  at::Tensor ws = at::empty({nsplit, std::max<int64_t>(sh.tokens, 1), sh.mix + 1}, x.options().dtype(at::kFloat));
  const int x_kind = x.scalar_type() == at::kBFloat16 ? 0 : x.scalar_type() == at::kHalf ? 1 : 2;
  const cudaError_t err = dsv4_hc_pre_launch(
      xc.data_ptr(), x_kind, fc.data_ptr(), fc.scalar_type() == at::kBFloat16, sc.data_ptr<float>(),
      bc.data_ptr<float>(), wc.defined() ? wc.data_ptr<float>() : nullptr, int(sh.tokens), int(sh.hc), int(sh.d),
      int(iters), float(hc_eps), float(norm_eps), float(out_eps), ws.data_ptr<float>(), y.data_ptr(),
      post.data_ptr<float>(), comb.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return {y, post, comb};
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("hc_sinkhorn", &hc_sinkhorn_cuda);
  m.impl("hc_pre", &hc_pre_cuda);
}

// CUDA registration of dsv4::hc_sinkhorn, dsv4::hc_pre and dsv4::hc_post_pre: checks, outputs and workspace from
// the caching allocator, launches on the current stream. The kernels live in mhc.cu; hc_pre / hc_post_pre run as
// ATen ops outside the kernels' shapes (hc > 4, more than 16 tokens, d % 8 != 0, d > 12288, unaligned x / fn /
// norm weight).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "cuda/launchers.h"
#include "mhc_checks.h"

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

// hc_post_pre's extra inputs (the previous sublayer's output, the streams it updates, its post / comb; with ids the
// output as the MoE's uncombined rows).
struct PostIn {
  at::Tensor out, res, post, comb;
  std::optional<at::Tensor> ids;
  int64_t experts;
};

// hc_pre of x, or with pin hc_post_pre (x: pin->res, for the shape checks): (streams, y, post, comb), the streams
// being x itself or the new ones.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_pre_run(
    const char* op, const at::Tensor& x, const PostIn* pin, const at::Tensor& fn, const at::Tensor& scale,
    const at::Tensor& base, const std::optional<at::Tensor>& norm_weight, int64_t iters, double hc_eps,
    double norm_eps, double out_eps) {
  TORCH_CHECK(x.is_cuda(), op, ": ", pin ? "res" : "x", " must be a CUDA tensor, got ", x.device());
  const dsv4_mhc::HcPreShape sh =
      dsv4_mhc::check_hc_pre(x, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps, op);
  const dsv4_mhc::HcPostRows rows =
      pin ? dsv4_mhc::check_hc_post(pin->out, pin->res, pin->post, pin->comb, pin->ids, pin->experts)
          : dsv4_mhc::HcPostRows();
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor fc = fn.contiguous();
  const at::Tensor wc = norm_weight ? norm_weight->contiguous() : at::Tensor();
  const at::Tensor xc = pin ? at::Tensor() : x.contiguous();
  const at::Tensor oc = pin ? pin->out.contiguous() : at::Tensor(), rc = pin ? pin->res.contiguous() : at::Tensor();
  const at::Tensor ic = pin && pin->ids ? pin->ids->contiguous() : at::Tensor();
  auto aligned = [](const at::Tensor& t) {
    return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const bool kernel = sh.hc <= 4 && sh.tokens <= 16 && sh.d % 8 == 0 && sh.d <= 12288 && aligned(fc) &&
                      aligned(xc) && aligned(wc);  // 16-byte loads (out / res are read per element)
  if (!kernel) {
    at::Tensor o = oc;
    if (ic.defined()) {  // the rows' sum, shaped as res without its hc dim
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 2);
      shape.push_back(sh.d);
      o = dsv4_mhc::hc_post_rows_aten(oc, ic, rows).view(shape);
    }
    const at::Tensor streams = pin ? dsv4_mhc::hc_post_aten(o, rc, pin->post, pin->comb) : x;
    auto sinkhorn = [&](const at::Tensor& logits) { return hc_sinkhorn_cuda(logits, iters, hc_eps); };
    at::Tensor y, post, comb;
    std::tie(y, post, comb) =
        dsv4_mhc::hc_pre_aten(streams, fc, scale, base, norm_weight, hc_eps, norm_eps, out_eps, sh, sinkhorn);
    return {streams, y, post, comb};
  }
  const at::Tensor sc = scale.contiguous(), bc = base.contiguous();
  const at::Tensor pc = pin ? pin->post.contiguous() : at::Tensor(), cc = pin ? pin->comb.contiguous() : at::Tensor();
  at::Tensor streams = pin ? at::empty(x.sizes(), x.options()) : xc;  // hc_post_pre: written by the first kernel
  at::Tensor y, post, comb;
  std::tie(y, post, comb) = dsv4_mhc::hc_pre_outputs(x, sh);
  const int nsplit = dsv4_hc_pre_splits(int(sh.hc), int(sh.d));
  at::Tensor ws = at::empty({nsplit, std::max<int64_t>(sh.tokens, 1), sh.mix + 1}, x.options().dtype(at::kFloat));
  const int x_kind = x.scalar_type() == at::kBFloat16 ? 0 : x.scalar_type() == at::kHalf ? 1 : 2;
  const cudaError_t err = dsv4_hc_pre_launch(
      streams.data_ptr(), x_kind, fc.data_ptr(), fc.scalar_type() == at::kBFloat16, sc.data_ptr<float>(),
      bc.data_ptr<float>(), wc.defined() ? wc.data_ptr<float>() : nullptr, int(sh.tokens), int(sh.hc), int(sh.d),
      int(iters), float(hc_eps), float(norm_eps), float(out_eps), ws.data_ptr<float>(), y.data_ptr(),
      post.data_ptr<float>(), comb.data_ptr<float>(), pin ? oc.data_ptr() : nullptr, pin ? rc.data_ptr() : nullptr,
      pin ? pc.data_ptr<float>() : nullptr, pin ? cc.data_ptr<float>() : nullptr,
      ic.defined() ? ic.data_ptr() : nullptr, ic.defined() && ic.scalar_type() == at::kLong, int(rows.k),
      int(rows.experts), rows.shared, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return {streams, y, post, comb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre_cuda(const at::Tensor& x, const at::Tensor& fn,
                                                            const at::Tensor& scale, const at::Tensor& base,
                                                            const std::optional<at::Tensor>& norm_weight,
                                                            int64_t iters, double hc_eps, double norm_eps,
                                                            double out_eps) {
  auto r = hc_pre_run("dsv4::hc_pre", x, nullptr, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps);
  return {std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre_cuda(
    const at::Tensor& out, const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb,
    const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base, const std::optional<at::Tensor>& norm_weight,
    int64_t iters, double hc_eps, double norm_eps, double out_eps, const std::optional<at::Tensor>& out_ids,
    int64_t out_experts) {
  const PostIn pin{out, res, post, comb, out_ids, out_experts};
  return hc_pre_run("dsv4::hc_post_pre", res, &pin, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("hc_sinkhorn", &hc_sinkhorn_cuda);
  m.impl("hc_pre", &hc_pre_cuda);
  m.impl("hc_post_pre", &hc_post_pre_cuda);
}

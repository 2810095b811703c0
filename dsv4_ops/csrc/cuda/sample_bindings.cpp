// CUDA registration of dsv4::sample: checks, workspaces from the caching allocator (graph-pool aware),
// launch on the current stream. The kernels live in sample.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "cuda/launchers.h"
#include "sample_checks.h"

namespace {

at::Tensor sample_cuda(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& offset) {
  TORCH_CHECK(logits.is_cuda(), "dsv4::sample: logits must be a CUDA tensor");
  dsv4_sample::check(logits, temperature, top_k, top_p, seed, offset);
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V < (int64_t(1) << 31), "dsv4::sample: V must be in [1, 2^31), got ", V);
  TORCH_CHECK(B < 65536, "dsv4::sample: at most 65535 rows, got ", B);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor lc = logits.contiguous(), tc = temperature.contiguous(), kc = top_k.contiguous(),
                   pc = top_p.contiguous(), sc = seed.contiguous(), oc = offset.contiguous();
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  if (B == 0) return out;
  const int splits = dsv4_sample_num_splits(B, V);
  at::Tensor thresh = at::empty({B}, logits.options().dtype(at::kInt));
  at::Tensor part_v = at::empty({B, splits}, logits.options());
  at::Tensor part_i = at::empty({B, splits}, logits.options().dtype(at::kInt));
  const cudaError_t err = dsv4_sample_launch(
      lc.data_ptr<float>(), tc.data_ptr<float>(), kc.data_ptr<int64_t>(), pc.data_ptr<float>(),
      sc.data_ptr<int64_t>(), oc.data_ptr<int64_t>(), B, V, splits,
      reinterpret_cast<uint32_t*>(thresh.data_ptr<int32_t>()), part_v.data_ptr<float>(), part_i.data_ptr<int32_t>(),
      out.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "dsv4::sample: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("sample", &sample_cuda); }

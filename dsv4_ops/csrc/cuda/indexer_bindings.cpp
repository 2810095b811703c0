// CUDA registration of dsv4::indexer_score_topk, dsv4::indexer_prefill_scores and dsv4::indexer_topk: input checks, outputs and the
// score scratch from the caching allocator (graph-pool aware), launch on the current stream. The kernels live in
// indexer.cu and indexer_prefill.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "cuda/launchers.h"
#include "indexer_checks.h"

namespace {

// The kernels use vector loads: a misaligned (or strided) input is copied into a fresh allocation.
at::Tensor aligned(const at::Tensor& t, int64_t bytes) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % bytes != 0) c = c.clone(at::MemoryFormat::Contiguous);
  return c;
}

at::Tensor indexer_score_topk_cuda(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_codes,
                                   const at::Tensor& k_scales, const at::Tensor& n_valid, int64_t topk,
                                   double weights_scale, std::optional<at::ScalarType> weights_dtype,
                                   int64_t kv_batch) {
  const char* op = "dsv4::indexer_score_topk: ";
  TORCH_CHECK(q.is_cuda(), op, "q must be a CUDA tensor");
  dsv4_indexer::check(q, weights, k_codes, k_scales, n_valid, topk, weights_dtype, kv_batch);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), N = k_codes.size(1);
  TORCH_CHECK(D == dsv4_limits::kIndexerCudaHeadDim, op, "the CUDA kernel supports D = ",
              dsv4_limits::kIndexerCudaHeadDim, " (DeepSeek-V4), got D = ", D);
  TORCH_CHECK(H <= dsv4_limits::kIndexerCudaMaxHeads, op, "the CUDA kernel supports at most ",
              dsv4_limits::kIndexerCudaMaxHeads, " heads, got H = ", H);
  TORCH_CHECK(B < 65536, op, "at most 65535 rows, got B = ", B);
  TORCH_CHECK(topk <= dsv4_indexer_max_topk(), op, "the CUDA kernel supports topk <= ", dsv4_indexer_max_topk(),
              ", got ", topk);

  const c10::cuda::CUDAGuard guard(q.device());
  const bool q32 = q.scalar_type() == at::kFloat;
  const at::Tensor qc = aligned(q, 8), wc = aligned(weights, 4), cc = aligned(k_codes, 16),
                   sc = aligned(k_scales, 4), nc = n_valid.contiguous();
  const int weights_round = !weights_dtype ? 0 : *weights_dtype == at::kBFloat16 ? 1 : 2;
  at::Tensor out = at::empty({B, topk}, q.options().dtype(at::kInt));
  if (B == 0 || topk == 0) return out;
  at::Tensor scratch = at::empty({B, N}, q.options().dtype(at::kInt));
  const cudaError_t err = dsv4_indexer_score_topk_launch(
      qc.data_ptr(), q32 ? 1 : 0, wc.data_ptr<float>(), weights_round, static_cast<float>(weights_scale),
      cc.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), nc.data_ptr(), n_valid.scalar_type() == at::kLong ? 1 : 0,
      static_cast<int>(B), static_cast<int>(H), static_cast<int>(N), static_cast<int>(kv_batch), static_cast<int>(topk),
      reinterpret_cast<uint32_t*>(scratch.data_ptr<int32_t>()), out.data_ptr<int32_t>(),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, "kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor indexer_prefill_scores_cuda(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& keys,
                                       const at::Tensor& n_visible) {
  const char* op = "dsv4::indexer_prefill_scores: ";
  TORCH_CHECK(q.is_cuda(), op, "q must be a CUDA tensor");
  dsv4_indexer::check_prefill(q, weights, keys, n_visible);
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3), T = keys.size(1);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, op, "the CUDA kernel takes bfloat16 q / keys, got ", q.scalar_type());
  TORCH_CHECK(D == dsv4_indexer_prefill_head_dim(), op, "the CUDA kernel supports D = ",
              dsv4_indexer_prefill_head_dim(), " (DeepSeek-V4), got D = ", D);
  TORCH_CHECK(B < 65536 && (S + 63) / 64 < 65536, op, "at most 65535 rows and 65535 x 64 queries per row, got B = ",
              B, ", S = ", S);
  TORCH_CHECK(S * H * D < (int64_t(1) << 62) && S * T < (int64_t(1) << 62), op, "sizes too large");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = aligned(q, 16), wc = weights.contiguous(), kc = aligned(keys, 16),
                   nc = n_visible.contiguous();
  at::Tensor out = at::empty({B, S, T}, q.options().dtype(at::kFloat));
  const cudaError_t err = dsv4_indexer_prefill_scores_launch(
      qc.data_ptr(), wc.data_ptr<float>(), kc.data_ptr(), nc.data_ptr<int64_t>(), out.data_ptr<float>(),
      static_cast<int>(B), static_cast<int>(S), static_cast<int>(H), static_cast<int>(T),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, "kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor indexer_topk_cuda(const at::Tensor& scores, int64_t topk) {
  const char* op = "dsv4::indexer_topk: ";
  TORCH_CHECK(scores.is_cuda(), op, "scores must be a CUDA tensor");
  dsv4_indexer::check_topk(scores, topk);
  TORCH_CHECK(topk <= dsv4_indexer_max_topk(), op, "the CUDA kernel supports topk <= ", dsv4_indexer_max_topk(),
              ", got ", topk);
  const int64_t N = scores.size(-1), R = scores.numel() / N;
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor sc = scores.contiguous();
  std::vector<int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = topk;
  at::Tensor out = at::empty(shape, scores.options().dtype(at::kLong));
  const cudaError_t err = dsv4_indexer_topk_launch(sc.data_ptr<float>(), R, static_cast<int>(N),
                                                   static_cast<int>(topk), out.data_ptr<int64_t>(),
                                                   c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, "kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("indexer_score_topk", &indexer_score_topk_cuda);
  m.impl("indexer_prefill_scores", &indexer_prefill_scores_cuda);
  m.impl("indexer_topk", &indexer_topk_cuda);
}

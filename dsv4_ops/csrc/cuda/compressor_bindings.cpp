// CUDA registration of dsv4::compressor_decode: checks, launch on the current stream (state and pooled are
// written in place; nothing is allocated). The kernel lives in compressor.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "compressor_checks.h"
#include "cuda/launchers.h"

namespace {

void compressor_decode_cuda(const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape,
                            const at::Tensor& positions, const at::Tensor& kv_state, const at::Tensor& score_state,
                            const at::Tensor& pooled, int64_t kv_batch) {
  const char* op = "dsv4::compressor_decode";
  TORCH_CHECK(kv.is_cuda(), op, ": kv must be a CUDA tensor, got ", kv.device());
  const dsv4_comp::Shape sh = dsv4_comp::check(kv, score, ape, positions, kv_state, score_state, pooled, kv_batch);
  TORCH_CHECK(sh.S <= 65535 && sh.B < (int64_t(1) << 31) && sh.R * sh.C < (int64_t(1) << 31), op,
              ": shapes past the kernel's int ranges: sequences ", sh.S, ", rows ", sh.B, ", state rows x C ",
              sh.R * sh.C);
  const c10::cuda::CUDAGuard guard(kv.device());
  const at::Tensor kc = kv.contiguous(), sc = score.contiguous(), ac = ape.contiguous(), pc = positions.contiguous();
  const cudaError_t err = dsv4_compressor_decode_launch(
      kc.data_ptr<float>(), sc.data_ptr<float>(), ac.data_ptr<float>(), pc.data_ptr(),
      pc.scalar_type() == at::kInt, kv_state.data_ptr<float>(), score_state.data_ptr<float>(),
      pooled.data_ptr(),
      pooled.scalar_type() == at::kFloat ? 0 : pooled.scalar_type() == at::kBFloat16 ? 1 : 2, int(sh.B), int(sh.C),
      int(sh.m), int(sh.R), int(sh.hd), sh.overlap, sh.by_position, int(kv_batch),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("compressor_decode", &compressor_decode_cuda); }

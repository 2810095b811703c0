// CUDA registration of dsv4::indexer_store_keys: checks, launch on the current stream (the caches are written in
// place; nothing is allocated). The kernel (key_store.cu) takes D = 64 / 128 / 256 / 512 (V4's indexer: 128).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "cuda/launchers.h"
#include "key_store_checks.h"

namespace {

void indexer_store_keys_cuda(const at::Tensor& keys, const at::Tensor& positions, int64_t ratio,
                             const at::Tensor& kv_cache, const at::Tensor& k_codes, const at::Tensor& k_scales,
                             int64_t kv_batch) {
  const char* op = "dsv4::indexer_store_keys";
  TORCH_CHECK(keys.is_cuda(), op, ": keys must be a CUDA tensor, got ", keys.device());
  const dsv4_key_store::Shape sh =
      dsv4_key_store::check(keys, positions, ratio, kv_cache, k_codes, k_scales, kv_batch);
  TORCH_CHECK(dsv4_store_keys_kernel_ok(int(sh.D)), op, ": the CUDA kernel takes D = 64, 128, 256 or 512, got ",
              sh.D);
  TORCH_CHECK(sh.B < (int64_t(1) << 31) && ratio < (int64_t(1) << 31) && sh.n < (int64_t(1) << 31), op,
              ": sizes past the kernel's int range");
  const c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor kc = keys.contiguous(), pc = positions.contiguous();
  const cudaError_t err = dsv4_store_keys_launch(
      kc.data_ptr(), keys.scalar_type() == at::kFloat, pc.data_ptr(), pc.scalar_type() == at::kInt, int(sh.B),
      int(sh.D), int(ratio), int(sh.n), int(kv_batch), kv_cache.data_ptr(), k_codes.data_ptr<uint8_t>(),
      k_scales.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("indexer_store_keys", &indexer_store_keys_cuda); }

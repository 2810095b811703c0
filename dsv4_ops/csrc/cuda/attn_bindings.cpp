// CUDA registration of dsv4::sparse_attn_decode: the split-K decode kernels (attn.cu) for bf16 / fp32 q and kv
// with D <= 512, D % 8 == 0 and contiguous, 16-byte aligned cache rows; the ATen form (attn_checks.h) otherwise.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "cuda/device_info.h"
#include "cuda/launchers.h"

#include "attn_checks.h"
#include "overrides.h"

namespace {

using dsv4_cuda::sm_count;

at::Tensor sparse_attn_decode_cuda(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx,
                                   const at::Tensor& sink, double scale, const std::optional<at::Tensor>& out_rope,
                                   int64_t rope_dim, const std::optional<at::Tensor>& idx2, int64_t idx2_offset,
                                   int64_t kv_batch) {
  const char* op = "dsv4::sparse_attn_decode";
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got ", q.device());
  dsv4_attn::check(q, kv, idx, sink, kv_batch);
  dsv4_attn::check_out_rope(q, out_rope, rope_dim);
  dsv4_attn::check_idx2(q, idx2, idx2_offset);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), N = kv.size(1), J1 = idx.size(1);
  const int64_t J = J1 + (idx2.has_value() ? idx2->size(1) : 0);
  const bool kernel = (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) && D <= 512 &&
                      D % 8 == 0 && kv.stride(2) == 1 && kv.stride(1) == D && B < 65536 && H < 65536 &&
                      N < (int64_t(1) << 31) && J < (int64_t(1) << 31) &&
                      reinterpret_cast<uintptr_t>(kv.data_ptr()) % 16 == 0 &&
                      (kv.stride(0) * kv.element_size()) % 16 == 0;  // 16-byte row copies
  if (!kernel) {
    const at::Tensor rows = dsv4_attn::joined_rows(idx, idx2, idx2_offset);
    const at::Tensor out = dsv4_attn::attend_aten(q, kv, rows, sink, scale, kv_batch);
    return out_rope.has_value() ? dsv4_attn::inverse_rope_aten(out, out_rope->contiguous(), rope_dim) : out;
  }
  const at::Tensor rc = out_rope.has_value() ? out_rope->contiguous() : at::Tensor();
  at::Tensor qc = q.contiguous();
  if (reinterpret_cast<uintptr_t>(qc.data_ptr()) % 16 != 0) qc = qc.clone();  // 16-byte loads of q
  const at::Tensor sc = sink.contiguous();
  // int32 rows for the kernel; int64 values outside [0, N) stay outside after the narrowing
  auto narrow = [N](const at::Tensor& t) {
    return t.scalar_type() == at::kInt ? t.contiguous() : t.clamp(-1, N).to(at::kInt).contiguous();
  };
  const at::Tensor ic = narrow(idx), i2 = idx2.has_value() ? narrow(*idx2) : at::Tensor();
  // The tensor-core partial kernel where it applies (bf16, D % 64 == 0: faster than the CUDA-core one,
  // bench_attn_decode.py, bench/RESULTS.md); the attn_kernel override 1 keeps the CUDA-core kernel. With 64+ heads
  // and 2048+ listed keys in all (B x J) the warpgroup-MMA kernel (use_mma 3, attn_wgmma.cu; D = 512): H100, 64
  // heads, per call vs the 16-head mma.sync CTA: 640 keys B = 4 15.0 vs 17.5 us, B = 64 57.6 vs 157.7; 128 keys
  // B = 16 14.2 vs 17.2, B = 8 13.6 vs 11.9 (loses below); prefill rows 1.69x the 64-head mma.sync CTA. Where rows
  // alone fill the SMs and wgmma does not apply, the 64-head CTA (use_mma 2), else the 16-head one (use_mma 1). The
  // override's 2 / 3 force the 64 / 16-head mma.sync CTA, 4 the warpgroup-MMA kernel (D = 512, else the auto choice).
  const int forced = dsv4_overrides::get().attn_kernel;
  const int sms = sm_count();
  const int mma_ok = forced != 1 && q.scalar_type() == at::kBFloat16 && dsv4_attn_decode_mma_ok(int(D));
  const bool wide_rows = forced == 0 && B >= sms;  // the auto choice's prefill form
  // (the warpgroup kernel's CTA always computes 64 heads: measured with 64, kept from smaller models)
  const bool wgmma_auto = forced == 0 && H >= 64 && (wide_rows || B * J >= 2048);
  const bool wgmma = (forced == 4 || wgmma_auto) && dsv4_attn_partial_wgmma_ok(int(D));
  const int use_mma = !mma_ok ? 0 : wgmma ? 3 : (forced == 2 || wide_rows) ? 2 : 1;
  int rows_per_split = 0;
  const int nsplit = dsv4_attn_decode_splits(int(B), int(H), int(J), sms, use_mma, &rows_per_split);
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  at::Tensor ws_o = at::empty({B, nsplit, H, D}, f32);
  at::Tensor ws_ml = at::empty({B, nsplit, H, 2}, f32);
  at::Tensor out = at::empty({B, H, D}, q.options());
  const cudaError_t err = dsv4_attn_decode_launch(
      qc.data_ptr(), kv.data_ptr(), ic.data_ptr<int32_t>(), int(J1), i2.defined() ? i2.data_ptr<int32_t>() : nullptr,
      int(idx2_offset), sc.data_ptr<float>(), q.scalar_type() == at::kFloat,
      int(B), int(H), int(N), int(D), int(J), kv.stride(0), int(kv_batch), float(scale), ws_o.data_ptr<float>(),
      ws_ml.data_ptr<float>(), nsplit, rows_per_split, use_mma, rc.defined() ? rc.data_ptr<float>() : nullptr,
      int(rope_dim), out.data_ptr(),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("sparse_attn_decode", &sparse_attn_decode_cuda); }

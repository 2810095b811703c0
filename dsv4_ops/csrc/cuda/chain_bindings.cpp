// CUDA registration of dsv4::nvfp4_linear_chain: argument checks (shared with the CPU kernel), intermediate
// outputs from the caching allocator, one launch on the current stream (chain.cu) at decode sizes (<= 8 rows, the
// default kernel choice: the chain keeps the gemv kernel's bits); otherwise the stages as per-op calls.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <vector>

#include "chain_checks.h"
#include "kernel_limits.h"
#include "cuda/chain.h"
#include "overrides.h"

namespace {

static_assert(kChainMaxStages == dsv4_chain::kMaxStages, "chain.h and chain_checks.h must agree");

void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
}

bool aligned(const at::Tensor& t, uintptr_t a) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % a == 0; }

// Contiguous, and aligned for the kernel's vector copies (odd views get copied).
at::Tensor prep(const at::Tensor& t, uintptr_t align) {
  const at::Tensor c = t.contiguous();
  return aligned(c, align) ? c : c.clone();
}

void nvfp4_linear_chain_cuda(const at::Tensor& x, at::TensorList w, at::TensorList s, at::TensorList gs,
                             const at::Tensor& out, const at::Tensor& sync) {
  const char* op = "dsv4::nvfp4_linear_chain";
  check_cuda(x, op, "x");
  const dsv4_chain::ChainDims d = dsv4_chain::check_chain(x, w, s, gs, out, sync, op);
  if (d.M == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  // The one launch keeps the gemv kernel's bits: only where nvfp4_linear runs it (<= 8 rows, unless the
  // nvfp4_gemm_kernel override forces skinny, its value 3: the one choice that takes these rows off the gemv).
  const bool one_launch = d.M <= dsv4_limits::kChainMaxRows && dsv4_overrides::get().nvfp4_gemm_kernel != 3;
  if (!one_launch) {
    out.copy_(dsv4_chain::chain_per_op(x, w, s, gs, d).view(d.out_shape));
    return;
  }
  const at::Tensor x_in = prep(x, 16);
  std::vector<at::Tensor> keep;  // contiguous operands and the stages' outputs, alive until the launch is queued
  Nvfp4ChainArgs a{};
  a.x = x_in.data_ptr();
  a.M = d.M;
  a.nstages = int(d.st.size());
  const bool out_direct = out.is_contiguous() && aligned(out, 16);
  for (size_t i = 0; i < d.st.size(); ++i) {
    const at::Tensor wc = prep(w[i], 16), sc = prep(s[i], 8), gc = gs[i].contiguous();
    keep.insert(keep.end(), {wc, sc, gc});
    a.w[i] = wc.data_ptr<uint8_t>();
    a.s[i] = sc.data_ptr<uint8_t>();
    a.gs[i] = gc.data_ptr<float>();
    a.G[i] = d.st[i].groups();
    a.N[i] = d.st[i].N;
    a.K[i] = d.st[i].K;
    const bool last = i + 1 == d.st.size();
    if (last && out_direct) {
      a.y[i] = out.data_ptr();
    } else {
      keep.push_back(at::empty({d.M, a.G[i] * a.N[i]}, x.options()));
      a.y[i] = keep.back().data_ptr();
    }
  }
  a.sync = sync.data_ptr<int>();
  a.pdl = dsv4_overrides::get().pdl != 0 ? 1 : 0;
  const cudaError_t err = dsv4_nvfp4_chain_launch(&a, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
  if (!out_direct) out.copy_(keep.back().view(d.out_shape));
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("nvfp4_linear_chain", &nvfp4_linear_chain_cuda); }

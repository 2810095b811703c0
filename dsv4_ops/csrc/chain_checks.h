// Argument checks shared by the CPU and CUDA kernels of dsv4::nvfp4_linear_chain, and the chain as per-op calls
// (the CPU kernel; the CUDA kernel where its one launch does not apply).
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#include "nvfp4_gemm_checks.h"

namespace dsv4_chain {

constexpr int64_t kMaxStages = 4;  // = kChainMaxStages of the CUDA launcher (chain.h)

struct ChainStageDims {
  int64_t G, N, K;  // G = 0: a plain linear (w_packed [N, Kp/2]); else grouped [G, N, Kp/2]
  int64_t groups() const { return G > 0 ? G : 1; }
};

struct ChainDims {
  std::vector<ChainStageDims> st;
  int64_t M;                        // rows (x's leading dims)
  std::vector<int64_t> lead;        // x's leading dims
  std::vector<int64_t> out_shape;   // lead + (G, N) of the last stage, or lead + (N,)
  int64_t sync_numel;               // int32 counters the CUDA launch needs
};

inline std::string at_index(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

// x [..., K_0] (stage 0 plain) or [..., G_0, K_0]; stage i > 0 reads stage i - 1's output [M, G_(i-1) * N_(i-1)]
// as [M, G_i, K_i], with K_i a multiple of 128 and N_(i-1) of 16 (whole 16-row tiles in whole 128-column chunks:
// the CUDA kernel's per-chunk dependencies). out: bf16 of the last stage's shape; sync: int32, >= sync_numel.
inline ChainDims check_chain(const at::Tensor& x, at::TensorList w, at::TensorList s, at::TensorList gs,
                             const at::Tensor& out, const at::Tensor& sync, const char* op) {
  using namespace dsv4_nvfp4;
  const size_t n = w.size();
  TORCH_CHECK(n >= 1 && n <= size_t(kMaxStages) && s.size() == n && gs.size() == n, op,
              ": w_packed, w_scale and w_global_scale must be lists of one length, 1 to ", kMaxStages, ", got ",
              w.size(), ", ", s.size(), ", ", gs.size());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": x must be bf16, got ", x.scalar_type());
  ChainDims d;
  int64_t prev_cols = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::string wn = at_index("w_packed", i), sn = at_index("w_scale", i), gn = at_index("w_global_scale", i);
    TORCH_CHECK(w[i].dim() == 2 || w[i].dim() == 3, op, ": ", wn, " must be [N, Kp/2] or [G, N, Kp/2], got ",
                w[i].sizes());
    const bool grouped = w[i].dim() == 3;
    TORCH_CHECK(!grouped || w[i].size(0) > 0, op, ": ", wn, " must hold at least one matrix, got ", w[i].sizes());
    const int64_t G = grouped ? w[i].size(0) : 0, groups = grouped ? G : 1;
    int64_t K;
    if (i == 0) {
      TORCH_CHECK(x.dim() >= (grouped ? 2 : 1), op, ": x must be [..., ", grouped ? "G, " : "", "K], got ",
                  x.sizes());
      TORCH_CHECK(!grouped || x.size(-2) == G, op, ": x.shape[-2] must be G = ", G, " (", wn, "), got ", x.sizes());
      K = x.size(-1);
      d.lead.assign(x.sizes().begin(), x.sizes().end() - (grouped ? 2 : 1));
    } else {
      TORCH_CHECK(prev_cols % groups == 0, op, ": stage ", i - 1, "'s ", prev_cols, " output columns do not split into ",
                  groups, " groups of ", wn);
      K = prev_cols / groups;
      TORCH_CHECK(K % kChunk == 0, op, ": ", wn, "'s K = ", K, " (stage ", i - 1,
                  "'s output per group) must be a multiple of 128");
      TORCH_CHECK(d.st.back().N % 16 == 0, op, ": stage ", i - 1, "'s N = ", d.st.back().N,
                  " must be a multiple of 16 to feed ", wn);
    }
    const int64_t N = check_weight(w[i], s[i], K, grouped ? 1 : 0, x, op, wn.c_str(), sn.c_str());
    if (grouped) {
      TORCH_CHECK(gs[i].scalar_type() == at::kFloat && gs[i].dim() == 1 && gs[i].size(0) == G, op, ": ", gn,
                  " must be float32 [", G, "], got ", gs[i].scalar_type(), " ", gs[i].sizes());
      check_same_device(gs[i], x, op, gn.c_str());
    } else {
      check_global_scale(gs[i], x, op, gn.c_str());
    }
    TORCH_CHECK(groups * N < (int64_t(1) << 31) && groups * K < (int64_t(1) << 31), op, ": ", wn,
                "'s sizes must fit in int32");
    d.st.push_back({G, N, K});
    prev_cols = groups * N;
  }
  d.M = 1;
  for (const int64_t v : d.lead) d.M *= v;
  d.out_shape = d.lead;
  if (d.st.back().G > 0) d.out_shape.push_back(d.st.back().G);
  d.out_shape.push_back(d.st.back().N);
  d.sync_numel = 1;
  for (size_t i = 0; i + 1 < n; ++i) d.sync_numel += d.st[i].groups() * d.st[i].N / kChunk;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == at::IntArrayRef(d.out_shape), op,
              ": out must be bf16 ", at::IntArrayRef(d.out_shape), ", got ", out.scalar_type(), " ", out.sizes());
  check_same_device(out, x, op, "out");
  TORCH_CHECK(sync.scalar_type() == at::kInt && sync.dim() == 1 && sync.numel() >= d.sync_numel &&
                  sync.is_contiguous(),
              op, ": sync must be contiguous int32 [>= ", d.sync_numel, "] (zeros), got ", sync.scalar_type(), " ",
              sync.sizes(), sync.is_contiguous() ? "" : " (not contiguous)");
  check_same_device(sync, x, op, "sync");
  return d;
}

// The chain as one dsv4::nvfp4_linear / nvfp4_linear_grouped call per stage (each op's own kernel choice).
inline at::Tensor chain_per_op(const at::Tensor& x, at::TensorList w, at::TensorList s, at::TensorList gs,
                               const ChainDims& d) {
  static const auto linear = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("dsv4::nvfp4_linear", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, std::optional<at::ScalarType>)>();
  static const auto grouped = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("dsv4::nvfp4_linear_grouped", "")
                                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&)>();
  at::Tensor h = x.reshape({d.M, -1});
  for (size_t i = 0; i < d.st.size(); ++i) {
    const ChainStageDims& st = d.st[i];
    h = st.G > 0 ? grouped.call(h.reshape({d.M, st.G, st.K}), w[i], s[i], gs[i]).reshape({d.M, -1})
                 : linear.call(h.reshape({d.M, st.K}), w[i], s[i], gs[i], std::nullopt);
  }
  return h;
}

}  // namespace dsv4_chain

// X [M, K] times W [N, K]^T (fp32) with every row's sums in one order whatever M is: on the CPU one
// matrix-vector product per row (ATen's CPU matmul picks kernels, blockings and thread splits by M, so a row's
// result could depend on which other rows share the call: a speculative step's verification of T tokens would not
// be one-token decode bit for bit). On other devices a plain matmul (only the CPU reference needs the property).
#pragma once
#include <ATen/ATen.h>

namespace dsv4_cpu {

inline at::Tensor row_matmul(const at::Tensor& X, const at::Tensor& W) {
  if (!X.is_cpu() || X.dim() != 2) return at::matmul(X, W.t());
  at::Tensor out = at::empty({X.size(0), W.size(0)}, X.options());
  for (int64_t r = 0; r < X.size(0); ++r) {
    at::Tensor o = out.select(0, r);
    at::mv_out(o, W, X.select(0, r));
  }
  return out;
}

}  // namespace dsv4_cpu

// Argument checks shared by the CPU and CUDA kernels of the NVFP4 quantization ops (docs/ops.md
// "## NVFP4 quantization").
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dsv4::nvfp4 {

inline void check_float_input(const at::Tensor& x, const char* op, const char* name, int64_t multiple) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat,
              op, ": ", name, " must be bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": ", name, " must have at least one dimension");
  TORCH_CHECK(x.size(-1) % multiple == 0, op, ": the last dimension of ", name, " (", x.size(-1),
              ") must be a multiple of ", multiple, multiple == 16 ? " (the NVFP4 block size)"
                                                                   : " (two interleaved halves of 16-blocks)");
}

// Returns true for a per-row scale (shape lead), false for a per-tensor (0-d) one.
inline bool check_global_scale(const at::Tensor& gs, at::IntArrayRef lead, const at::Tensor& like, const char* op) {
  TORCH_CHECK(gs.scalar_type() == at::kFloat, op, ": global_scale must be float32, got ", gs.scalar_type());
  TORCH_CHECK(gs.device() == like.device(), op, ": global_scale is on ", gs.device(), " but the data is on ",
              like.device());
  if (gs.dim() == 0) return false;
  TORCH_CHECK(gs.sizes() == lead, op, ": global_scale must be 0-d (per tensor) or have the leading shape ", lead,
              " of the data (per row), got ", gs.sizes());
  return true;
}

inline void check_dequant_inputs(const at::Tensor& packed, const at::Tensor& block_scale, at::ScalarType dtype,
                                 const char* op) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, op, ": packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(block_scale.scalar_type() == at::kFloat8_e4m3fn || block_scale.scalar_type() == at::kByte, op,
              ": block_scale must be float8_e4m3fn (or uint8 holding e4m3 bits), got ", block_scale.scalar_type());
  TORCH_CHECK(packed.dim() >= 1 && packed.dim() == block_scale.dim(), op,
              ": packed and block_scale must have the same number of dimensions (>= 1)");
  TORCH_CHECK(packed.sizes().slice(0, packed.dim() - 1) == block_scale.sizes().slice(0, block_scale.dim() - 1),
              op, ": packed ", packed.sizes(), " and block_scale ", block_scale.sizes(),
              " must share their leading dimensions");
  TORCH_CHECK(packed.size(-1) == block_scale.size(-1) * 8, op, ": packed's last dimension (", packed.size(-1),
              ") must be 8 x block_scale's (", block_scale.size(-1), ")");
  TORCH_CHECK(block_scale.device() == packed.device(), op, ": packed and block_scale are on different devices");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, op,
              ": dtype must be bfloat16, float16 or float32, got ", dtype);
}

// row_weight: None, or fp32 with one value per row of gate_up.
inline void check_row_weight(const c10::optional<at::Tensor>& w, int64_t rows, const at::Tensor& like, const char* op) {
  if (!w.has_value()) return;
  TORCH_CHECK(w->scalar_type() == at::kFloat, op, ": row_weight must be float32, got ", w->scalar_type());
  TORCH_CHECK(w->numel() == rows, op, ": row_weight must hold one weight per row (", rows, "), got ", w->sizes());
  TORCH_CHECK(w->device() == like.device(), op, ": row_weight is on ", w->device(), " but gate_up is on ",
              like.device());
}

inline std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

}  // namespace dsv4::nvfp4

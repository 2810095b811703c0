// CUDA registration of the NVFP4 quantization ops: argument checks (shared with the CPU kernels), outputs from
// the caching allocator (graph-pool aware), launch on the current stream. Kernels: nvfp4_quant.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "nvfp4_quant_checks.h"

namespace dsv4::nvfp4 {

// Defined in nvfp4_quant.cu (same declarations there).
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
cudaError_t launch_quantize(const void* x, DType dt, int64_t rows, int64_t K, const float* gs, bool per_row,
                            uint8_t* packed, uint8_t* sf, cudaStream_t stream);
cudaError_t launch_dequantize(const uint8_t* packed, const uint8_t* sf, const float* gs, bool per_row, int64_t rows,
                              int64_t K, void* out, DType dt, cudaStream_t stream);
cudaError_t launch_fused_amax_quantize(const void* x, DType dt, int64_t rows, int64_t K, bool per_row,
                                       uint8_t* packed, uint8_t* sf, float* gs_out, cudaStream_t stream);
cudaError_t launch_fused_deinterleave(const void* gate_up, DType dt, const float* row_weight, float limit,
                                      int64_t rows, int64_t I, bool per_row, uint8_t* packed, uint8_t* sf,
                                      float* gs_out, cudaStream_t stream);

}  // namespace dsv4::nvfp4

namespace {

using namespace dsv4::nvfp4;

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default: return DType::kF32;
  }
}

// Contiguous and 16-byte aligned (the kernels use 16-byte vector loads/stores).
at::Tensor dense(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone(at::MemoryFormat::Contiguous);
  return c;
}

void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

std::tuple<at::Tensor, at::Tensor> nvfp4_quantize_cuda(const at::Tensor& x_in, const at::Tensor& global_scale) {
  const char* op = "dsv4::nvfp4_quantize";
  check_cuda(x_in, op, "x");
  check_float_input(x_in, op, "x", 16);
  const auto lead = x_in.sizes().slice(0, x_in.dim() - 1);
  const bool per_row = check_global_scale(global_scale, lead, x_in, op);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = dense(x_in), gs = global_scale.contiguous();
  const int64_t K = x.size(-1), R = c10::multiply_integers(lead);
  at::Tensor packed = at::empty(with_last(x.sizes(), K / 2), x.options().dtype(at::kByte));
  at::Tensor sf = at::empty(with_last(x.sizes(), K / 16), x.options().dtype(at::kFloat8_e4m3fn));
  check_launch(launch_quantize(x.data_ptr(), dtype_of(x.scalar_type()), R, K, gs.data_ptr<float>(), per_row,
                               packed.data_ptr<uint8_t>(), reinterpret_cast<uint8_t*>(sf.data_ptr()), stream()),
               op);
  return {packed, sf};
}

at::Tensor nvfp4_dequantize_cuda(const at::Tensor& packed_in, const at::Tensor& block_scale_in,
                                 const at::Tensor& global_scale, at::ScalarType dtype) {
  const char* op = "dsv4::nvfp4_dequantize";
  check_cuda(packed_in, op, "packed");
  check_dequant_inputs(packed_in, block_scale_in, dtype, op);
  const auto lead = packed_in.sizes().slice(0, packed_in.dim() - 1);
  const bool per_row = check_global_scale(global_scale, lead, packed_in, op);
  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = dense(packed_in), bs = block_scale_in.contiguous(), gs = global_scale.contiguous();
  const int64_t K = packed.size(-1) * 2, R = c10::multiply_integers(lead);
  at::Tensor out = at::empty(with_last(packed.sizes(), K), packed.options().dtype(dtype));
  check_launch(launch_dequantize(packed.data_ptr<uint8_t>(), reinterpret_cast<const uint8_t*>(bs.data_ptr()),
                                 gs.data_ptr<float>(), per_row, R, K, out.data_ptr(), dtype_of(dtype), stream()),
               op);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_amax_quantize_cuda_impl(const at::Tensor& x_in, bool per_row,
                                                                             const char* op) {
  check_cuda(x_in, op, "x");
  check_float_input(x_in, op, "x", 16);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = dense(x_in);
  const auto lead = x.sizes().slice(0, x.dim() - 1);
  const int64_t K = x.size(-1), R = c10::multiply_integers(lead);
  at::Tensor packed = at::empty(with_last(x.sizes(), K / 2), x.options().dtype(at::kByte));
  at::Tensor sf = at::empty(with_last(x.sizes(), K / 16), x.options().dtype(at::kFloat8_e4m3fn));
  const auto fopt = x.options().dtype(at::kFloat);
  // An empty input launches nothing, so its (per-row) scales must start at 0.
  at::Tensor gs = x.numel() ? (per_row ? at::empty(lead, fopt) : at::empty({}, fopt))
                            : (per_row ? at::zeros(lead, fopt) : at::zeros({}, fopt));
  check_launch(launch_fused_amax_quantize(x.data_ptr(), dtype_of(x.scalar_type()), R, K, per_row,
                                          packed.data_ptr<uint8_t>(), reinterpret_cast<uint8_t*>(sf.data_ptr()),
                                          gs.data_ptr<float>(), stream()),
               op);
  return {packed, sf, gs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_amax_quantize_cuda(const at::Tensor& x) {
  return fused_amax_quantize_cuda_impl(x, false, "dsv4::fused_amax_quantize");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_amax_quantize_per_row_cuda(const at::Tensor& x) {
  return fused_amax_quantize_cuda_impl(x, true, "dsv4::fused_amax_quantize_per_row");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_deinterleave_amax_quantize_cuda(
    const at::Tensor& gate_up_in, const c10::optional<at::Tensor>& row_weight, double limit, bool per_row) {
  const char* op = "dsv4::fused_deinterleave_amax_quantize";
  check_cuda(gate_up_in, op, "gate_up");
  check_float_input(gate_up_in, op, "gate_up", 32);
  const c10::cuda::CUDAGuard guard(gate_up_in.device());
  const at::Tensor gu = dense(gate_up_in);
  const auto lead = gu.sizes().slice(0, gu.dim() - 1);
  const int64_t I = gu.size(-1) / 2, R = c10::multiply_integers(lead);
  check_row_weight(row_weight, R, gu, op);
  const at::Tensor w = row_weight.has_value() ? row_weight->contiguous() : at::Tensor();
  at::Tensor packed = at::empty(with_last(gu.sizes(), I / 2), gu.options().dtype(at::kByte));
  at::Tensor sf = at::empty(with_last(gu.sizes(), I / 16), gu.options().dtype(at::kFloat8_e4m3fn));
  const auto fopt = gu.options().dtype(at::kFloat);
  at::Tensor gs = gu.numel() ? (per_row ? at::empty(lead, fopt) : at::empty({}, fopt))
                             : (per_row ? at::zeros(lead, fopt) : at::zeros({}, fopt));
  check_launch(launch_fused_deinterleave(gu.data_ptr(), dtype_of(gu.scalar_type()),
                                         w.defined() ? w.data_ptr<float>() : nullptr, (float)limit, R, I, per_row,
                                         packed.data_ptr<uint8_t>(), reinterpret_cast<uint8_t*>(sf.data_ptr()),
                                         gs.data_ptr<float>(), stream()),
               op);
  return {packed, sf, gs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("nvfp4_quantize", &nvfp4_quantize_cuda);
  m.impl("nvfp4_dequantize", &nvfp4_dequantize_cuda);
  m.impl("fused_amax_quantize", &fused_amax_quantize_cuda);
  m.impl("fused_amax_quantize_per_row", &fused_amax_quantize_per_row_cuda);
  m.impl("fused_deinterleave_amax_quantize", &fused_deinterleave_amax_quantize_cuda);
}

// CPU kernels of the NVFP4 quantization ops (docs/ops.md "## NVFP4 quantization"). Written as plain loops
// that follow the definition step by step (threshold-form E2M1 encoder); the CUDA kernels use a different
// but equivalent encoder, so the CPU/CUDA/reference equality tests check each other.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "nvfp4_quant_checks.h"

// Bit-exactness needs every fp32 step rounded on its own: a compiler that fuses a*b+c into an FMA (any
// target with FMA and -ffp-contract=fast) would change results.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

using namespace dsv4::nvfp4;

constexpr int64_t kBlock = 16;
constexpr float kFltMax = std::numeric_limits<float>::max();

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Sign bit read from the raw storage, so -0 and NaNs keep theirs whatever the float conversion does.
inline bool neg_bit(float v) { return f32_bits(v) >> 31; }
inline bool neg_bit(c10::BFloat16 v) { return v.x >> 15; }
inline bool neg_bit(c10::Half v) { return v.x >> 15; }

inline uint8_t e2m1_code(float y, bool neg) {
  const float a = std::fmin(std::fabs(y), 6.0f);  // fmin: NaN -> 6
  const int c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return (uint8_t)(c | (neg ? 8 : 0));
}

inline float gs_enc_of(float gs) { return gs > 0.0f ? std::fmin(1.0f / gs, kFltMax) : 0.0f; }

// One 16-element block: v fp32 values, neg their sign bits -> 8 packed bytes + the e4m3 scale byte.
inline void quant_block(const float* v, const bool* neg, float gs, float gs_enc, uint8_t* packed, uint8_t* sf_out) {
  float vmax = 0.0f;
  for (int i = 0; i < kBlock; ++i) vmax = std::fmax(vmax, std::fabs(v[i]));  // fmax skips NaN
  float sf = (gs_enc * vmax) / 6.0f;
  sf = std::fmin(sf, 448.0f);
  const c10::Float8_e4m3fn sf8(sf);
  const float sff = static_cast<float>(sf8);
  const float out_scale = sff == 0.0f ? 0.0f : std::fmin(1.0f / (sff * gs), kFltMax);
  for (int i = 0; i < kBlock / 2; ++i) {
    const uint8_t lo = e2m1_code(v[2 * i] * out_scale, neg[2 * i]);
    const uint8_t hi = e2m1_code(v[2 * i + 1] * out_scale, neg[2 * i + 1]);
    packed[i] = (uint8_t)(lo | (hi << 4));
  }
  *sf_out = sf8.x;
}

// Quantizes R rows of K values given per-row dequant-direction global scales (gs_stride 0: one scale).
template <typename T>
void quantize_rows(const T* x, int64_t R, int64_t K, const float* gs, int64_t gs_stride, uint8_t* packed,
                   uint8_t* sf) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    float v[kBlock];
    bool neg[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      const float g = gs[r * gs_stride];
      const float ge = gs_enc_of(g);
      for (int64_t b = 0; b < nb; ++b) {
        const T* p = x + r * K + b * kBlock;
        for (int i = 0; i < kBlock; ++i) {
          v[i] = static_cast<float>(p[i]);
          neg[i] = neg_bit(p[i]);
        }
        quant_block(v, neg, g, ge, packed + r * (K / 2) + b * (kBlock / 2), sf + r * nb + b);
      }
    }
  });
}

template <typename T>
float row_amax(const T* p, int64_t K) {
  float m = 0.0f;
  for (int64_t i = 0; i < K; ++i) m = std::fmax(m, std::fabs(static_cast<float>(p[i])));
  return m;
}

#define DSV4_NVFP4_DISPATCH(dtype, NAME, ...)                                          \
  [&] {                                                                              \
    switch (dtype) {                                                                 \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }         \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }            \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);             \
    }                                                                                \
  }()

std::tuple<at::Tensor, at::Tensor> alloc_quant_outputs(const at::Tensor& x) {
  const int64_t K = x.size(-1);
  return {at::empty(with_last(x.sizes(), K / 2), x.options().dtype(at::kByte)),
          at::empty(with_last(x.sizes(), K / kBlock), x.options().dtype(at::kFloat8_e4m3fn))};
}

std::tuple<at::Tensor, at::Tensor> nvfp4_quantize_cpu(const at::Tensor& x_in, const at::Tensor& global_scale) {
  const char* op = "dsv4::nvfp4_quantize";
  check_float_input(x_in, op, "x", 16);
  const auto lead = x_in.sizes().slice(0, x_in.dim() - 1);
  const bool per_row = check_global_scale(global_scale, lead, x_in, op);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor gs = global_scale.contiguous();
  auto [packed, sf] = alloc_quant_outputs(x);
  if (x.numel() == 0) return {packed, sf};
  const int64_t K = x.size(-1), R = x.numel() / K;
  DSV4_NVFP4_DISPATCH(x.scalar_type(), op, [&] {
    quantize_rows(x.data_ptr<scalar_t>(), R, K, gs.data_ptr<float>(), per_row ? 1 : 0, packed.data_ptr<uint8_t>(),
                  reinterpret_cast<uint8_t*>(sf.data_ptr()));
  });
  return {packed, sf};
}

at::Tensor nvfp4_dequantize_cpu(const at::Tensor& packed_in, const at::Tensor& block_scale_in,
                                const at::Tensor& global_scale, at::ScalarType dtype) {
  const char* op = "dsv4::nvfp4_dequantize";
  check_dequant_inputs(packed_in, block_scale_in, dtype, op);
  const auto lead = packed_in.sizes().slice(0, packed_in.dim() - 1);
  const bool per_row = check_global_scale(global_scale, lead, packed_in, op);
  const at::Tensor packed = packed_in.contiguous(), bs = block_scale_in.contiguous(), gs = global_scale.contiguous();
  const int64_t K = packed.size(-1) * 2;
  at::Tensor out = at::empty(with_last(packed.sizes(), K), packed.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const int64_t R = out.numel() / K, nb = K / kBlock;
  static const float kVal[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const c10::Float8_e4m3fn*>(bs.data_ptr());
  const float* g = gs.data_ptr<float>();
  DSV4_NVFP4_DISPATCH(dtype, op, [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, R, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float gr = g[per_row ? r : 0];
        for (int64_t b = 0; b < nb; ++b) {
          const float d = static_cast<float>(s[r * nb + b]) * gr;
          for (int i = 0; i < kBlock; ++i) {
            const int code = (p[r * (K / 2) + b * 8 + i / 2] >> (4 * (i & 1))) & 0xF;
            const float mag = kVal[code & 7] * d;
            o[r * K + b * kBlock + i] = static_cast<scalar_t>((code & 8) ? -mag : mag);
          }
        }
      }
    });
  });
  return out;
}

// Global (per_row false: one 0-d scale) or per-row dynamic scale of x [R, K], then quantize.
template <typename T>
void amax_quantize_rows(const T* x, int64_t R, int64_t K, bool per_row, float* gs_out, uint8_t* packed,
                        uint8_t* sf) {
  if (per_row) {
    at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) gs_out[r] = row_amax(x + r * K, K) / 2688.0f;
    });
    quantize_rows(x, R, K, gs_out, 1, packed, sf);
    return;
  }
  const float amax = at::parallel_reduce(
      0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), 0.0f,
      [&](int64_t r0, int64_t r1, float m) {
        for (int64_t r = r0; r < r1; ++r) m = std::fmax(m, row_amax(x + r * K, K));
        return m;
      },
      [](float a, float b) { return std::fmax(a, b); });
  gs_out[0] = amax / 2688.0f;
  quantize_rows(x, R, K, gs_out, 0, packed, sf);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_amax_quantize_impl(const at::Tensor& x_in, bool per_row,
                                                                        const char* op) {
  check_float_input(x_in, op, "x", 16);
  const at::Tensor x = x_in.contiguous();
  auto [packed, sf] = alloc_quant_outputs(x);
  const auto lead = x.sizes().slice(0, x.dim() - 1);
  at::Tensor gs = per_row ? at::zeros(lead, x.options().dtype(at::kFloat)) : at::zeros({}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {packed, sf, gs};
  const int64_t K = x.size(-1), R = x.numel() / K;
  DSV4_NVFP4_DISPATCH(x.scalar_type(), op, [&] {
    amax_quantize_rows(x.data_ptr<scalar_t>(), R, K, per_row, gs.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                       reinterpret_cast<uint8_t*>(sf.data_ptr()));
  });
  return {packed, sf, gs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_amax_quantize_cpu(const at::Tensor& x) {
  return fused_amax_quantize_impl(x, false, "dsv4::fused_amax_quantize");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_amax_quantize_per_row_cpu(const at::Tensor& x) {
  return fused_amax_quantize_impl(x, true, "dsv4::fused_amax_quantize_per_row");
}

// ---- swiglu with clamp, exp from IEEE mul/add only (same steps as reference.exp_portable) ----

constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.63p-1f;
constexpr float kLn2Lo = -0x1.bd0106p-13f;
constexpr float kRound = 12582912.0f;

inline float pow2i(int k) { return bits_f32((uint32_t)(k + 127) << 23); }

inline float exp_portable(float t) {
  t = std::fmin(std::fmax(t, -104.0f), 89.0f);
  const float kf = (t * kLog2e + kRound) - kRound;
  const float r = (t - kf * kLn2Hi) - kf * kLn2Lo;
  float p = 0x1.a01a02p-13f;
  p = p * r + 0x1.6c16c2p-10f;
  p = p * r + 0x1.111112p-7f;
  p = p * r + 0x1.555556p-5f;
  p = p * r + 0x1.555556p-3f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int k = (int)kf;
  const int k1 = k >> 1;  // arithmetic shift (floor), as torch's >> on int32
  return (p * pow2i(k - k1)) * pow2i(k1);
}

inline float swiglu_limited(float g, float u, float limit) {
  g = g > limit ? limit : g;  // keeps NaN, like torch.clamp
  u = u > limit ? limit : (u < -limit ? -limit : u);
  return (g / (1.0f + exp_portable(-g))) * u;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_deinterleave_amax_quantize_cpu(
    const at::Tensor& gate_up_in, const c10::optional<at::Tensor>& row_weight, double limit_d, bool per_row) {
  const char* op = "dsv4::fused_deinterleave_amax_quantize";
  check_float_input(gate_up_in, op, "gate_up", 32);
  const at::Tensor gu = gate_up_in.contiguous();
  const auto lead = gu.sizes().slice(0, gu.dim() - 1);
  const int64_t K2 = gu.size(-1), I = K2 / 2, R = c10::multiply_integers(lead);
  check_row_weight(row_weight, R, gu, op);
  at::Tensor packed = at::empty(with_last(gu.sizes(), I / 2), gu.options().dtype(at::kByte));
  at::Tensor sf = at::empty(with_last(gu.sizes(), I / kBlock), gu.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor gs = per_row ? at::zeros(lead, gu.options().dtype(at::kFloat)) : at::zeros({}, gu.options().dtype(at::kFloat));
  if (gu.numel() == 0) return {packed, sf, gs};
  const float limit = (float)limit_d;
  std::vector<float> h((size_t)(R * I));
  const at::Tensor w = row_weight.has_value() ? row_weight->contiguous() : at::Tensor();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  DSV4_NVFP4_DISPATCH(gu.scalar_type(), op, [&] {
    const scalar_t* p = gu.data_ptr<scalar_t>();
    at::parallel_for(0, R, std::max<int64_t>(1, 4096 / I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = 0; j < I; ++j) {
          float v = swiglu_limited(static_cast<float>(p[r * K2 + 2 * j]), static_cast<float>(p[r * K2 + 2 * j + 1]),
                                   limit);
          if (wp) v = v * wp[r];
          h[r * I + j] = std::isnan(v) ? bits_f32(0x7FC00000u) : v;  // +NaN: the sign of a made NaN is platform-dependent
        }
      }
    });
  });
  amax_quantize_rows(h.data(), R, I, per_row, gs.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                     reinterpret_cast<uint8_t*>(sf.data_ptr()));
  return {packed, sf, gs};
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("nvfp4_quantize", &nvfp4_quantize_cpu);
  m.impl("nvfp4_dequantize", &nvfp4_dequantize_cpu);
  m.impl("fused_amax_quantize", &fused_amax_quantize_cpu);
  m.impl("fused_amax_quantize_per_row", &fused_amax_quantize_per_row_cpu);
  m.impl("fused_deinterleave_amax_quantize", &fused_deinterleave_amax_quantize_cpu);
}

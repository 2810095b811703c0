// CPU kernels of dsv4::nvfp4_linear, nvfp4_linear_w4a4, nvfp4_moe and nvfp4_moe_rows: decode the kernel-layout
// weights to fp32 exactly, then fp32 products row by row through ATen (row_matmul.h: a row's result does not
// depend on the other rows of the call). Semantics (and the order of the bf16 roundings in the MoE) are those
// documented in docs/ops.md "## NVFP4 GEMM / MoE"; the CUDA kernels follow the same definition.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "fp32_linear_checks.h"
#include "nvfp4_gemm_checks.h"
#include "nvfp4_layout.h"
#include "row_matmul.h"

namespace {

using namespace dsv4_nvfp4;

constexpr float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

inline float e2m1_value(uint32_t code) {
  const float v = kE2M1[code & 7];
  return (code & 8) ? -v : v;
}

inline float scale_value(uint8_t b) { return b == 0 ? 0.f : std::ldexp(1.f + float(b & 7) / 8.f, (b >> 3) - 10); }

// Code of pair q (0..3), element e (0 = low half / even k) of a kernel-layout word (dsv4_model.nvfp4).
inline uint32_t word_code(uint32_t w, int q, int e) {
  if (q < 3) {
    const uint32_t x = w << (3 * q);
    return e == 0 ? (((x >> 6) & 7u) | (((x >> 15) & 1u) << 3)) : (((x >> 22) & 7u) | (((x >> 31) & 1u) << 3));
  }
  const int b = e == 0 ? 0 : 16;
  const uint32_t mag = ((w >> (10 + b)) & 3u) | (((w >> (13 + b)) & 1u) << 2);
  return mag | (((w >> (14 + b)) & 1u) << 3);
}

// fp32 [rows, K] = e2m1 * scale * gs of a whole kernel-layout matrix of `rows` rows.
at::Tensor dequant_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int64_t K, float gs) {
  const int64_t kp = padded_k(K);
  at::Tensor out = at::empty({rows, K}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const RowAddr a = row_addr(r, rows, kp);
      float* orow = o + r * K;
      for (int64_t c = 0; c < kp / kChunk; ++c) {
        const uint8_t* cr = codes + a.w + c * a.wstep;
        const uint8_t* sr = scales + a.s + c * a.sstep;
        for (int t = 0; t < 4; ++t) {
          for (int j = 0; j < 4; ++j) {
            const uint8_t* p = cr + t * 16 + j * 4;
            const uint32_t w = uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
            for (int q = 0; q < 4; ++q) {
              const int s = 2 * j + (q >> 1), h = q & 1;
              const float sgs = scale_value(sr[s]) * gs;  // nvfp4_dequantize order
              for (int e = 0; e < 2; ++e) {
                const int64_t k = c * kChunk + 16 * s + 8 * h + 2 * t + e;
                if (k < K) orow[k] = e2m1_value(word_code(w, q, e)) * sgs;
              }
            }
          }
        }
      }
    }
  });
  return out;
}

at::Tensor dequant_matrix(const at::Tensor& w, const at::Tensor& s, int64_t K, float gs) {
  const at::Tensor wc = w.contiguous(), sc = s.contiguous();
  return dequant_rows(wc.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), wc.size(0), K, gs);
}

float scalar_of(const at::Tensor& t) { return t.reshape({-1})[0].item<float>(); }

at::Tensor nvfp4_linear_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& gs,
                            std::optional<at::ScalarType> out_dtype) {
  const char* op = "dsv4::nvfp4_linear";
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16, op, ": x must be bf16 [..., K], got ",
              x.scalar_type(), " ", x.sizes());
  const at::ScalarType dt = dsv4_nvfp4::linear_out_dtype(out_dtype, op);
  const int64_t K = x.size(-1);
  const int64_t N = check_weight(w, s, K, 0, x, op, "w_packed", "w_scale");
  check_global_scale(gs, x, op, "w_global_scale");
  const at::Tensor W = dequant_matrix(w, s, K, scalar_of(gs));
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  return dsv4_cpu::row_matmul(x.reshape({-1, K}).to(at::kFloat), W).to(dt).reshape(out_shape);
}

at::Tensor nvfp4_linear_grouped_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                                    const at::Tensor& gs) {
  const char* op = "dsv4::nvfp4_linear_grouped";
  const auto [G, N] = check_grouped(x, w, s, gs, op);
  const int64_t K = x.size(-1);
  const at::Tensor gsc = gs.contiguous();
  std::vector<at::Tensor> outs;
  for (int64_t g = 0; g < G; ++g) {
    const at::Tensor W = dequant_matrix(w.select(0, g), s.select(0, g), K, gsc.data_ptr<float>()[g]);
    outs.push_back(dsv4_cpu::row_matmul(x.select(-2, g).reshape({-1, K}).to(at::kFloat), W).to(at::kBFloat16));
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  return at::stack(outs, 1).reshape(out_shape);
}

std::vector<at::Tensor> nvfp4_linear_multi_cpu(const at::Tensor& x, at::TensorList w, at::TensorList s,
                                               at::TensorList gs) {
  check_multi(x, w, s, gs, "dsv4::nvfp4_linear_multi");
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < w.size(); ++i) outs.push_back(nvfp4_linear_cpu(x, w[i], s[i], gs[i], std::nullopt));
  return outs;
}

// The two ops in order: nvfp4_linear_multi's outputs, then fp32_linear's (every argument checked first).
std::vector<at::Tensor> nvfp4_fp32_linear_multi_cpu(const at::Tensor& x, at::TensorList w, at::TensorList s,
                                                    at::TensorList gs, at::TensorList fp32_weight) {
  const char* op = "dsv4::nvfp4_fp32_linear_multi";
  check_multi(x, w, s, gs, op);
  dsv4_fp32_linear::check(x, fp32_weight, op, "fp32_weight");
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < w.size(); ++i) outs.push_back(nvfp4_linear_cpu(x, w[i], s[i], gs[i], std::nullopt));
  for (at::Tensor& y : dsv4_fp32_linear::matmul_each(x, fp32_weight)) outs.push_back(std::move(y));
  return outs;
}

// Canonical NVFP4 activations (element order, e4m3 scales) -> fp32 [rows, K] including the global scale.
at::Tensor dequant_canonical(const at::Tensor& packed, const at::Tensor& scale, float gs) {
  const at::Tensor s8 = scale.scalar_type() == at::kByte ? scale.view(at::kFloat8_e4m3fn) : scale;
  const at::Tensor p = packed.contiguous(), sf = s8.contiguous().to(at::kFloat);
  const int64_t K = p.size(-1) * 2;
  const int64_t rows = p.numel() / std::max<int64_t>(p.size(-1), 1);
  at::Tensor out = at::empty({rows, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const float* sp = sf.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t b = pp[r * (K / 2) + k / 2];
        const uint32_t code = (k & 1) ? (b >> 4) : (b & 15);
        o[r * K + k] = e2m1_value(code) * (sp[r * (K / kBlock) + k / kBlock] * gs);
      }
  });
  return out;
}

at::Tensor nvfp4_linear_w4a4_cpu(const at::Tensor& xp, const at::Tensor& xs, const at::Tensor& xg,
                                 const at::Tensor& w, const at::Tensor& s, const at::Tensor& gs,
                                 at::ScalarType out_dtype) {
  const char* op = "dsv4::nvfp4_linear_w4a4";
  const int64_t K = check_w4a4_activation(xp, xs, xg, op);
  const int64_t N = check_weight(w, s, K, 0, xp, op, "w_packed", "w_scale");
  check_global_scale(gs, xp, op, "w_global_scale");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat || out_dtype == at::kHalf, op,
              ": out_dtype must be bfloat16, float16 or float32, got ", out_dtype);
  const at::Tensor X = dequant_canonical(xp, xs, scalar_of(xg));
  const at::Tensor W = dequant_matrix(w, s, K, scalar_of(gs));
  std::vector<int64_t> out_shape(xp.sizes().begin(), xp.sizes().end());
  out_shape.back() = N;
  return dsv4_cpu::row_matmul(X, W).to(out_dtype).reshape(out_shape);
}

at::Tensor swiglu_clamped(at::Tensor g, at::Tensor u, double limit) {
  if (limit > 0) {
    u = u.clamp(-limit, limit);
    g = g.clamp_max(limit);
  }
  return at::silu(g) * u;
}

// One expert (gate/up interleaved rows of the kernel layout) applied to rows xe [n, d] (bf16):
// bf16(W2 . bf16(swiglu(bf16(Wg x), bf16(Wu x)) * w)), w = per-row routing weight (or none).
at::Tensor expert_cpu(const at::Tensor& xe, const uint8_t* w13, const uint8_t* s13, float g13, const uint8_t* w2,
                      const uint8_t* s2, float g2, int64_t d, int64_t I, const std::optional<at::Tensor>& route,
                      double limit) {
  const at::Tensor W13 = dequant_rows(w13, s13, 2 * I, d, g13).view({I / 8, 2, 8, d});
  const at::Tensor Wg = W13.select(1, 0).reshape({I, d}), Wu = W13.select(1, 1).reshape({I, d});
  const at::Tensor xf = xe.to(at::kFloat);
  const at::Tensor g = dsv4_cpu::row_matmul(xf, Wg).to(at::kBFloat16).to(at::kFloat);
  const at::Tensor u = dsv4_cpu::row_matmul(xf, Wu).to(at::kBFloat16).to(at::kFloat);
  at::Tensor h = swiglu_clamped(g, u, limit);
  if (route) h = h * route->unsqueeze(1);
  h = h.to(at::kBFloat16).to(at::kFloat);
  const at::Tensor W2 = dequant_rows(w2, s2, d, I, g2);
  return dsv4_cpu::row_matmul(h, W2).to(at::kBFloat16);
}

// The per-assignment expert outputs (bf16) [T*k + T*has_shared, d] of dsv4::nvfp4_moe_rows: row t*k + j = token
// t's slot j (zeros where the id is not a local expert), row T*k + t = the shared expert's output for token t.
at::Tensor moe_rows_cpu(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const at::Tensor& w13,
                        const at::Tensor& s13, const at::Tensor& g13, const at::Tensor& w2, const at::Tensor& s2,
                        const at::Tensor& g2, const std::optional<at::Tensor>& sw13,
                        const std::optional<at::Tensor>& ss13, const std::optional<at::Tensor>& sg13,
                        const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& ss2,
                        const std::optional<at::Tensor>& sg2, double limit, const MoeDims& m) {
  const int64_t kp_d = padded_k(m.d), kp_i = padded_k(m.I);
  const at::Tensor w13c = w13.contiguous(), s13c = s13.contiguous(), w2c = w2.contiguous(), s2c = s2.contiguous();
  const at::Tensor g13c = g13.contiguous(), g2c = g2.contiguous();
  const at::Tensor idc = ids.to(at::kLong).contiguous(), wtc = wts.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  at::Tensor rows = at::zeros({m.T * m.k + (m.has_shared ? m.T : 0), m.d}, x.options());
  std::vector<std::vector<int64_t>> by_expert(m.E);
  for (int64_t a = 0; a < m.T * m.k; ++a)
    if (id[a] >= 0 && id[a] < m.E) by_expert[id[a]].push_back(a);
  const at::Tensor xc = x.contiguous();
  for (int64_t e = 0; e < m.E; ++e) {
    if (by_expert[e].empty()) continue;
    const at::Tensor a = at::tensor(by_expert[e], at::TensorOptions().dtype(at::kLong));
    const at::Tensor tok = at::floor_divide(a, m.k);
    const at::Tensor oe = expert_cpu(
        xc.index_select(0, tok), w13c.data_ptr<uint8_t>() + e * 2 * m.I * (kp_d / 2),
        s13c.data_ptr<uint8_t>() + e * 2 * m.I * (kp_d / kBlock), g13c.data_ptr<float>()[e],
        w2c.data_ptr<uint8_t>() + e * m.d * (kp_i / 2), s2c.data_ptr<uint8_t>() + e * m.d * (kp_i / kBlock),
        g2c.data_ptr<float>()[e], m.d, m.I, wtc.reshape({-1}).index_select(0, a), limit);
    rows.index_copy_(0, a, oe);
  }
  if (m.has_shared) {
    const at::Tensor a = sw13->contiguous(), b = ss13->contiguous(), c = sw2->contiguous(), dd = ss2->contiguous();
    rows.narrow(0, m.T * m.k, m.T)
        .copy_(expert_cpu(xc, a.data_ptr<uint8_t>(), b.data_ptr<uint8_t>(), scalar_of(*sg13), c.data_ptr<uint8_t>(),
                          dd.data_ptr<uint8_t>(), scalar_of(*sg2), m.d, m.Is, std::nullopt, limit));
  }
  return rows;
}

at::Tensor nvfp4_moe_rows_cpu(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts,
                              const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& g13,
                              const at::Tensor& w2, const at::Tensor& s2, const at::Tensor& g2,
                              const std::optional<at::Tensor>& sw13, const std::optional<at::Tensor>& ss13,
                              const std::optional<at::Tensor>& sg13, const std::optional<at::Tensor>& sw2,
                              const std::optional<at::Tensor>& ss2, const std::optional<at::Tensor>& sg2,
                              double limit) {
  const MoeDims m =
      check_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, "dsv4::nvfp4_moe_rows");
  return moe_rows_cpu(x, ids, wts, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, limit, m);
}

at::Tensor nvfp4_moe_cpu(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const at::Tensor& w13,
                         const at::Tensor& s13, const at::Tensor& g13, const at::Tensor& w2, const at::Tensor& s2,
                         const at::Tensor& g2, const std::optional<at::Tensor>& sw13,
                         const std::optional<at::Tensor>& ss13, const std::optional<at::Tensor>& sg13,
                         const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& ss2,
                         const std::optional<at::Tensor>& sg2, double limit) {
  const MoeDims m = check_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2);
  const at::Tensor rows =
      moe_rows_cpu(x, ids, wts, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, limit, m);
  // Summed in slot order so the result does not depend on the order experts are visited in. Non-local slots'
  // rows are +0, and adding +0 to an fp32 sum that starts at +0 changes no bit: the same as skipping them
  // (the CUDA combine kernel does).
  const at::Tensor o = rows.narrow(0, 0, m.T * m.k).view({m.T, m.k, m.d});
  at::Tensor acc = at::zeros({m.T, m.d}, x.options().dtype(at::kFloat));
  for (int64_t j = 0; j < m.k; ++j) acc = acc + o.select(1, j).to(at::kFloat);
  if (m.has_shared) acc = acc + rows.narrow(0, m.T * m.k, m.T).to(at::kFloat);
  return acc.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
  m.impl("nvfp4_linear", &nvfp4_linear_cpu);
  m.impl("nvfp4_linear_grouped", &nvfp4_linear_grouped_cpu);
  m.impl("nvfp4_linear_multi", &nvfp4_linear_multi_cpu);
  m.impl("nvfp4_fp32_linear_multi", &nvfp4_fp32_linear_multi_cpu);
  m.impl("nvfp4_linear_w4a4", &nvfp4_linear_w4a4_cpu);
  m.impl("nvfp4_moe", &nvfp4_moe_cpu);
  m.impl("nvfp4_moe_rows", &nvfp4_moe_rows_cpu);
}

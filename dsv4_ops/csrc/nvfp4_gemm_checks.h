// Argument checks shared by the CPU and CUDA kernels of dsv4::nvfp4_linear / nvfp4_linear_w4a4 / nvfp4_moe /
// nvfp4_moe_rows.
// The weight layout is the kernel layout of dsv4_model.nvfp4.repack_weight (docs/ops.md "## NVFP4 GEMM / MoE").
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace dsv4_nvfp4 {

constexpr int64_t kChunk = 128;  // K granularity of the kernel layout
constexpr int64_t kBlock = 16;   // NVFP4 block

inline int64_t padded_k(int64_t k) { return (k + kChunk - 1) / kChunk * kChunk; }

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), ", got ", t.device());
}

inline void check_global_scale(const at::Tensor& gs, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(gs.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", gs.scalar_type());
  TORCH_CHECK(gs.numel() == 1 && gs.dim() <= 1, op, ": ", name, " must be a 0-d (or [1]) tensor, got ", gs.sizes());
  check_same_device(gs, ref, op, name);
}

// nvfp4_linear's out_dtype: None -> bf16; bf16, fp16 or fp32 (written from the fp32 sums).
inline at::ScalarType linear_out_dtype(std::optional<at::ScalarType> out_dtype, const char* op) {
  const at::ScalarType dt = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kHalf, op,
              ": out_dtype must be bfloat16, float16 or float32, got ", dt);
  return dt;
}

// One kernel-layout matrix [N, Kp/2] + [N, Kp/16] (batch dims in `lead` leading dims, e.g. experts). Returns N.
// The NVFP4 activation operand of nvfp4_linear_w4a4 (fused_amax_quantize outputs); returns K.
inline int64_t check_w4a4_activation(const at::Tensor& xp, const at::Tensor& xs, const at::Tensor& xg,
                                     const char* op) {
  TORCH_CHECK(xp.dim() >= 1 && xp.scalar_type() == at::kByte, op, ": x_packed must be uint8 [..., K/2], got ",
              xp.scalar_type(), " ", xp.sizes());
  const int64_t K = xp.size(-1) * 2;
  TORCH_CHECK(xs.scalar_type() == at::kFloat8_e4m3fn || xs.scalar_type() == at::kByte, op,
              ": x_scale must be float8_e4m3fn (or its bytes as uint8), got ", xs.scalar_type());
  TORCH_CHECK(xs.dim() == xp.dim() && xs.sizes().slice(0, xp.dim() - 1) == xp.sizes().slice(0, xp.dim() - 1) &&
                  xs.size(-1) * kBlock == K,
              op, ": x_scale must be [..., K/16] matching x_packed ", xp.sizes(), ", got ", xs.sizes());
  check_same_device(xs, xp, op, "x_scale");
  check_global_scale(xg, xp, op, "x_global_scale");
  return K;
}

inline int64_t check_weight(const at::Tensor& w, const at::Tensor& s, int64_t K, int64_t lead, const at::Tensor& ref,
                            const char* op, const char* wname, const char* sname) {
  TORCH_CHECK(w.dim() == 2 + lead, op, ": ", wname, " must have ", 2 + lead, " dims, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kByte, op, ": ", wname, " must be uint8 (kernel layout), got ",
              w.scalar_type());
  TORCH_CHECK(s.scalar_type() == at::kByte, op, ": ", sname,
              " must be uint8 (kernel-layout scale bytes from repack_weight), got ", s.scalar_type());
  TORCH_CHECK(K > 0 && K % kBlock == 0, op, ": the reduction size K must be a positive multiple of 16, got ", K);
  const int64_t kp = padded_k(K);
  TORCH_CHECK(w.size(-1) * 2 == kp, op, ": ", wname, " last dim must be Kp/2 = ", kp / 2, " for K = ", K, ", got ",
              w.size(-1));
  TORCH_CHECK(s.dim() == w.dim(), op, ": ", sname, " must have ", w.dim(), " dims, got ", s.sizes());
  for (int64_t d = 0; d < w.dim() - 1; ++d)
    TORCH_CHECK(s.size(d) == w.size(d), op, ": ", sname, " ", s.sizes(), " does not match ", wname, " ", w.sizes());
  TORCH_CHECK(s.size(-1) == kp / kBlock, op, ": ", sname, " last dim must be Kp/16 = ", kp / kBlock, ", got ",
              s.size(-1));
  check_same_device(w, ref, op, wname);
  check_same_device(s, ref, op, sname);
  return w.size(-2);
}

// dsv4::nvfp4_linear_grouped: x [..., G, K] bf16, G stacked matrices, global scales [G]. Returns {G, N}.
inline std::pair<int64_t, int64_t> check_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                                                 const at::Tensor& gs, const char* op) {
  TORCH_CHECK(x.dim() >= 2 && x.scalar_type() == at::kBFloat16, op, ": x must be bf16 [..., G, K], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t G = x.size(-2);
  const int64_t N = check_weight(w, s, x.size(-1), 1, x, op, "w_packed", "w_scale");
  TORCH_CHECK(w.size(0) == G, op, ": w_packed must hold G = ", G, " matrices (x.shape[-2]), got ", w.sizes());
  TORCH_CHECK(gs.scalar_type() == at::kFloat && gs.dim() == 1 && gs.size(0) == G, op,
              ": w_global_scale must be float32 [G] with G = ", G, ", got ", gs.scalar_type(), " ", gs.sizes());
  check_same_device(gs, x, op, "w_global_scale");
  return {G, N};
}

// dsv4::nvfp4_linear_multi: one x, n matrices with the same K. Returns each matrix's N.
inline std::vector<int64_t> check_multi(const at::Tensor& x, at::TensorList w, at::TensorList s, at::TensorList gs,
                                        const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16, op, ": x must be bf16 [..., K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!w.empty() && s.size() == w.size() && gs.size() == w.size(), op,
              ": w_packed, w_scale and w_global_scale must be non-empty lists of one length, got ", w.size(), ", ",
              s.size(), ", ", gs.size());
  std::vector<int64_t> ns;
  for (size_t i = 0; i < w.size(); ++i) {
    const std::string wn = "w_packed[" + std::to_string(i) + "]", sn = "w_scale[" + std::to_string(i) + "]",
                      gn = "w_global_scale[" + std::to_string(i) + "]";
    ns.push_back(check_weight(w[i], s[i], x.size(-1), 0, x, op, wn.c_str(), sn.c_str()));
    check_global_scale(gs[i], x, op, gn.c_str());
  }
  return ns;
}

struct MoeDims {
  int64_t T, d, k, E, I, Is;  // Is = shared intermediate size (0 without a shared expert)
  bool has_shared;
};

inline MoeDims check_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const at::Tensor& w13,
                         const at::Tensor& s13, const at::Tensor& g13, const at::Tensor& w2, const at::Tensor& s2,
                         const at::Tensor& g2, const std::optional<at::Tensor>& sw13,
                         const std::optional<at::Tensor>& ss13, const std::optional<at::Tensor>& sg13,
                         const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& ss2,
                         const std::optional<at::Tensor>& sg2, const char* op = "dsv4::nvfp4_moe") {
  MoeDims m{};
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be bf16 [T, d], got ",
              x.scalar_type(), " ", x.sizes());
  m.T = x.size(0);
  m.d = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == m.T, op, ": topk_ids must be [T, k] with T = ", m.T, ", got ",
              ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, op,
              ": topk_ids must be int32 or int64, got ", ids.scalar_type());
  m.k = ids.size(1);
  TORCH_CHECK(m.k > 0, op, ": topk_ids needs k >= 1");
  TORCH_CHECK(wts.sizes() == ids.sizes() && wts.scalar_type() == at::kFloat, op,
              ": topk_weights must be float32 of the shape of topk_ids ", ids.sizes(), ", got ", wts.scalar_type(),
              " ", wts.sizes());
  check_same_device(ids, x, op, "topk_ids");
  check_same_device(wts, x, op, "topk_weights");
  const int64_t two_i = check_weight(w13, s13, m.d, 1, x, op, "w13_packed", "w13_scale");
  m.E = w13.size(0);
  TORCH_CHECK(two_i % 16 == 0, op, ": w13 rows (2I) must be a multiple of 16 (gate/up interleave of 8), got ",
              two_i);
  m.I = two_i / 2;
  const int64_t dn = check_weight(w2, s2, m.I, 1, x, op, "w2_packed", "w2_scale");
  TORCH_CHECK(w2.size(0) == m.E && dn == m.d, op, ": w2_packed must be [E, d, Ip/2] = [", m.E, ", ", m.d,
              ", ...], got ", w2.sizes());
  TORCH_CHECK(g13.scalar_type() == at::kFloat && g13.dim() == 1 && g13.size(0) == m.E, op,
              ": w13_global_scale must be float32 [E], got ", g13.scalar_type(), " ", g13.sizes());
  TORCH_CHECK(g2.scalar_type() == at::kFloat && g2.dim() == 1 && g2.size(0) == m.E, op,
              ": w2_global_scale must be float32 [E], got ", g2.scalar_type(), " ", g2.sizes());
  check_same_device(g13, x, op, "w13_global_scale");
  check_same_device(g2, x, op, "w2_global_scale");
  const int n_shared = int(sw13.has_value()) + int(ss13.has_value()) + int(sg13.has_value()) +
                       int(sw2.has_value()) + int(ss2.has_value()) + int(sg2.has_value());
  TORCH_CHECK(n_shared == 0 || n_shared == 6, op, ": pass all six shared_* tensors or none");
  m.has_shared = n_shared == 6;
  if (m.has_shared) {
    const int64_t s_two_i = check_weight(*sw13, *ss13, m.d, 0, x, op, "shared_w13_packed", "shared_w13_scale");
    TORCH_CHECK(s_two_i % 16 == 0, op, ": shared_w13 rows must be a multiple of 16, got ", s_two_i);
    m.Is = s_two_i / 2;
    const int64_t sdn = check_weight(*sw2, *ss2, m.Is, 0, x, op, "shared_w2_packed", "shared_w2_scale");
    TORCH_CHECK(sdn == m.d, op, ": shared_w2_packed must have d = ", m.d, " rows, got ", sdn);
    check_global_scale(*sg13, x, op, "shared_w13_global_scale");
    check_global_scale(*sg2, x, op, "shared_w2_global_scale");
  }
  return m;
}

}  // namespace dsv4_nvfp4

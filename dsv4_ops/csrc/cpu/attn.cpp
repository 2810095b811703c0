// CPU kernel of dsv4::sparse_attn_decode (docs/ops.md "## Decode attention"): per (row, head), fp32 scores of the
// listed cache rows in list order, the softmax with the head's sink, the fp32 weighted sum in list order; with
// out_rope the output's inverse RoPE as the model's tensor ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "attn_checks.h"

namespace {

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const at::Tensor& sink,
                 float scale, int64_t kv_batch, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), N = kv.size(1), J = idx.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kv.data_ptr<T>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* sp = sink.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(J), qf(D), o(D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, kb = kv_batch ? b % kv_batch : b;
      for (int64_t d = 0; d < D; ++d) qf[d] = float(qp[(b * H + h) * D + d]);
      float m = sp[h];
      for (int64_t j = 0; j < J; ++j) {
        const int64_t r = ip[b * J + j];
        if (r < 0 || r >= N) {
          s[j] = -INFINITY;
          continue;
        }
        const T* k = kp + (kb * N + r) * D;
        float acc = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc += qf[d] * float(k[d]);
        s[j] = acc * scale;
        m = std::max(m, s[j]);
      }
      float l = std::exp(sp[h] - m);
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t j = 0; j < J; ++j) {
        if (s[j] == -INFINITY) continue;
        const float p = std::exp(s[j] - m);
        l += p;
        const T* k = kp + (kb * N + ip[b * J + j]) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * float(k[d]);
      }
      for (int64_t d = 0; d < D; ++d) op[(b * H + h) * D + d] = T(o[d] / l);
    }
  });
}

at::Tensor sparse_attn_decode_cpu(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx,
                                  const at::Tensor& sink, double scale, const std::optional<at::Tensor>& out_rope,
                                  int64_t rope_dim, const std::optional<at::Tensor>& idx2, int64_t idx2_offset,
                                  int64_t kv_batch) {
  dsv4_attn::check(q, kv, idx, sink, kv_batch);
  dsv4_attn::check_out_rope(q, out_rope, rope_dim);
  dsv4_attn::check_idx2(q, idx2, idx2_offset);
  const at::Tensor qc = q.contiguous(), kc = kv.contiguous();
  const at::Tensor ic = dsv4_attn::joined_rows(idx, idx2, idx2_offset).contiguous();
  const at::Tensor sc = sink.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) attend_rows<float>(qc, kc, ic, sc, float(scale), kv_batch, out);
  else if (q.scalar_type() == at::kBFloat16) attend_rows<at::BFloat16>(qc, kc, ic, sc, float(scale), kv_batch, out);
  else attend_rows<at::Half>(qc, kc, ic, sc, float(scale), kv_batch, out);
  return out_rope.has_value() ? dsv4_attn::inverse_rope_aten(out, out_rope->contiguous(), rope_dim) : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("sparse_attn_decode", &sparse_attn_decode_cpu); }

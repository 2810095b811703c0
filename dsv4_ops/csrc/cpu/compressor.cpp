// CPU kernel of dsv4::compressor_decode (docs/ops.md "## Compressor decode"): per row, the token's projections
// into its state slot; where the token closes its window, the gated pooling of the window (softmax over the
// window's rows per column, two passes, sums in row order; 0 while it is open) and the overlap shift (shifted
// layout; a state indexed by position is read by position and never shifted).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compressor_checks.h"

namespace {

// v rounded to-nearest-even into element i of out (float32, bfloat16 or float16)
void store(void* out, at::ScalarType t, int64_t i, float v) {
  if (t == at::kFloat) {
    static_cast<float*>(out)[i] = v;
  } else if (t == at::kBFloat16) {
    static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(v);
  } else {
    static_cast<c10::Half*>(out)[i] = c10::Half(v);
  }
}

void compressor_decode_cpu(const at::Tensor& kv, const at::Tensor& score, const at::Tensor& ape,
                           const at::Tensor& positions, const at::Tensor& kv_state, const at::Tensor& score_state,
                           const at::Tensor& pooled, int64_t kv_batch) {
  const dsv4_comp::Shape sh = dsv4_comp::check(kv, score, ape, positions, kv_state, score_state, pooled, kv_batch);
  TORCH_CHECK(kv.device().is_cpu(), "dsv4::compressor_decode: expected CPU tensors, got ", kv.device());
  const at::Tensor kc = kv.contiguous(), sc = score.contiguous(), ac = ape.contiguous();
  const at::Tensor pc = positions.to(at::kLong).contiguous();
  const int64_t C = sh.C, m = sh.m, R = sh.R, hd = sh.hd;
  const float* kp = kc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  const float* ap = ac.data_ptr<float>();
  const int64_t* pos = pc.data_ptr<int64_t>();
  float* ks = kv_state.data_ptr<float>();
  float* ss = score_state.data_ptr<float>();
  const at::ScalarType out_type = pooled.scalar_type();
  void* out = pooled.data_ptr();
  const int64_t cm = sh.overlap ? 2 * m : m;  // the rows pooled
  // per sequence b, its tokens in order: rows n = b, S + b, 2S + b, ... (one row each without kv_batch)
  at::parallel_for(0, sh.S, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
    for (int64_t n = b; n < sh.B; n += sh.S) {
      const int64_t p = pos[n], r = ((p % m) + m) % m;
      // shifted: the token at row (m if overlap) + r; by position: at row p mod R
      const int64_t slot = sh.by_position ? ((p % R) + R) % R : (sh.overlap ? m : 0) + r;
      float* kb = ks + b * R * C;
      float* sb = ss + b * R * C;
      for (int64_t k = 0; k < C; ++k) {
        kb[slot * C + k] = kp[n * C + k];
        sb[slot * C + k] = sp[n * C + k] + ap[r * C + k];
      }
      if (((p + 1) % m + m) % m != 0) {  // the window stays open: its entry is never used, pooled 0
        for (int64_t d = 0; d < hd; ++d) store(out, out_type, n * hd + d, 0.0f);
        continue;
      }
      for (int64_t d = 0; d < hd; ++d) {
        // pooled row j's element of column d: the first m rows' first half, the last m rows' second half (overlap);
        // row j is state row j (shifted) or the row of position p - cm + 1 + j (by position; a position below 0
        // reads as an unwritten row: score -inf, kv 0), so both layouts pool a closed window in one order
        auto at_ = [&](const float* base, int64_t j, float none) {
          int64_t row = j;
          if (sh.by_position) {
            const int64_t q = p - cm + 1 + j;
            if (q < 0) return none;
            row = q % R;
          }
          return base[row * C + (sh.overlap && j >= m ? hd : 0) + d];
        };
        const float ninf = -std::numeric_limits<float>::infinity();
        float mx = ninf;
        for (int64_t j = 0; j < cm; ++j) mx = std::max(mx, at_(sb, j, ninf));
        float sum = 0.0f;
        for (int64_t j = 0; j < cm; ++j) sum += std::exp(at_(sb, j, ninf) - mx);
        float acc = 0.0f;
        for (int64_t j = 0; j < cm; ++j) acc += at_(kb, j, 0.0f) * (std::exp(at_(sb, j, ninf) - mx) / sum);
        store(out, out_type, n * hd + d, acc);
      }
      if (sh.overlap && !sh.by_position) {  // closed: its rows become the previous
        std::memcpy(kb, kb + m * C, sizeof(float) * m * C);
        std::memcpy(sb, sb + m * C, sizeof(float) * m * C);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("compressor_decode", &compressor_decode_cpu); }

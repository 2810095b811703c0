// CPU kernel of dsv4::indexer_store_keys (docs/ops.md "## Indexer key store"): for each row whose compression
// window closed at this token, the key into the float cache and its FP4 form (E2M1 codes, UE8M0 block-32
// exponents, as dsv4_ops.reference.indexer_fp4_quantize_keys) into the packed caches, at the entry's slot.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cache_slot.h"
#include "key_store_checks.h"
#include "pow2_scale.h"

namespace {

uint8_t e2m1_code(float y) {  // y in [-6, 6]; ties to the even code
  const float a = std::fabs(y);
  const int mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return uint8_t(mag | ((y < 0.0f && mag > 0) ? 8 : 0));
}

template <typename T>
void store_row(const T* key, int64_t D, T* cache, uint8_t* codes, uint8_t* scales) {
  std::memcpy(cache, key, sizeof(T) * D);
  for (int64_t b = 0; b < D / 32; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(static_cast<float>(key[32 * b + i])));
    const uint32_t e = dsv4::pow2_ceil_exponent(std::max(amax, 6.0f * std::ldexp(1.0f, -126)) * (1.0f / 6.0f));
    const uint32_t sbits = e > 0 ? e << 23 : 1u << 22;  // 2^(e - 127); e = 0: the subnormal 2^-127
    float s;
    std::memcpy(&s, &sbits, 4);
    scales[b] = uint8_t(e);
    for (int64_t i = 0; i < 32; i += 2) {
      const float y0 = std::min(std::max(static_cast<float>(key[32 * b + i]) / s, -6.0f), 6.0f);
      const float y1 = std::min(std::max(static_cast<float>(key[32 * b + i + 1]) / s, -6.0f), 6.0f);
      codes[16 * b + i / 2] = uint8_t(e2m1_code(y0) | (e2m1_code(y1) << 4));
    }
  }
}

void indexer_store_keys_cpu(const at::Tensor& keys, const at::Tensor& positions, int64_t ratio,
                            const at::Tensor& kv_cache, const at::Tensor& k_codes, const at::Tensor& k_scales,
                            int64_t kv_batch) {
  const dsv4_key_store::Shape sh =
      dsv4_key_store::check(keys, positions, ratio, kv_cache, k_codes, k_scales, kv_batch);
  TORCH_CHECK(keys.device().is_cpu(), "dsv4::indexer_store_keys: expected CPU tensors, got ", keys.device());
  const at::Tensor kc = keys.contiguous(), pc = positions.to(at::kLong).contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t b = 0; b < sh.B; ++b) {
    const int64_t slot = dsv4::entry_slot(pos[b], ratio, sh.n);
    if (slot < 0) continue;
    const int64_t at = (kv_batch ? b % kv_batch : b) * sh.n + slot;
    uint8_t* codes = k_codes.data_ptr<uint8_t>() + at * (sh.D / 2);
    uint8_t* scales = k_scales.data_ptr<uint8_t>() + at * (sh.D / 32);
    if (keys.scalar_type() == at::kBFloat16)
      store_row(kc.data_ptr<c10::BFloat16>() + b * sh.D, sh.D, kv_cache.data_ptr<c10::BFloat16>() + at * sh.D, codes,
                scales);
    else
      store_row(kc.data_ptr<float>() + b * sh.D, sh.D, kv_cache.data_ptr<float>() + at * sh.D, codes, scales);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("indexer_store_keys", &indexer_store_keys_cpu); }

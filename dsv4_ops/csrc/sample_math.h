// Math shared bit-for-bit by the CPU and CUDA sampler kernels (no torch headers: the .cu includes it).
// Everything that decides WHICH token is drawn lives here, so both devices define the same distribution
// and the same random stream; they can differ only where libm and CUDA's expf/logf/log1pf round
// differently (<= 2 ulp), i.e. on near-ties.
#pragma once
#include <stdint.h>
#include <math.h>
#include <string.h>

#ifdef __CUDACC__
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif

namespace dsv4_sample {

// Philox4x32-10 (Salmon et al., SC'11): counter-based, so the stream is a pure function of
// (seed, offset, element) and a CUDA graph replay draws fresh numbers once `offset` is bumped on device.
DSV4_HD void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
    const uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
    const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// The 4 random words of element group g = i / 4 (element i uses word i % 4). The row index is NOT part
// of the counter: a request's draws depend only on its own (seed, offset), not on its slot in the batch.
DSV4_HD void philox_group(uint64_t seed, uint64_t offset, uint64_t group, uint32_t out[4]) {
  out[0] = (uint32_t)group;
  out[1] = (uint32_t)(group >> 32);
  out[2] = (uint32_t)offset;
  out[3] = (uint32_t)(offset >> 32);
  philox4x32_10(out, (uint32_t)seed, (uint32_t)(seed >> 32));
}

// Gumbel(0,1) from one word. 23 bits keep v = (j + 0.5) * 2^-23 exact in fp32 and strictly inside (0,1);
// log1p(-v) keeps the resolution where E = -log(1-v) is small (the large-Gumbel tail that decides winners).
// Tails are cut at |g| ~ 16.6 (probability 2^-24 per element).
DSV4_HD float gumbel_from_word(uint32_t w) {
  const float v = ((float)(w >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
  const float e = -log1pf(-v);
  return -logf(e);
}

// NaN logits are treated as -inf so they are never kept by top-k/top-p nor picked by argmax.
DSV4_HD float sanitize(float x) { return x != x ? -INFINITY : x; }

// Order-preserving uint32 of a float (after sanitize; -0 == +0), the radix key of the top-k/top-p search.
DSV4_HD uint32_t order_key(float x) {
  x = sanitize(x);
  if (x == 0.0f) x = 0.0f;
  uint32_t u;
  memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Probability mass in 2^-40 fixed point: integer sums are associative, so the top-p threshold does not depend
// on reduction order (GPU atomics) and is the same on both devices. exp(.) <= 1, so a row of V tokens sums
// to <= V * 2^40 (no overflow below V = 2^23).
DSV4_HD uint64_t fixed_mass(float logit, float row_max, float temperature) {
  const float e = expf((sanitize(logit) - row_max) / temperature);
  if (!(e > 0.0f)) return 0;  // also catches NaN from an all -inf row
  return (uint64_t)((double)e * 1099511627776.0);
}

// argmax order: larger value wins; equal values -> smaller index (deterministic ties on both devices).
DSV4_HD bool better(float v, int64_t i, float best_v, int64_t best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

// Top-p target in fixed-point units: keep token v iff mass strictly above it < target. The 0.5 floor keeps
// at least the most likely token for top_p <= 0 (its own mass is >= 2^40).
DSV4_HD double top_p_target(float top_p, uint64_t total_mass) {
  const double t = (double)top_p * (double)total_mass;
  return t > 0.5 ? t : 0.5;
}

}  // namespace dsv4_sample

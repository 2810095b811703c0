// The official kernels' power-of-two scale rounding (fast_round_scale), shared by the CPU kernels: for a positive
// normal v, the biased exponent of 2^ceil(log2(v)) taken from v's bits (its exponent, + 1 if any mantissa bit is
// set), and that power of two.
#pragma once
#include <cstdint>
#include <cstring>

namespace dsv4 {

inline uint32_t pow2_ceil_exponent(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u ? 1u : 0u);
}

inline float pow2_ceil(float v) {
  const uint32_t r = pow2_ceil_exponent(v) << 23;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

}  // namespace dsv4

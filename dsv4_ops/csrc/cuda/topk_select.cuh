// What the indexer's top-k kernels share (no torch headers): the order-preserving key of an fp32 score, the digit
// search of an MSB-first radix select, and the descending bitonic sort of the winners.
// The select runs on the 64-bit composite (order key << 32 | (N - 1 - i)): composites are distinct, so the top-k
// set is exactly {composite >= the k-th largest}, in the documented order (score desc, index asc), ties included.
#pragma once
#include <stdint.h>

namespace dsv4_cuda {

__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u << 1) == 0) u = 0;  // -0 == +0
  return (u >> 31) ? ~u : (u | 0x80000000u);
}

// The select's passes over N entries, 8-bit digits from the top: the 4 of the score key, then those of the index
// that N - 1 needs (they only break ties of equal scores). Pass p reads the digit at radix_shift(p, passes) of
// the composites whose digits above it (radix_mask_above) equal the prefix chosen so far.
__device__ __forceinline__ int radix_passes(uint32_t nm1) { return 4 + ((nm1 ? 32 - __clz(nm1) : 0) + 7) / 8; }
__device__ __forceinline__ int radix_shift(int p, int passes) { return p < 4 ? 56 - 8 * p : 8 * (passes - 1 - p); }
__device__ __forceinline__ unsigned long long radix_mask_above(int shift) {
  return shift >= 56 ? 0ull : ~((1ull << (shift + 8)) - 1ull);
}

// Warp 0 of the CTA: the digit of a 256-bin histogram `tot` (counts of the candidates still in play) that holds
// the krem-th largest, and how many candidates lie in the digits above it. Lane l owns bins 8l .. 8l + 7; the
// lane that finds the digit writes *digit and *above (shared memory: the caller syncs before reading them).
__device__ __forceinline__ void radix_find_digit(const unsigned* tot, unsigned krem, int* digit, unsigned* above) {
  const int lane = threadIdx.x & 31;
  unsigned loc = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) loc += tot[8 * lane + j];
  unsigned suf = loc;  // sum over lanes >= this lane
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned v = __shfl_down_sync(0xffffffffu, suf, off);
    if (lane + off < 32) suf += v;
  }
  const unsigned ball = __ballot_sync(0xffffffffu, suf >= krem);
  const int L = 31 - __clz(ball);
  if (lane == L) {
    unsigned a = suf - loc;
    int d = 8 * L + 7;
    for (; d > 8 * L; --d) {
      if (a + tot[d] >= krem) break;
      a += tot[d];
    }
    *digit = d;
    *above = a;
  }
}

// Descending bitonic sort of n (power of two) entries in shared memory by the whole CTA.
__device__ __forceinline__ void bitonic_sort_desc(unsigned long long* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
        const int lo = 2 * stride * (t / stride) + (t % stride);
        const int hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const unsigned long long x = a[lo], y = a[hi];
        if (desc ? (x < y) : (x > y)) {
          a[lo] = y;
          a[hi] = x;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace dsv4_cuda

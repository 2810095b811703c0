// Warming L2 with bytes a later kernel reads (no torch headers). L2 is the GPU's point of coherence: a later
// write by another kernel updates the same lines, so a prefetch is a hint that can never make a later read stale.
#pragma once
#include <stdint.h>

namespace dsv4_cuda {

// bytes: a multiple of 16, p 16-byte aligned.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Part `part` of `parts` of [base, base + bytes), issued by the calling CTA's threads as bulk prefetches of up to
// 32 KB: only the whole 16-byte-aligned pieces inside the range (the bulk prefetch's alignment), any base.
__device__ __forceinline__ void prefetch_l2_share(const uint8_t* base, int64_t bytes, int64_t part, int64_t parts) {
  constexpr int64_t kPiece = 32 * 1024;
  const uintptr_t a = reinterpret_cast<uintptr_t>(base);
  const int64_t skip = int64_t((16 - (a & 15)) & 15), span = (bytes - skip) & ~int64_t(15);
  if (span <= 0) return;
  const uint8_t* start = base + skip;
  const int64_t per = ((span + parts - 1) / parts + 15) & ~int64_t(15);
  const int64_t lo = part * per, hi = lo + per < span ? lo + per : span;
  for (int64_t off = lo + int64_t(threadIdx.x) * kPiece; off < hi; off += int64_t(blockDim.x) * kPiece)
    prefetch_l2_bulk(start + off, uint32_t(hi - off < kPiece ? hi - off : kPiece));
}

// Up to 8 byte ranges for a kernel to warm (a launch parameter: passed by value).
struct L2PrefetchList {
  const uint8_t* p[8];
  int64_t bytes[8];
  int n;
};

__device__ __forceinline__ void prefetch_l2_list_share(const L2PrefetchList& l, int64_t part, int64_t parts) {
  for (int i = 0; i < l.n; ++i) prefetch_l2_share(l.p[i], l.bytes[i], part, parts);
}

}  // namespace dsv4_cuda

// The cache slot a decode row writes, shared by the CPU and CUDA kernels that store into caches
// (indexer_store_keys, rms_norm_rope_store): one rule for every writer of a compressed entry.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define DSV4_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DSV4_HOST_DEVICE inline
#endif

namespace dsv4 {

// Compressed entries of ratio >= 1 in n slots: the entry whose window closes at pos ((pos + 1) % ratio == 0) goes
// to slot min(pos / ratio, n - 1); -1 (nothing written) for any other pos and for pos < 0.
DSV4_HOST_DEVICE int64_t entry_slot(int64_t pos, int64_t ratio, int64_t n) {
  if (pos < 0 || (pos + 1) % ratio != 0) return -1;
  const int64_t s = pos / ratio;
  return s < n - 1 ? s : n - 1;
}

// ratio 0: a sliding window of n slots, written by every row at pos % n; ratio >= 1: entry_slot.
DSV4_HOST_DEVICE int64_t cache_slot(int64_t pos, int64_t ratio, int64_t n) {
  if (ratio != 0) return entry_slot(pos, ratio, n);
  return pos < 0 ? -1 : pos % n;
}

}  // namespace dsv4

// Per-device facts the CUDA code sizes its grids with, read once per device (host-side, no sync).
#pragma once
#include <cuda_runtime.h>

namespace dsv4_cuda {

// SM count of the current device (the bindings' CUDAGuard makes it the tensors' device); a racing first call
// writes the same value.
inline int sm_count() {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;  // H200
  if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  n = n > 0 ? n : 132;
  if (dev >= 0 && dev < 64) cache[dev] = n;
  return n;
}

}  // namespace dsv4_cuda

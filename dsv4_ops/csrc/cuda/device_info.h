// Per-device facts the CUDA bindings size their grids with, read once per device (host-side, no sync).
#pragma once
#include <cuda_runtime.h>

namespace dsv4_cuda {

inline int sm_count(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 132;  // H200
  if (cached[device] == 0) {
    int v = 0;
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device);
    cached[device] = v > 0 ? v : 132;
  }
  return cached[device];
}

}  // namespace dsv4_cuda

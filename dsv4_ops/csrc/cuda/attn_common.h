// What the sparse_attn_decode partial kernels share (attn.cu, attn_wgmma.cu; sm_80+, no torch headers): the rows a
// batch row lists (its idx, then its idx2 + offset) and the reductions over an mma fragment row's four lanes.
#pragma once
#include <stdint.h>

namespace dsv4_cuda {

// The listed rows of one batch row: a[j] for j < ja, then b[j - ja] + off where b's entry is >= 0 (the op's idx2:
// the indexer's top-k as it returns it, -1 for none).
struct RowList {
  const int32_t* a;
  const int32_t* b;
  int ja, off;
  __device__ __forceinline__ int at(int j) const {
    if (j < ja) return __ldg(a + j);
    const int v = __ldg(b + (j - ja));
    return v >= 0 && v <= 0x7FFFFFFF - off ? v + off : -1;
  }
};

__device__ __forceinline__ RowList row_list(const int32_t* idx, int J1, const int32_t* idx2, int J, int off, int b) {
  return {idx + int64_t(b) * J1, idx2 == nullptr ? nullptr : idx2 + int64_t(b) * (J - J1), J1, off};
}

// The sum / maximum over the 4 lanes of a quad (lane % 4 = t: the columns of one row of an mma accumulator).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

}  // namespace dsv4_cuda

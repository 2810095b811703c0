// Launcher of the NVFP4 linear chain kernel (chain.cu): plain C structs of raw pointers, no torch headers.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int kChainMaxStages = 4;

// y_0 = x W_0^T, y_i = y_(i-1) W_i^T, each stage a plain (G = 1) or grouped NVFP4 linear in the kernel layout,
// bf16 in and out, M <= 8 rows. Stage i reads its input as [M, G_i, K_i] and writes [M, G_i, N_i]; for i > 0
// G_(i-1) * N_(i-1) == G_i * K_i, K_i % 128 == 0 and N_(i-1) % 16 == 0 (the checks header says so in words).
struct Nvfp4ChainArgs {
  const void* x;  // bf16 [M, G_0, K_0]
  int64_t M;
  int nstages;
  const uint8_t* w[kChainMaxStages];  // [G, N, Kp/2] (or [N, Kp/2])
  const uint8_t* s[kChainMaxStages];  // [G, N, Kp/16]
  const float* gs[kChainMaxStages];   // [G]
  void* y[kChainMaxStages];           // bf16 [M, G, N]: the stages' outputs (the last one is the op's)
  int64_t G[kChainMaxStages], N[kChainMaxStages], K[kChainMaxStages];
  int* sync;                          // int32 zeros, chain_sync_size() of them; the kernel leaves them zero
  int pdl;                            // launch with programmatic dependent launch
};

#ifdef __cplusplus
extern "C" {
#endif
cudaError_t dsv4_nvfp4_chain_launch(const Nvfp4ChainArgs* a, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

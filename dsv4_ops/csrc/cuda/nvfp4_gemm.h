// Launchers of the NVFP4 GEMM / MoE CUDA kernels (nvfp4_gemm.cu, with the kernel files it names): plain C structs of raw pointers, no torch
// headers. Weights are in the kernel layout of dsv4_model.nvfp4.repack_weight (docs/ops.md).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

// out_kind: 0 = bf16, 1 = fp16, 2 = fp32
constexpr int kNvfp4MaxSegments = 4;  // weights of one nvfp4_linear_multi launch

struct Nvfp4LinearArgs {
  const void* x;            // bf16 [M, K]
  const uint8_t* w;         // [N, Kp/2]
  const uint8_t* s;         // [N, Kp/16]
  const float* gs;          // weight global scale (1 value)
  const float* gs_act;      // activation global scale (W4A4) or nullptr
  void* y;                  // [M, N]
  int out_kind;
  int64_t M, N, K;
  int64_t G;                // > 1: nvfp4_linear_grouped (gemv / skinny, wgmma): x [M, G, K], w [G, N, Kp/2], gs [G],
                            // y [M, G, N], group = blockIdx.y
  int nseg;                 // > 0: nvfp4_linear_multi (gemv / skinny only): y_i = x W_i^T for the segments below
                            // (w, s, gs, y, N above unused), segment = blockIdx.y
  const uint8_t* seg_w[kNvfp4MaxSegments];
  const uint8_t* seg_s[kNvfp4MaxSegments];
  const float* seg_gs[kNvfp4MaxSegments];
  void* seg_y[kNvfp4MaxSegments];
  int64_t seg_n[kNvfp4MaxSegments];
  int gemv;                 // 1 (the default): gemv for M <= 8, tiled for one dense matrix at 8 < M <= 64;
                            // 0: skinny for every M <= 64
  int pdl;                  // launch the gemv kernel with programmatic dependent launch
  int trigger_now;          // the dense gemv lets its successor launch at its start (the kernel launched beside it
                            // by dsv4::nvfp4_fp32_linear_multi reads only what this one reads); else after its last pass
  int wgmma;                // 1: the wgmma kernel where the tiled one would run, and grouped at M > 8 (nvfp4_wgmma.cu);
                            // 2: the same with 256-row tiles (the wide tile)
};

// Canonical NVFP4 activations -> bf16 code * block scale (no global scale), exact.
struct Nvfp4DequantActArgs {
  const uint8_t* packed;    // [rows, K/2]
  const uint8_t* scale;     // e4m3 bytes [rows, K/16]
  void* out;                // bf16 [rows, K]
  int64_t rows, K;
};

struct Nvfp4MoeArgs {
  const void* x;            // bf16 [T, d]
  const void* ids;          // [T, k] int32 or int64
  int ids_int64;
  const float* wts;         // [T, k]
  const uint8_t *w13, *s13; // [E, 2I, Kp(d)/2], [E, 2I, Kp(d)/16]
  const float* g13;         // [E]
  const uint8_t *w2, *s2;   // [E, d, Kp(I)/2], ...
  const float* g2;          // [E]
  const uint8_t *sw13, *ss13, *sw2, *ss2;  // shared expert (nullptr when absent)
  const float *sg13, *sg2;
  int64_t T, d, k, E, I, Is;  // Is = 0 without a shared expert
  float limit;
  int* route;               // workspace: 3E + 1 + T*k ints
  void* h;                  // bf16 workspace: T*k*I + T*Is
  void* o;                  // bf16 workspace: (T*k + T) * d; the output of dsv4::nvfp4_moe_rows
  void* y;                  // bf16 [T, d] (unused with skip_combine)
  int gemv;                 // 1: the gemv kernel while T*k <= 4E (the default; 0: skinny)
  int pdl;                  // chain the MoE kernels with programmatic dependent launch
  int skip_combine;         // 1: stop after the down projection, o holds the result (dsv4::nvfp4_moe_rows)
  int wgmma;                // the wgmma kernels where skinny would run (nvfp4_wgmma.cu): 1 128-row tiles, 2 256-row
                            // tiles, 3 the auto choice between them (dsv4_nvfp4_moe_launch)
};

// Whether dsv4_nvfp4_linear_launch runs a call (with some rows) on the gemv kernel, the only one that honours
// trigger_now: M <= 8 rows, gemv chosen, x 16-byte aligned.
static inline int dsv4_nvfp4_takes_gemv(const Nvfp4LinearArgs* a) {
  return a->gemv && a->M >= 1 && a->M <= 8 && ((uintptr_t)a->x) % 16 == 0;
}

#ifdef __cplusplus
extern "C" {
#endif
cudaError_t dsv4_nvfp4_linear_launch(const Nvfp4LinearArgs* a, cudaStream_t stream);
cudaError_t dsv4_nvfp4_dequant_act_launch(const Nvfp4DequantActArgs* a, cudaStream_t stream);
// Kernel-layout weight [N, Kp/2] -> bf16 e2m1 * block scale [N, K] (no global scale), exact.
cudaError_t dsv4_nvfp4_dequant_weight_launch(const uint8_t* w, const uint8_t* s, int64_t N, int64_t K, void* out,
                                             cudaStream_t stream);
cudaError_t dsv4_nvfp4_moe_launch(const Nvfp4MoeArgs* a, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

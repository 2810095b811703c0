// Debug overrides of the kernels' launch choices, the library's only switches besides its inputs: process-wide,
// set from Python (dsv4_ops.overrides.kernel_overrides, through dsv4_ops_set_override), read at each launch (so
// at CUDA-graph capture). The defaults are the shipped choices; tests and benchmarks force the others.
// Torch-free, so the .cu files include it too.
#pragma once

namespace dsv4_overrides {

struct Overrides {
  int nvfp4_gemm_kernel = 0;  // NVFP4 linear kernel: 0 auto, 1 tiled, 2 cublas, 3 skinny, 4 wgmma, 5 wgmma_wide
  int pdl = 1;                // programmatic dependent launch of the decode kernels and the NVFP4 chain
  int moe_local_route = 1;    // the MoE's up / down kernels route themselves at decode sizes
  int attn_kernel = 0;        // attention partial kernel: 0 auto, 1 the CUDA-core one also where the tensor-core one
                              // applies, 2 / 3 the tensor-core one with 64 / 16 heads per CTA at every size,
                              // 4 the warpgroup-MMA one (attn_wgmma.cu) where it applies
  int nvfp4_fused_path = 0;   // per-tensor fused quantizers: 0 auto, 1 cluster, 2 grid
  int topk_kernel = 0;        // dsv4::indexer_topk: 0 auto (rows from 64 rows), 1 the 8-CTA cluster per row,
                              // 2 one CTA per row (indexer_topk_rows.cu)
  int moe_gemv_rows = 0;      // MoE on the gemv kernel: token rows per pass, 0 auto (2 while T <= 8, else 8), 2, 8
  int gemv_pdl = 1;           // under pdl: the NVFP4 chain (gemv, the MoE kernels) with it too; 0 launches those
                              // without it, the other decode kernels keep it
  int gemv_pdl_rows = 8;      // under gemv_pdl: only calls of fewer token rows (M, the MoE's T) launch with it (the
                              // layer on an H100: B = 1 / 4 faster with it, B = 8 4-6% faster without, twice)
  int beside = 0;             // under pdl: 1 runs dsv4::nvfp4_fp32_linear_multi's fp32 kernel beside its gemv; 0 after
                              // it, as two ops would (off until an A/B shows it faster: its first form tied)
};

// The process's overrides (one instance inside libdsv4_ops.so).
Overrides& get();

}  // namespace dsv4_overrides

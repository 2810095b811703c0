// The extern "C" launchers of the CUDA kernels (defined in the .cu files named below, called by the *_bindings.cpp
// registrations): plain C signatures, no torch headers. Both sides include this header, so a definition that
// drifts from what the bindings call is a compile error instead of a silent ABI mismatch. (The NVFP4 GEMM and
// quantization launchers have their own C++ headers / declarations.)
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernel_limits.h"

// attn.cu
extern "C" int dsv4_attn_decode_mma_ok(int D);
extern "C" int dsv4_attn_decode_splits(int B, int H, int J, int num_sms, int use_mma, int* rows_per_split);
extern "C" cudaError_t dsv4_attn_decode_launch(const void* q, const void* kv, const int32_t* idx, int J1,
                                               const int32_t* idx2, int idx2_offset, const float* sink,
                                               int is_fp32, int B, int H, int N, int D, int J,
                                               int64_t kv_batch_stride, int kv_batch, float scale, float* ws_o,
                                               float* ws_ml, int nsplit, int rows_per_split, int use_mma,
                                               const float* out_rope, int rope_dim, void* out,
                                               cudaStream_t stream);

// attn_wgmma.cu (called by attn.cu's launcher)
extern "C" int dsv4_attn_partial_wgmma_ok(int D);
extern "C" cudaError_t dsv4_attn_partial_wgmma_launch(const void* q, const void* kv, const int32_t* idx, int J1,
                                                      const int32_t* idx2, int idx2_offset, int B, int H, int N,
                                                      int J, int64_t kv_batch_stride, int kv_batch, float scale,
                                                      float* ws_o, float* ws_ml, int nsplit, int rows_per_split,
                                                      int pdl, cudaStream_t stream);

// compressor.cu
extern "C" cudaError_t dsv4_compressor_decode_launch(const float* kv, const float* score, const float* ape,
                                                     const void* positions, int pos_i32, float* kv_state,
                                                     float* score_state, void* pooled, int pooled_kind, int B, int C,
                                                     int m, int R, int hd, int overlap, int by_pos, int kv_batch,
                                                     cudaStream_t stream);

// fp32_linear.cu
extern "C" cudaError_t dsv4_fp32_linear_launch(const void* x, int x_fp32, int M, int K, const void* const* w,
                                               int w_fp32, float* const* y, const int* n, int nseg,
                                               int num_sms, int beside, cudaStream_t stream);

// hadamard.cu
extern "C" int dsv4_hadamard_fp4_kernel_ok(int d);
extern "C" cudaError_t dsv4_hadamard_fp4_launch(const void* x, int x_fp32, const float* cs, void* out,
                                                int64_t vectors, int heads, int d, int rope_dim, float scale,
                                                cudaStream_t stream);

// indexer.cu
extern "C" int dsv4_indexer_max_topk();
// weights_round: 0 none, 1 bf16, 2 fp16 (each weight is rounded to it, then multiplied by weights_scale in fp32);
// kv_batch > 0: row b scores the keys of sequence b % kv_batch, else b's
extern "C" cudaError_t dsv4_indexer_score_topk_launch(const void* q, int q_is_fp32, const float* weights,
                                                      int weights_round, float weights_scale,
                                                      const uint8_t* codes, const uint8_t* scales,
                                                      const void* n_valid, int nv_is64, int B, int H, int N,
                                                      int kv_batch, int topk, uint32_t* keys_scratch, int32_t* out,
                                                      cudaStream_t stream);
// scores fp32 [R, N] contiguous, 1 <= topk <= min(N, dsv4_indexer_max_topk()) -> out int64 [R, topk]
extern "C" cudaError_t dsv4_indexer_topk_launch(const float* scores, int64_t R, int N, int topk, int64_t* out,
                                                cudaStream_t stream);

// indexer_topk_rows.cu: the same contract, one CTA per row (called by dsv4_indexer_topk_launch)
extern "C" cudaError_t dsv4_indexer_topk_rows_launch(const float* scores, int64_t R, int N, int topk, int64_t* out,
                                                     cudaStream_t stream);

// indexer_prefill.cu: q bf16 [B, S, H, D], w fp32 [B, S, H], k bf16 [B, T, D], n_visible int64 [B, S] (all
// contiguous, 16-byte aligned) -> out fp32 [B, S, T]; D = dsv4_indexer_prefill_head_dim(), H >= 1
extern "C" int dsv4_indexer_prefill_head_dim();
extern "C" cudaError_t dsv4_indexer_prefill_scores_launch(const void* q, const float* w, const void* k,
                                                          const int64_t* n_visible, float* out, int B, int S, int H,
                                                          int T, cudaStream_t stream);

// key_store.cu
extern "C" int dsv4_store_keys_kernel_ok(int D);
extern "C" cudaError_t dsv4_store_keys_launch(const void* keys, int keys_fp32, const void* positions, int pos_i32,
                                              int B, int D, int ratio, int n, int kv_batch, void* cache,
                                              uint8_t* codes, uint8_t* scales, cudaStream_t stream);

// mhc.cu
extern "C" cudaError_t dsv4_hc_sinkhorn_launch(const float* x, float* y, int64_t n, int hc, int iters, float eps,
                                               cudaStream_t stream);
extern "C" int dsv4_hc_pre_splits(int hc, int d);
extern "C" cudaError_t dsv4_hc_pre_launch(void* x, int x_kind, const void* fn, int fn_bf16, const float* scale,
                                          const float* base, const float* norm_w, int T, int hc, int d, int iters,
                                          float hc_eps, float norm_eps, float out_eps, float* ws, void* y,
                                          float* post, float* comb, const void* p_out, const void* p_res,
                                          const float* p_post, const float* p_comb, const void* p_ids, int ids64,
                                          int slots, int experts, int shared, cudaStream_t stream);

// norm_rope.cu
extern "C" cudaError_t dsv4_rms_norm_rope_launch(const void* x, int x_fp32, const float* w, const float* cs, void* out,
                                                 int64_t vectors, int heads, int d, int rope_dim, float eps,
                                                 int fp8_nope, cudaStream_t stream);
extern "C" cudaError_t dsv4_rms_norm_rope_store_launch(const void* x, int x_fp32, const float* w, const float* cs,
                                                       int64_t rows, int d, int rope_dim, float eps, int fp8_nope,
                                                       const void* positions, int pos_i32, int ratio, int offset,
                                                       int slots, void* cache, int64_t row_stride, int64_t kv_batch,
                                                       cudaStream_t stream);

// router.cu
extern "C" cudaError_t dsv4_router_topk_launch(const float* scores, const float* bias, int64_t n, int E, int k,
                                               int renormalize, float scale, int sqrt_softplus, float* weights,
                                               int64_t* indices, cudaStream_t stream);

// sample.cu
extern "C" int dsv4_sample_num_splits(int64_t B, int64_t V);
extern "C" cudaError_t dsv4_sample_launch(const float* logits, const float* temperature, const int64_t* top_k,
                                          const float* top_p, const int64_t* seed, const int64_t* offset,
                                          int64_t B, int64_t V, int splits, uint32_t* thresh, float* part_v,
                                          int* part_i, int64_t* out, cudaStream_t stream);

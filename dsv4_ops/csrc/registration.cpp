// The ONE schema table of the dsv4 namespace. Kernels register elsewhere with TORCH_LIBRARY_IMPL
// (cpu/*.cpp always, cuda/*.cpp when built with CUDA); fakes live in dsv4_ops/fakes/.
// Rules: outputs never alias inputs; ops that mutate (caches) take Tensor(a!) and return ().
// Every schema is documented in docs/ops.md.
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "kernel_limits.h"

// Exported so the Python module has a real link-time dependency on this library (otherwise
// --as-needed drops it and no op gets registered), and so callers can ask what was compiled in.
extern "C" __attribute__((visibility("default"))) int dsv4_ops_built_with_cuda() {
#ifdef DSV4_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

// The kernels' shape limits (kernel_limits.h) by name, for dsv4_ops/limits.py: a constant (value ignored), or
// whether a predicate takes `value` (1 / 0); -1 for an unknown name.
extern "C" __attribute__((visibility("default"))) int64_t dsv4_ops_kernel_limit(const char* name, int64_t value) {
  using namespace dsv4_limits;
  const std::string n(name ? name : "");
  if (n == "router_max_experts") return kRouterMaxExperts;
  if (n == "router_max_topk") return kRouterMaxTopk;
  if (n == "indexer_cuda_head_dim") return kIndexerCudaHeadDim;
  if (n == "indexer_cuda_max_heads") return kIndexerCudaMaxHeads;
  if (n == "indexer_cuda_max_topk") return kIndexerCudaMaxTopk;
  if (n == "norm_rope_cuda_max_dim") return kNormRopeCudaMaxDim;
  if (n == "hadamard_fp4_dim") return hadamard_fp4_dim_ok(value);
  if (n == "store_keys_dim") return store_keys_dim_ok(value);
  if (n == "attn_mma_dim") return attn_mma_dim_ok(value);
  return -1;
}

TORCH_LIBRARY(dsv4, m) {
  // ---- NVFP4 quantization ----
  // E2M1 codes (even element in the low nibble, sign bit 0x8) + one e4m3 scale per 16 contiguous elements +
  // an fp32 global scale in the ModelOpt dequant direction (amax / 2688), 0-d or one per row (x.shape[:-1]).
  // Bit-exact definition in docs/ops.md "## NVFP4 quantization". gate_up is [..., 2I] with gate/up interleaved
  // element-wise (gate_j at 2j, up_j at 2j+1).
  m.def("nvfp4_quantize(Tensor x, Tensor global_scale) -> (Tensor packed, Tensor block_scale)");
  m.def("nvfp4_dequantize(Tensor packed, Tensor block_scale, Tensor global_scale, ScalarType dtype) -> Tensor");
  m.def("fused_amax_quantize(Tensor x) -> (Tensor packed, Tensor block_scale, Tensor global_scale)");
  m.def("fused_amax_quantize_per_row(Tensor x) -> (Tensor packed, Tensor block_scale, Tensor global_scale)");
  m.def(
      "fused_deinterleave_amax_quantize(Tensor gate_up, Tensor? row_weight, float limit, bool per_row) "
      "-> (Tensor packed, Tensor block_scale, Tensor global_scale)");

  // ---- lightning indexer ----
  // Decode-time DeepSeek-V4 lightning indexer: score[b,i] = sum_h weights[b,h] * relu(q[b,h] . k[b,i]) over FP4
  // (E2M1 codes + UE8M0 block-32 scales) keys i < n_valid[b]; returns int32 [B, topk] indices sorted by
  // (score desc, index asc), -1 padded. The head weight used is float(weights.to(weights_dtype)) * weights_scale
  // (fp32; weights_dtype bf16 / fp16 or None): the model's rounding and scaling of weights_proj ride in the op.
  // With kv_batch > 0 row b scores the keys of sequence b % kv_batch (T tokens of kv_batch sequences, token-major:
  // a speculative step's verification). See docs/ops.md "## Indexer".
  m.def(
      "indexer_score_topk(Tensor q, Tensor weights, Tensor k_codes, Tensor k_scales, Tensor n_valid, int topk, "
      "float weights_scale=1.0, ScalarType? weights_dtype=None, int kv_batch=0) -> Tensor");
  // Prefill-time scores of the same indexer over a chunk of queries: out[b,s,t] = sum_h weights[b,s,h] *
  // relu(q[b,s,h] . keys[b,t]) (fp32; q / keys bf16 or fp32, one dtype), -inf where t >= n_visible[b,s].
  m.def("indexer_prefill_scores(Tensor q, Tensor weights, Tensor keys, Tensor n_visible) -> Tensor");
  // The top-k of such scores: int64 [..., topk] indices of the topk largest of each row of fp32 scores [..., N]
  // (topk <= N), in the decode op's order (score desc, index asc; -0 == +0): torch.topk of the int64 composite
  // (order-preserving score bits << 32 | N - 1 - index), the model's topk_indices, in one op.
  m.def("indexer_topk(Tensor scores, int topk) -> Tensor");

  // ---- sampler ----
  // Per-row greedy (temperature <= 0) or temperature / top-k (0 = off) / top-p (>= 1 = off) sampling with a
  // counter-based RNG keyed by (seed, offset): bump `offset` on device each step. Returns int64 [B].
  m.def(
      "sample(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, Tensor offset) "
      "-> Tensor");

  // ---- NVFP4 GEMM / MoE ----
  // Weights in the kernel layout of dsv4_model.nvfp4.repack_weight: codes uint8 [N, Kp/2] (Kp = K rounded up
  // to 128), scale bytes uint8 [N, Kp/16], fp32 0-d global scale (dequant direction). bf16 activations,
  // fp32 accumulation. See docs/ops.md "## NVFP4 GEMM / MoE".
  // out_dtype: bf16 (None), or fp32 / fp16 written straight from the fp32 sums (fp32: no rounding; a head's logits).
  m.def("nvfp4_linear(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_global_scale, ScalarType? out_dtype=None) "
        "-> Tensor");
  // G independent projections in one call (attention wo_a): out[..., g, :] = x[..., g, :] @ W_g^T, with
  // w_packed [G, N, Kp/2], w_scale [G, N, Kp/16], w_global_scale [G]; bf16 out [..., G, N].
  m.def("nvfp4_linear_grouped(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_global_scale) -> Tensor");
  // Several projections of the same input in one call (attention wq_a + wkv): out[i] = nvfp4_linear(x, W_i).
  m.def(
      "nvfp4_linear_multi(Tensor x, Tensor[] w_packed, Tensor[] w_scale, Tensor[] w_global_scale) -> Tensor[]");
  // nvfp4_linear_multi's outputs, then fp32_linear(x, fp32_weight)'s, of one x (attention decode: wq_a + wkv and
  // the compressors' / indexer's fp32-math projections). On CUDA under PDL the fp32 kernel runs beside the gemv.
  m.def(
      "nvfp4_fp32_linear_multi(Tensor x, Tensor[] w_packed, Tensor[] w_scale, Tensor[] w_global_scale, "
      "Tensor[] fp32_weight) -> Tensor[]");
  m.def(
      "nvfp4_linear_w4a4(Tensor x_packed, Tensor x_scale, Tensor x_global_scale, Tensor w_packed, "
      "Tensor w_scale, Tensor w_global_scale, ScalarType out_dtype) -> Tensor");
  m.def(
      "nvfp4_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, Tensor w13_scale, "
      "Tensor w13_global_scale, Tensor w2_packed, Tensor w2_scale, Tensor w2_global_scale, "
      "Tensor? shared_w13_packed, Tensor? shared_w13_scale, Tensor? shared_w13_global_scale, "
      "Tensor? shared_w2_packed, Tensor? shared_w2_scale, Tensor? shared_w2_global_scale, "
      "float swiglu_limit) -> Tensor");
  // nvfp4_moe's per-assignment expert outputs before the combine, bf16 [T*k + T*has_shared, d]: row t*k + j =
  // token t's slot j (routing weight applied), row T*k + t = its shared expert. nvfp4_moe == bf16(sum over the
  // local slots (0 <= id < E) in j order, + the shared row) in fp32. Rows of non-local ids: zeros on CPU,
  // unspecified (never written) on CUDA. Lets the consumer (decode's next hc_post_pre) do the sum, so the
  // combine kernel goes.
  m.def(
      "nvfp4_moe_rows(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, Tensor w13_scale, "
      "Tensor w13_global_scale, Tensor w2_packed, Tensor w2_scale, Tensor w2_global_scale, "
      "Tensor? shared_w13_packed, Tensor? shared_w13_scale, Tensor? shared_w13_global_scale, "
      "Tensor? shared_w2_packed, Tensor? shared_w2_scale, Tensor? shared_w2_global_scale, "
      "float swiglu_limit) -> Tensor");

  // ---- mHC ----
  // The hyper-connection mixing matrix of each token: softmax over the last dim of logits [..., hc, hc] (fp32),
  // + eps, then Sinkhorn normalisation: columns, then (iters - 1) x (rows, columns), each sum + eps. See
  // docs/ops.md "## mHC".
  m.def("hc_sinkhorn(Tensor logits, int iters, float eps) -> Tensor");
  // A token's hc residual streams x [..., hc, d] -> the sublayer input and the mixing weights, in one op (fp32
  // math): rs = rsqrt(mean(x^2) + norm_eps), mixes = (x_flat @ fn^T) * rs, pre = sigmoid(mixes[:hc] * scale[0] +
  // base[:hc]) + hc_eps, post = 2 * sigmoid(mixes[hc:2hc] * scale[1] + base), comb = hc_sinkhorn(mixes[2hc:] *
  // scale[2] + base), y = sum_h pre_h x_h (x's dtype), then with norm_weight the sublayer's RMSNorm of y (out_eps).
  // Returns (y [..., d], post fp32 [..., hc], comb fp32 [..., hc, hc]). See docs/ops.md "## mHC".
  m.def(
      "hc_pre(Tensor x, Tensor fn, Tensor scale, Tensor base, Tensor? norm_weight, int iters, float hc_eps, "
      "float norm_eps, float out_eps) -> (Tensor, Tensor, Tensor)");
  // The decode step's hc_post of one sublayer fused with the next hc_pre: h [..., hc, d] = the new streams, new
  // stream j = post_j * out + sum_i comb[i, j] * res_i (fp32, rounded to out's dtype; out [..., d], res [..., hc,
  // d], post / comb fp32 from the previous hc_pre), then hc_pre(h, ...). Returns (h, y, post, comb).
  // With out_ids (int32 / int64 [T, k]) out is the MoE's uncombined rows [T*k (+ T), d] (nvfp4_moe_rows' layout:
  // token t's slot j at t*k + j, the shared expert's row at T*k + t) and the sublayer output is their sum, as the
  // MoE's combine kernel forms it (fp32 in slot order over ids in [0, out_experts), then the shared row, rounded
  // once): the decode step drops that combine launch per layer.
  m.def(
      "hc_post_pre(Tensor out, Tensor res, Tensor post, Tensor comb, Tensor fn, Tensor scale, Tensor base, "
      "Tensor? norm_weight, int iters, float hc_eps, float norm_eps, float out_eps, Tensor? out_ids=None, "
      "int out_experts=0) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---- fp32 projections ----
  // out[i] = float(x) @ float(weight[i])^T in fp32 (x [..., K] bf16 / fp16 / fp32, weight[i] [N_i, K] bf16 or
  // fp32, out[i] fp32 [..., N_i]): the projections official runs in fp32 (compressors, mHC mixes), up to 8 that
  // read the same x in one call. See docs/ops.md "## fp32 linear".
  m.def("fp32_linear(Tensor x, Tensor[] weight) -> Tensor[]");

  // ---- decode attention ----
  // One query token per row against the cache rows it lists: q [B, H, D], kv [B' >= B, N, D] (q's dtype), idx
  // int32 / int64 [B, J] (rows of kv[b]; entries outside [0, N) are skipped), sink fp32 [H]. out [B, H, D] (q's
  // dtype) = sum_j p_j kv[b, idx[b, j]] with p = softmax over (scale * q . k_j for the listed rows, sink[h]), fp32
  // math. DeepSeek-V4's sliding window + compressed / top-k entries with one shared K = V head. See docs/ops.md
  // "## Decode attention".
  // With out_rope (fp32 [B, rope_dim / 2, (cos, sin)] of each row's position) the output's trailing rope_dim dims
  // are then rotated back (inverse RoPE, as the attention output before wo_a) and rounded again.
  // With idx2 (int32 / int64 [B, J2]) the list goes on with rows idx2 + idx2_offset where idx2 >= 0 (negative: no
  // row): a CSA layer passes its per-step window rows and the indexer's top-k as they are (no row-list kernel).
  // With kv_batch > 0 query row b reads kv[b % kv_batch]: T tokens of kv_batch sequences at once, token-major (a
  // speculative step's verification attends its tokens in one call).
  m.def(
      "sparse_attn_decode(Tensor q, Tensor kv, Tensor idx, Tensor sink, float scale, Tensor? out_rope=None, "
      "int rope_dim=0, Tensor? idx2=None, int idx2_offset=0, int kv_batch=0) -> Tensor");

  // ---- MoE routing ----
  // Per row of scores fp32 [N, E]: the k experts with the largest scores + bias (NaN above every number, ties to
  // the lower index), as int64 indices [N, k] in that order, and their unbiased scores fp32 [N, k], divided by
  // their sum when renormalize, times scale. With sqrt_softplus the input is the router's logits and the scores
  // are sqrt(softplus(logits)) (V4's score function; softplus as torch's, threshold 20), computed in the kernel
  // (one Inductor kernel less per decode layer). See docs/ops.md "## Router".
  m.def(
      "router_topk(Tensor scores, Tensor? bias, int k, bool renormalize, float scale, bool sqrt_softplus=False) -> "
      "(Tensor weights, Tensor indices)");

  // ---- compressor decode ----
  // One decode step of a KV compressor's gated pooling, per row b < B = kv.size(0): score + ape[pos % m] and kv
  // go into state slot (m with overlapping windows, else 0) + pos % m, pooled[b] = the
  // softmax-over-rows weighted sum of the window's state (overlap: rows < m read columns [0, hd), rows >= m
  // [hd, 2hd)), then with overlap, when (pos + 1) % m == 0, rows [m, 2m) are copied onto rows [0, m). kv / score
  // fp32 [B, C], ape fp32 [m, C], positions int64 / int32 [B], states fp32 [>= B, m or 2m, C], pooled [B, hd]
  // fp32, or bf16 / fp16 (the fp32 pooling rounded once); overlap when hd = C / 2. States of more rows than that
  // are indexed by position (token p in row p mod R, the window read by position, no shift). See docs/ops.md
  // "## Compressor decode". kv_batch > 0: the B rows are T tokens of kv_batch sequences, token-major (row
  // t * kv_batch + b), each advancing state row b in order (a speculative step's verification in one launch).
  m.def(
      "compressor_decode(Tensor kv, Tensor score, Tensor ape, Tensor positions, Tensor(a!) kv_state, "
      "Tensor(b!) score_state, Tensor(c!) pooled, int kv_batch=0) -> ()");

  // ---- RMSNorm + RoPE ----
  // Per vector x[r, h] (x [rows, heads, d], bf16 / fp32): y = RMSNorm (fp32, times weight fp32 [d] if given)
  // rounded to x's dtype; its trailing rope_dim dims rotated as interleaved pairs by cs[r] (fp32 [rows,
  // rope_dim / 2, (cos, sin)]) and rounded again; with fp8_nope the leading d - rope_dim dims rounded to FP8 e4m3
  // with a power-of-two scale per 64 (the simulated KV quantization). See docs/ops.md "## RMSNorm + RoPE".
  m.def("rms_norm_rope(Tensor x, Tensor? weight, Tensor cs, float eps, int rope_dim, bool fp8_nope) -> Tensor");
  // The same per vector of x [rows, d], written into cache [>= rows, S, d] (x's dtype) at row r, slot: ratio 0 (the
  // sliding window) offset + positions[r] % slots for every row; ratio >= 1 (compressed entries) offset +
  // min(positions[r] / ratio, slots - 1) only where (positions[r] + 1) % ratio == 0, other rows untouched. The
  // decode step's kv and compressed-entry stores without their index_put kernels. kv_batch > 0: row r writes cache
  // row r % kv_batch (T tokens of kv_batch sequences, token-major: a verification's tokens in one call).
  m.def(
      "rms_norm_rope_store(Tensor x, Tensor? weight, Tensor cs, float eps, int rope_dim, bool fp8_nope, "
      "Tensor positions, int ratio, int offset, int slots, Tensor(a!) cache, int kv_batch=0) -> ()");

  // ---- indexer Hadamard + FP4 ----
  // Per vector x[r, h] (x [rows, heads, d], bf16 / fp32, d a power of two >= 32): with rope_dim > 0 its trailing
  // rope_dim dims rotated as interleaved pairs by cs[r] (fp32 [rows, rope_dim / 2, (cos, sin)]) and rounded to x's
  // dtype; then the Walsh-Hadamard butterfly in fp32 (strides 1, 2, 4, ...) times the fp32 d^-0.5, rounded; then
  // FP4 e2m1 with a power-of-two scale per 32, dequantized and rounded. The indexer's simulated FP4 queries / keys
  // (dsv4_model.quant_sim.indexer_fake_quant after apply_rope). See docs/ops.md "## Hadamard + FP4".
  m.def("hadamard_fp4(Tensor x, Tensor? cs, int rope_dim) -> Tensor");

  // ---- indexer key store ----
  // For each row b < B whose compression window closed at this token ((pos + 1) % ratio == 0, positions >= 0):
  // slot = min(pos / ratio, n - 1); kv_cache[b, slot] = keys[b] (bf16 / fp32 [B, D], D % 32 == 0) and its FP4
  // form (E2M1 codes uint8 [D / 2], UE8M0 block-32 exponents uint8 [D / 32], as the indexer cache stores keys)
  // into k_codes[b, slot] / k_scales[b, slot]; with kv_batch > 0 into cache row b % kv_batch (T tokens of kv_batch
  // sequences, token-major). See docs/ops.md "## Indexer key store".
  m.def(
      "indexer_store_keys(Tensor keys, Tensor positions, int ratio, Tensor(a!) kv_cache, Tensor(b!) k_codes, "
      "Tensor(c!) k_scales, int kv_batch=0) -> ()");

  // ---- decode state ----
}

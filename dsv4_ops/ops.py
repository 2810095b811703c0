"""Typed wrappers of every `torch.ops.dsv4.*` op, called with keywords past the first inputs (docs/ops.md has
each op's numerics). They look the op up at every call and pass every argument by position, so a test that
patches `torch.ops.dsv4.<name>` sees the calls; torch.compile traces straight through them."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

_ops = torch.ops.dsv4


# ---- NVFP4 quantization
def nvfp4_quantize(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    return _ops.nvfp4_quantize(x, global_scale)


def nvfp4_dequantize(packed: Tensor, block_scale: Tensor, global_scale: Tensor, *, dtype: torch.dtype) -> Tensor:
    return _ops.nvfp4_dequantize(packed, block_scale, global_scale, dtype)


def fused_amax_quantize(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _ops.fused_amax_quantize(x)


def fused_amax_quantize_per_row(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _ops.fused_amax_quantize_per_row(x)


def fused_deinterleave_amax_quantize(gate_up: Tensor, *, row_weight: Tensor | None, limit: float,
                                     per_row: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _ops.fused_deinterleave_amax_quantize(gate_up, row_weight, limit, per_row)


# ---- NVFP4 GEMM / MoE (weights in the kernel layout of dsv4_model.quant.nvfp4)
def nvfp4_linear(x: Tensor, *, w_packed: Tensor, w_scale: Tensor, w_global_scale: Tensor,
                 out_dtype: torch.dtype | None = None) -> Tensor:
    return _ops.nvfp4_linear(x, w_packed, w_scale, w_global_scale, out_dtype)


def nvfp4_linear_grouped(x: Tensor, *, w_packed: Tensor, w_scale: Tensor, w_global_scale: Tensor) -> Tensor:
    return _ops.nvfp4_linear_grouped(x, w_packed, w_scale, w_global_scale)


def nvfp4_linear_multi(x: Tensor, *, w_packed: Sequence[Tensor], w_scale: Sequence[Tensor],
                       w_global_scale: Sequence[Tensor]) -> list[Tensor]:
    return _ops.nvfp4_linear_multi(x, list(w_packed), list(w_scale), list(w_global_scale))


def nvfp4_fp32_linear_multi(x: Tensor, *, w_packed: Sequence[Tensor], w_scale: Sequence[Tensor],
                            w_global_scale: Sequence[Tensor], fp32_weight: Sequence[Tensor]) -> list[Tensor]:
    """nvfp4_linear_multi(x, ...)'s outputs, then fp32_linear(x, fp32_weight)'s."""
    return _ops.nvfp4_fp32_linear_multi(x, list(w_packed), list(w_scale), list(w_global_scale), list(fp32_weight))


def nvfp4_linear_w4a4(x_packed: Tensor, x_scale: Tensor, x_global_scale: Tensor, *, w_packed: Tensor,
                      w_scale: Tensor, w_global_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return _ops.nvfp4_linear_w4a4(x_packed, x_scale, x_global_scale, w_packed, w_scale, w_global_scale, out_dtype)


def _moe_args(x, topk_ids, topk_weights, w13, w2, shared13, shared2, swiglu_limit):
    s13 = tuple(shared13) if shared13 is not None else (None, None, None)
    s2 = tuple(shared2) if shared2 is not None else (None, None, None)
    return (x, topk_ids, topk_weights, *w13, *w2, *s13, *s2, swiglu_limit)


def nvfp4_moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, *, w13: Sequence[Tensor], w2: Sequence[Tensor],
              shared_w13: Sequence[Tensor] | None, shared_w2: Sequence[Tensor] | None,
              swiglu_limit: float) -> Tensor:
    """w13 / w2 / shared_*: (packed, scale, global_scale) triples; shared None: no shared expert."""
    return _ops.nvfp4_moe(*_moe_args(x, topk_ids, topk_weights, w13, w2, shared_w13, shared_w2, swiglu_limit))


def nvfp4_moe_rows(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, *, w13: Sequence[Tensor],
                   w2: Sequence[Tensor], shared_w13: Sequence[Tensor] | None, shared_w2: Sequence[Tensor] | None,
                   swiglu_limit: float) -> Tensor:
    """nvfp4_moe without its combine: bf16 rows [T*k (+ T), d] (docs/ops.md)."""
    return _ops.nvfp4_moe_rows(*_moe_args(x, topk_ids, topk_weights, w13, w2, shared_w13, shared_w2, swiglu_limit))


# ---- indexer, sampler, router
def indexer_score_topk(q: Tensor, weights: Tensor, *, k_codes: Tensor, k_scales: Tensor, n_valid: Tensor, topk: int,
                       weights_scale: float = 1.0, weights_dtype: torch.dtype | None = None,
                       kv_batch: int = 0) -> Tensor:
    return _ops.indexer_score_topk(q, weights, k_codes, k_scales, n_valid, topk, weights_scale, weights_dtype,
                                   kv_batch)


def indexer_prefill_scores(q: Tensor, weights: Tensor, *, keys: Tensor, n_visible: Tensor) -> Tensor:
    return _ops.indexer_prefill_scores(q, weights, keys, n_visible)


def indexer_topk(scores: Tensor, topk: int) -> Tensor:
    return _ops.indexer_topk(scores, topk)


def sample(logits: Tensor, *, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
           offset: Tensor) -> Tensor:
    return _ops.sample(logits, temperature, top_k, top_p, seed, offset)


def router_topk(scores: Tensor, *, bias: Tensor | None, k: int, renormalize: bool, scale: float,
                sqrt_softplus: bool = False) -> tuple[Tensor, Tensor]:
    return _ops.router_topk(scores, bias, k, renormalize, scale, sqrt_softplus)


# ---- mHC
def hc_sinkhorn(logits: Tensor, *, iters: int, eps: float) -> Tensor:
    return _ops.hc_sinkhorn(logits, iters, eps)


def hc_pre(x: Tensor, *, fn: Tensor, scale: Tensor, base: Tensor, norm_weight: Tensor | None, iters: int,
           hc_eps: float, norm_eps: float, out_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _ops.hc_pre(x, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps)


def hc_post_pre(out: Tensor, res: Tensor, post: Tensor, comb: Tensor, *, fn: Tensor, scale: Tensor, base: Tensor,
                norm_weight: Tensor | None, iters: int, hc_eps: float, norm_eps: float, out_eps: float,
                out_ids: Tensor | None = None, out_experts: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """out_ids / out_experts: `out` is nvfp4_moe_rows' rows of these top-k ids, summed here."""
    return _ops.hc_post_pre(out, res, post, comb, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps,
                            out_ids, out_experts)


# ---- projections, attention, norms
def fp32_linear(x: Tensor, weights: Sequence[Tensor]) -> list[Tensor]:
    return _ops.fp32_linear(x, list(weights))


def sparse_attn_decode(q: Tensor, kv: Tensor, idx: Tensor, *, sink: Tensor, scale: float,
                       out_rope: Tensor | None = None, rope_dim: int = 0, idx2: Tensor | None = None,
                       idx2_offset: int = 0, kv_batch: int = 0) -> Tensor:
    return _ops.sparse_attn_decode(q, kv, idx, sink, scale, out_rope, rope_dim, idx2, idx2_offset, kv_batch)


def rms_norm_rope(x: Tensor, *, weight: Tensor | None, cs: Tensor, eps: float, rope_dim: int,
                  fp8_nope: bool) -> Tensor:
    return _ops.rms_norm_rope(x, weight, cs, eps, rope_dim, fp8_nope)


def rms_norm_rope_store(x: Tensor, *, weight: Tensor | None, cs: Tensor, eps: float, rope_dim: int, fp8_nope: bool,
                        positions: Tensor, ratio: int, offset: int, slots: int, cache: Tensor,
                        kv_batch: int = 0) -> None:
    """Writes row r into cache[r] in place (cache[r % kv_batch] with kv_batch > 0): at slot offset + positions[r] %
    slots (ratio 0: a sliding window), or at offset + min(positions[r] // ratio, slots - 1) where (positions[r] + 1)
    % ratio == 0 (a closed entry)."""
    _ops.rms_norm_rope_store(x, weight, cs, eps, rope_dim, fp8_nope, positions, ratio, offset, slots, cache,
                             kv_batch)


def hadamard_fp4(x: Tensor, *, cs: Tensor | None, rope_dim: int) -> Tensor:
    return _ops.hadamard_fp4(x, cs, rope_dim)


# ---- cache writes (in place)
def compressor_decode(kv: Tensor, score: Tensor, *, ape: Tensor, positions: Tensor, kv_state: Tensor,
                      score_state: Tensor, pooled: Tensor, kv_batch: int = 0) -> None:
    _ops.compressor_decode(kv, score, ape, positions, kv_state, score_state, pooled, kv_batch)


def indexer_store_keys(keys: Tensor, *, positions: Tensor, ratio: int, kv_cache: Tensor, k_codes: Tensor,
                       k_scales: Tensor, kv_batch: int = 0) -> None:
    _ops.indexer_store_keys(keys, positions, ratio, kv_cache, k_codes, k_scales, kv_batch)

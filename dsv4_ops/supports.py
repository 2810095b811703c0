"""Whether an op's kernels take a call, one predicate per op with a gate: a caller asks `supports.<op>(...)` and runs
the tensor-op form where the answer is no. The answers restate the op's own checks (csrc/<family>_checks.h) and
the kernel limits (dsv4_ops.limits), plus one measured threshold (FUSED_ATTN_MAX_ROWS). Plain Python on shapes,
dtypes and those values, so torch.compile traces them (a call into the library could not be traced). Most take
dtypes and widths, not tensors: their answers depend on nothing else, so the model asks them once, when it allocates
its caches, instead of in every decode step."""
from __future__ import annotations

import torch

from dsv4_ops import overrides
from dsv4_ops.limits import LIMITS

_BF16_FP32 = (torch.bfloat16, torch.float32)


def rms_norm_rope(dtype: torch.dtype, dim: int, rope_dim: int) -> bool:
    """x [rows, heads, dim] of dtype: bf16 / fp32, dim and rope_dim multiples of 4, dim within the CUDA kernel's
    width."""
    return dtype in _BF16_FP32 and not dim % 4 and not rope_dim % 4 and dim <= LIMITS.norm_rope_cuda_max_dim


def rms_norm_rope_store(dtype: torch.dtype, cache: torch.Tensor) -> bool:
    """Where rms_norm_rope takes x of dtype: the cache must have x's dtype and be contiguous (the op writes rows in
    place)."""
    return cache.dtype == dtype and cache.is_contiguous()


def hadamard_fp4(dtype: torch.dtype, dim: int) -> bool:
    """x [..., dim] of dtype: bf16 / fp32 at a width the kernel has a transform for."""
    return dtype in _BF16_FP32 and dim in LIMITS.hadamard_fp4_dims


def indexer_store_keys(dtype: torch.dtype, dim: int) -> bool:
    """keys [B, dim] of dtype: bf16 / fp32 at a width the packing kernel takes."""
    return dtype in _BF16_FP32 and dim in LIMITS.store_keys_dims


def indexer_score_topk(device: torch.device, head_dim: int, heads: int, topk: int) -> bool:
    """The CUDA kernel's head width, head count and top-k limits; the CPU kernel takes any model's indexer."""
    if device.type == "cuda":
        return (head_dim == LIMITS.indexer_cuda_head_dim and heads <= LIMITS.indexer_cuda_max_heads
                and topk <= LIMITS.indexer_cuda_max_topk)
    return device.type == "cpu"


def indexer_prefill_scores(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The CUDA kernel (bf16 queries / keys of DeepSeek-V4's head width) where the model calls the op; on the CPU
    the torch form (a batched matmul) is faster than the op's loop kernel (the reference it is tested against)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and head_dim == LIMITS.indexer_cuda_head_dim


def indexer_topk(device: torch.device, topk: int) -> bool:
    """The CUDA kernel's top-k limit (its winners sorted in one CTA's shared memory); on the CPU torch.topk of the
    composite (the model's topk_indices) is faster than the op's per-row sort (the reference it is tested against)."""
    return device.type == "cuda" and topk <= LIMITS.indexer_cuda_max_topk


def router_topk(scores: torch.Tensor, k: int) -> bool:
    """scores [N, E]: E experts and top-k within the kernel's limits; the op has no backward."""
    return (k <= LIMITS.router_max_topk and scores.shape[-1] <= LIMITS.router_max_experts
            and not (torch.is_grad_enabled() and scores.requires_grad))


def hc_pre(fn: torch.Tensor) -> bool:
    """fn [(2 + hc) * hc, hc * d]: the mixing weight in bf16 / fp32 (dsv4::hc_pre's check)."""
    return fn.dtype in _BF16_FP32


def hc_post_pre(out_dtype: torch.dtype, h_dtype: torch.dtype, fn: torch.Tensor) -> bool:
    """Where hc_pre takes fn: the sublayer output folded into the streams must have the streams' dtype (dtypes, not
    tensors: the Transformer asks before the output exists)."""
    return out_dtype == h_dtype and hc_pre(fn)


def compressor_decode_pooled(dtype: torch.dtype) -> bool:
    """The dtypes the op rounds its pooled output to (else the caller takes fp32 and rounds itself)."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16)


def sparse_attn_decode(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """The op reads kv in q's dtype."""
    return kv_dtype == q_dtype


def sparse_attn_decode_out_rope(rope_dim: int) -> bool:
    """The combine kernel applies the output's inverse RoPE for rope_dim a positive multiple of 4."""
    return rope_dim > 0 and rope_dim % 4 == 0


def sparse_attn_decode_tensor_cores(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the op runs its tensor-core partial kernel for q of dtype and head_dim (the CUDA binding's rule),
    unless the attn_kernel debug override forces the CUDA-core one (sparse_attn_decode_simt)."""
    return dtype == torch.bfloat16 and head_dim in LIMITS.attn_mma_dims


def sparse_attn_decode_simt() -> bool:
    """Whether the attn_kernel debug override forces the op's CUDA-core partial kernel (the binding reads the same
    override at each launch; it may change between steps, so a decode step asks once, when it is built)."""
    return overrides.current().attn_kernel == "simt"


# Measured on the H200 (bench/RESULTS.md, bench_attn_decode.py): the op's CUDA-core partial kernel (fp32, or the
# attn_kernel="simt" override) beats the tensor-op form only while batch x listed rows stays within this; its
# tensor-core kernel beats it at every measured size.
FUSED_ATTN_MAX_ROWS = 4 * 640

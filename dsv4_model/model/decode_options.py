"""How the decode step is built: `DecodeOptions` (chosen when a DecodeRunner is built, read when the step is traced)
and, per fused decode op, whether it applies: the shapes the op's kernels take (the limits the library reports).

The decode step runs each fused op (one launch instead of the several Inductor kernels of the tensor-op steps it
replaces, the faster one measured on the H200: bench/RESULTS.md) wherever its kernels take the shapes; elsewhere,
and in prefill and training, the tensor-op form runs. Two debug overrides remain, for bisecting and A/B runs
(`scripts/gpu_check.sh switches`): the whole mHC chain as tensor ops, and the attention's form. Each gives the
shipped logits up to summation order (tests/test_decode_options.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dsv4_ops import overrides
from dsv4_ops.limits import LIMITS

ATTENTION_MODES = ("auto", "fused", "torch")


@dataclass(frozen=True)
class DecodeOptions:
    hc_pre: bool = True  # mHC at decode as dsv4::hc_pre / hc_post_pre (an NVFP4 MoE's rows folded into the latter)
    attention: str = "auto"  # dsv4::sparse_attn_decode where faster ("auto"), always ("fused"), never ("torch")

    def __post_init__(self):
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"DecodeOptions.attention must be one of {ATTENTION_MODES}, got {self.attention!r}")

    @classmethod
    def parse(cls, text: str) -> "DecodeOptions":
        """"norm_rope=0,attention=torch" -> DecodeOptions (for command lines; "" = the defaults)."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        kw = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in fields:
                raise ValueError(f"decode option {item!r}: expected NAME=VALUE with NAME one of {', '.join(fields)}")
            if name == "attention":
                kw[name] = value
            elif value in ("0", "1"):
                kw[name] = value == "1"
            else:
                raise ValueError(f"decode option {item!r}: the value must be 0 or 1")
        return cls(**kw)


DEFAULT = DecodeOptions()


def norm_rope(x: torch.Tensor, rope_dim: int) -> bool:
    """dsv4::rms_norm_rope for x [rows, heads, d] (decode)."""
    d = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float32) and not d % 4 and not rope_dim % 4
            and d <= LIMITS.norm_rope_cuda_max_dim)


def norm_rope_store(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """dsv4::rms_norm_rope_store writing x's normalised rows into cache (instead of index_put kernels)."""
    return cache.dtype == x.dtype and cache.is_contiguous()


def hadamard(x: torch.Tensor) -> bool:
    """dsv4::hadamard_fp4 for the indexer's queries / keys x [..., d] (the same bits as the tensor ops)."""
    return x.dtype in (torch.bfloat16, torch.float32) and x.shape[-1] in LIMITS.hadamard_fp4_dims


def key_store(keys: torch.Tensor) -> bool:
    """dsv4::indexer_store_keys (instead of the packing kernels and three index_put kernels)."""
    return keys.dtype in (torch.bfloat16, torch.float32) and keys.shape[-1] in LIMITS.store_keys_dims


# dsv4::sparse_attn_decode's CUDA partial kernels: the tensor-core one (bf16, LIMITS.attn_mma_dims) beats the
# tensor-op form at every measured size; the CUDA-core one (fp32, or the attn_kernel="simt" override) only while
# batch x listed rows <= FUSED_ATTN_MAX_ROWS (bench/RESULTS.md, bench_attn_decode.py).
FUSED_ATTN_MAX_ROWS = 4 * 640


def attn_tensor_cores(q: torch.Tensor) -> bool:
    """Whether dsv4::sparse_attn_decode runs its tensor-core partial kernel for q (the CUDA binding's rule, which
    reads the same attn_kernel debug override, dsv4_ops.overrides)."""
    return (q.dtype == torch.bfloat16 and q.shape[-1] in LIMITS.attn_mma_dims
            and overrides.current().attn_kernel != "simt")


def decode_attention(opts: DecodeOptions, batch: int, rows: int, q: torch.Tensor) -> bool:
    """dsv4::sparse_attn_decode (one op instead of a gather, two GEMMs per key set, masks and a softmax) for a
    batch attending `rows` rows each (shapes are static when the step is traced)."""
    if opts.attention == "torch":
        return False
    return opts.attention == "fused" or attn_tensor_cores(q) or batch * rows <= FUSED_ATTN_MAX_ROWS

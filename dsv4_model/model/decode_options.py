"""How the decode step is built: `DecodeOptions`, chosen when a DecodeRunner is built and read when the step is
traced.

The decode step runs each fused op (one launch instead of the several Inductor kernels of the tensor-op steps it
replaces, the faster one measured on the H200: bench/RESULTS.md) wherever its kernels take the call
(`dsv4_ops.supports`); elsewhere, and in prefill and training, the tensor-op form runs. Two debug overrides remain,
for bisecting and A/B runs (`scripts/gpu_check.sh switches`): the whole mHC chain as tensor ops, and the
attention's form. Each gives the shipped logits up to summation order (tests/test_decode_options.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dsv4_ops import supports

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
        """"hc_pre=0,attention=torch" -> DecodeOptions (for command lines; "" = the defaults)."""
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

    def fused_attention(self, batch: int, rows: int, q: torch.Tensor, kv: torch.Tensor) -> bool:
        """Whether decode attends with dsv4::sparse_attn_decode (one op instead of a gather, two GEMMs per key set,
        masks and a softmax) for a batch attending `rows` rows each of kv (shapes are static when the step is
        traced): where the op takes q / kv and, under "auto", where it is the faster form."""
        if self.attention == "torch" or not supports.sparse_attn_decode(q, kv):
            return False
        return self.attention == "fused" or supports.sparse_attn_decode_faster(batch, rows, q)


DEFAULT = DecodeOptions()


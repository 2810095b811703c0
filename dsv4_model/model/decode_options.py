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

ATTENTION_MODES = ("auto", "fused", "torch")


@dataclass(frozen=True)
class DecodeOptions:
    hc_pre: bool = True  # mHC at decode as dsv4::hc_pre / hc_post_pre (an NVFP4 MoE's rows folded into the latter)
    # dsv4::sparse_attn_decode where faster ("auto"), always ("fused"), never ("torch"): Attention.fused_attention
    attention: str = "auto"

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


DEFAULT = DecodeOptions()


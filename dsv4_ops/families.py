"""The op families of the schema table (csrc/registration.cpp), each with its ops.

A family keeps its files under its own name: csrc/<family>_checks.h, csrc/cpu/<family>.cpp,
csrc/cuda/<family>.cu + <family>_bindings.cpp, fakes/<family>.py, reference/<family>.py, tests/test_<family>.py
(tests/test_op_families.py checks all of it against the schema table). The loader uses the op names to refuse a
stale library (one built before an op of this table existed).
"""
from __future__ import annotations

FAMILIES: dict[str, tuple[str, ...]] = {
    "nvfp4_quant": ("nvfp4_quantize", "nvfp4_dequantize", "fused_amax_quantize", "fused_amax_quantize_per_row",
                    "fused_deinterleave_amax_quantize"),
    "indexer": ("indexer_score_topk", "indexer_prefill_scores", "indexer_topk"),
    "sample": ("sample",),
    "nvfp4_gemm": ("nvfp4_linear", "nvfp4_linear_grouped", "nvfp4_linear_multi", "nvfp4_fp32_linear_multi",
                   "nvfp4_linear_w4a4", "nvfp4_moe", "nvfp4_moe_rows"),
    "mhc": ("hc_sinkhorn", "hc_pre", "hc_post_pre"),
    "fp32_linear": ("fp32_linear",),
    "attn": ("sparse_attn_decode",),
    "router": ("router_topk",),
    "compressor": ("compressor_decode",),
    "norm_rope": ("rms_norm_rope", "rms_norm_rope_store"),
    "hadamard": ("hadamard_fp4",),
    "key_store": ("indexer_store_keys",),
}

OP_NAMES: tuple[str, ...] = tuple(op for ops in FAMILIES.values() for op in ops)

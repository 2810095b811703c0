"""Tensor-name tables: HF transformers names <-> official names, routed-expert stacking, and the
storage format each official tensor has in the released checkpoint (DeepSeek's V4 release; ModelOpt's NVFP4 one)."""

from __future__ import annotations

import re

# ---------------------------------------------------------------------------------------------
# HF transformers (deepseek_v4, 5.23) -> official.
# `save_pretrained` writes official-style names under a `model.` prefix with a few renames; HF's
# in-memory module names (what `model.state_dict()` gives) differ more. Both are accepted.
# ---------------------------------------------------------------------------------------------

_HF_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed.weight",
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}

# Suffixes after `layers.N.` (or `mtp.N.`). Saved-format names that are already official pass through.
_HF_BLOCK_SUFFIX = {
    # save_pretrained renames
    "attn.norm.weight": "attn.kv_norm.weight",
    # in-memory names
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    # HF's fused expert tensors: down_proj [E, d, I] is our stacked w2; gate_up_proj [E, 2I, d] is
    # cat(w1, w3) along dim 1 and gets the pseudo-name FUSED_W13 (split by the loader).
    "mlp.experts.down_proj": "ffn.experts.w2",
    "mlp.experts.gate_up_proj": "ffn.experts.w13",
}

FUSED_W13 = "ffn.experts.w13"

_BLOCK_RE = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.(.+)$")


def hf_to_official_name(key: str) -> str:
    """Official name for an HF deepseek_v4 tensor name (saved or in-memory form). Unknown names are
    returned unchanged (minus a `model.` prefix on blocks) so the caller reports them as unexpected."""
    if key in _HF_TOP_LEVEL:
        return _HF_TOP_LEVEL[key]
    m = _BLOCK_RE.match(key)
    if m is None:
        return key
    kind, idx, rest = m.groups()
    return f"{kind}.{idx}.{_HF_BLOCK_SUFFIX.get(rest, rest)}"


_OFFICIAL_TO_HF_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def official_to_hf_name(name: str) -> str:
    """The name transformers 5.23 `save_pretrained` writes for an official main-model tensor (per-expert
    form). HF has no MTP module, so `mtp.*` names have no HF equivalent."""
    if name in _OFFICIAL_TO_HF_TOP:
        return _OFFICIAL_TO_HF_TOP[name]
    m = _BLOCK_RE.match(name)
    if m is None or m.group(1) != "layers":
        raise KeyError(f"no HF name for {name!r}")
    _, idx, rest = m.groups()
    if rest == "attn.kv_norm.weight":
        rest = "attn.norm.weight"
    return f"model.layers.{idx}.{rest}"


def checkpoint_key(name: str, layout: str) -> str:
    """The key a checkpoint of `layout` stores official (per-expert) tensor `name` under, for messages: HF's saved
    name (`model.mtp.*` for a DSpark module, as a converter that keeps it writes), else `name` itself."""
    if layout != "hf":
        return name
    if name.startswith("mtp."):
        return "model." + name
    try:
        return official_to_hf_name(name)
    except KeyError:
        return name


# ---------------------------------------------------------------------------------------------
# Routed experts: checkpoint `P.ffn.experts.E.wK.weight` <-> model's stacked `P.ffn.experts.wK`.
# ---------------------------------------------------------------------------------------------

_EXPERT_RE = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_STACKED_RE = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")


def split_expert_name(name: str) -> tuple[str, int] | None:
    """`layers.3.ffn.experts.7.w2.weight` -> (`layers.3.ffn.experts.w2`, 7); None for other names."""
    m = _EXPERT_RE.match(name)
    if m is None:
        return None
    return f"{m.group(1)}.{m.group(3)}", int(m.group(2))


def is_stacked_expert_name(name: str) -> bool:
    return _STACKED_RE.match(name) is not None


def expert_name(stacked: str, index: int) -> str:
    m = _STACKED_RE.match(stacked)
    if m is None:
        raise KeyError(f"{stacked!r} is not a stacked expert name")
    return f"{m.group(1)}.{index}.{m.group(2)}.weight"


# ---------------------------------------------------------------------------------------------
# Storage of each tensor in the official release: "fp8" (e4m3 + 128x128 E8M0 scales),
# "fp4" (MXFP4 routed experts), "bf16", "f32", "i64".
# ---------------------------------------------------------------------------------------------

_FP8_SUFFIXES = (
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight",
    "e_proj.weight", "h_proj.weight",
    "main_proj.weight",  # DSpark stage 0 (docs/dspark.md)
)
# (DSpark's markov_w2 / confidence head are fp32 parameters in the reference inference code)
_F32_RE = re.compile(r"(^|\.)(hc_(attn|ffn|head)_(fn|base|scale)|attn\.attn_sink|compressor\.ape|ffn\.gate\.bias"
                     r"|markov_head\.markov_w2\.weight|confidence_head\.proj\.weight)$")


def official_storage(name: str) -> str:
    """Storage format of an official (per-expert) tensor name in the released checkpoint."""
    if _EXPERT_RE.match(name):
        return "fp4"
    if name.endswith("ffn.gate.tid2eid"):
        return "i64"
    if _F32_RE.search(name):
        return "f32"
    if any(name == s or name.endswith("." + s) for s in _FP8_SUFFIXES):
        return "fp8"
    return "bf16"

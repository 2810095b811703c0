"""Recognise a DeepSeek-V4.1 config, so it is refused in one line instead of failing on missing fields or tensor
shapes: V4.1 is a different architecture (docs/v41.md), not a V4 refresh."""

from __future__ import annotations

from typing import Any

V41_MODEL_TYPES = ("deepseek_v41",)
# keys only V4.1 configs carry (HF and inference names): cross-layer KV / index reuse, the two-level index, Engram
V41_KEYS = ("kv_source_layer_ids", "index_source_layer_ids", "kv_source_layers", "index_source_layers",
            "candidate_block_size", "candidate_topk_blocks", "candidate_source_layer_id")


def _markers(d: dict[str, Any]) -> list[str]:
    found = []
    if d.get("model_type") in V41_MODEL_TYPES:
        found.append(f"model_type {d['model_type']}")
    archs = d.get("architectures")
    if isinstance(archs, list) and any(isinstance(a, str) and a.startswith("DeepseekV41") for a in archs):
        found.append(f"architectures {archs}")
    keys = [k for k in d if k in V41_KEYS or k.startswith("engram_")]
    if keys:
        found.append("V4.1-only keys " + ", ".join(sorted(keys)[:3]) + (", ..." if len(keys) > 3 else ""))
    return found


def v41_refusal(d: dict[str, Any]) -> str | None:
    """The one-line refusal for config dict `d` if it is a DeepSeek-V4.1 config (top level or nested
    `text_config`), else None."""
    if not isinstance(d, dict):
        return None
    found = _markers(d)
    text = d.get("text_config")
    if isinstance(text, dict):
        found += [f"text_config {m}" for m in _markers(text)]
    if not found:
        return None
    return (f"DeepSeek-V4.1 ({found[0]}) is a different architecture (Engram tables, CSA2 with cross-layer KV "
            "reuse) that dsv4 does not run yet; see docs/v41.md")

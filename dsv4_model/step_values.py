"""Values a decode step computes once and every layer reads: the RoPE rows of the step's positions (per table and
window offset), the attended rows of the layers without an indexer, the indexers' visible-entry counts.

Each goes into a small model buffer (Transformer.setup_runtime, `scratch_buffer_names`) that the layers' ops read
in place: a plain tensor would be recomputed by Inductor into a fresh copy for every custom op that reads it (one
kernel per layer and use)."""

from __future__ import annotations

import torch


def decode_rope(table: torch.Tensor, slots: tuple[torch.Tensor, list[int]] | None = None,
                nvis_slots: tuple[torch.Tensor, list[int]] | None = None, attn_slots: dict | None = None) -> dict:
    """A decode step's view of one RoPE table: the rows it reads, gathered once per step and offset and shared
    by every layer using the table (one gather kernel per step instead of one per layer and use), the step's
    attended row list of the layers without an indexer, and the visible compressed entries per ratio. slots:
    (buffer [n, max_batch, rope_dim / 2, 2], the offsets m of its n slots): rows of those offsets are written
    there (see Transformer.setup_runtime for why); nvis_slots: (int64 buffer [n, max_batch], the ratios) the
    same for visible_entries; attn_slots: {(window, ratio, entries): int32 buffer [1, max_batch, J]} the same
    for the attended rows."""
    return {"table": table, "rows": {}, "attn_rows": {}, "slots": slots, "n_vis": {}, "nvis_slots": nvis_slots,
            "attn_slots": attn_slots or {}}


def in_slot(slots, key, value: torch.Tensor) -> torch.Tensor:
    """value written into its slot of a step's scratch buffer (and that slot returned), where there is one."""
    if slots is None or key not in slots[1] or slots[0].dtype != value.dtype:
        return value
    out = slots[0][slots[1].index(key), :value.shape[0]]
    out.copy_(value)
    return out


def rope_rows(rope: dict, positions: torch.Tensor, m: int = 1) -> torch.Tensor:
    """table[(positions + 1 - m).clamp(min=0)]: the token's own row (m = 1) or the first row of the m-token window
    it closes; cached in the step's rope dict (the positions are the step's)."""
    rows = rope["rows"]
    if m not in rows:
        rows[m] = in_slot(rope.get("slots"), m, rope["table"][(positions + 1 - m).clamp(min=0)])
    return rows[m]


def visible_entries(rope: dict, positions: torch.Tensor, m: int) -> torch.Tensor:
    """(positions + 1) // m, the compressed entries a decode token sees; once per step and ratio (in the step's
    scratch slot where there is one: a plain value would be recomputed by Inductor for each op reading it)."""
    vis = rope["n_vis"]
    if m not in vis:
        vis[m] = in_slot(rope.get("nvis_slots"), m, (positions + 1) // m)
    return vis[m]

"""What a decode step computes once and every layer reads (`DecodeStep`): the RoPE rows of the step's positions
(per table and window offset), the indexers' visible-entry counts, the attended rows of the layers without an
indexer.

Each goes into a small model buffer (`StepScratch`, the Transformer's `step_scratch`) that the layers' ops read
in place: a plain tensor would be recomputed by Inductor into a fresh copy for every custom op that reads it (one
kernel per layer and use). The RoPE rows are all written when the step is built, before any layer reads the
buffer: a slot written after a read of another one reached its reader as a fresh copy too. The other two are
computed on first use (a model may not need them: an indexer that scores unpacked keys needs no visible count)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dsv4_ops import supports

from dsv4_model.model.decode_options import DecodeOptions

Slots = tuple[torch.Tensor, list]  # (scratch buffer [n, rows, ...], the key of each of its n slots)


def in_slot(slots: Slots | None, key, value: torch.Tensor) -> torch.Tensor:
    """value written into its slot of a step's scratch buffer (and that slot returned), where there is one."""
    if slots is None or key not in slots[1] or slots[0].dtype != value.dtype:
        return value
    out = slots[0][slots[1].index(key), :value.shape[0]]
    out.copy_(value)
    return out


class AttnRows(nn.Module):
    """The scratch buffer of one attended-rows key (ring slots, ratio, entries): [1, decode rows, rows] int32."""

    def __init__(self, key: tuple, max_batch: int, device=None):
        super().__init__()
        self.key = key
        w, r, n = key
        self.register_buffer("rows", torch.zeros(1, max_batch, w + (n if r else 0), dtype=torch.int32, device=device),
                             persistent=False)


class StepScratch(nn.Module):
    """A decode step's scratch buffers (written by the step before its layers read them, not state carried
    between steps) for up to `rows` decode rows: the RoPE rows of each table ([offsets, rows, rope_dim / 2, 2]
    fp32, one slot per window offset m), the visible-entry counts ([ratios, rows] int64, one slot per ratio) and
    the attended rows of each key (`attn`, one `AttnRows` per key, sorted)."""

    def __init__(self, rows: int, rope_dim: int, compress_ratios: list[int], attn_keys: list[tuple],
                 device=None):
        super().__init__()
        self.rows = rows
        ratios = sorted({r for r in compress_ratios if r})
        self.rope_offsets = {"main": [1], "compress": [1] + ratios}
        self.vis_ratios = ratios
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("rope_main", torch.zeros(1, rows, rope_dim // 2, 2, **f32), persistent=False)
        self.register_buffer("rope_compress", torch.zeros(1 + len(ratios), rows, rope_dim // 2, 2, **f32),
                             persistent=False)
        self.register_buffer("n_vis", torch.zeros(max(len(ratios), 1), rows, dtype=torch.long, device=device),
                             persistent=False)
        # a multi-token step's stacked positions (a decode step's are its input)
        self.register_buffer("positions", torch.zeros(1, rows, dtype=torch.long, device=device), persistent=False)
        self.attn = nn.ModuleList(AttnRows(key, rows, device) for key in attn_keys)

    @property
    def attn_keys(self) -> list[tuple]:
        return [a.key for a in self.attn]

    def slots(self) -> tuple[dict[str, Slots], Slots, dict[tuple, Slots]]:
        """DecodeStep's rope_slots, nvis_slots and attn_slots in these buffers."""
        return ({"main": (self.rope_main, self.rope_offsets["main"]),
                 "compress": (self.rope_compress, self.rope_offsets["compress"])},
                (self.n_vis, self.vis_ratios),
                {a.key: (a.rows, [a.key]) for a in self.attn})


class DecodeStep:
    """One decode step's shared values, built by Transformer.decode_step and handed to every layer.

    positions [B] int64: each row's position. options: how the step is built. tables: {kind: RoPE table
    [max_seq_len, rope_dim / 2, 2]}; rope_slots: {kind: (buffer, offsets m)}; nvis_slots: (buffer, ratios);
    attn_slots: {(ring slots, ratio, entries): (buffer, [key])}. Without slots ({}, None, {}) every value is a
    tensor of its own (a multi-token decode holds several steps at once). attn_simt: whether the attn_kernel debug
    override forces the attention op's CUDA-core kernel (Attention.fused_attention), read once per step."""

    def __init__(self, positions: torch.Tensor, options: DecodeOptions, tables: dict[str, torch.Tensor],
                 rope_slots: dict[str, Slots], nvis_slots: Slots | None, attn_slots: dict[tuple, Slots]):
        self.positions, self.options = positions, options
        self.attn_simt = supports.sparse_attn_decode_simt()
        self._tables = tables
        self._nvis_slots, self._attn_slots = nvis_slots, attn_slots
        self._rope = {kind: {m: in_slot(slots, m, self._gather(tables[kind], m)) for m in slots[1]}
                      for kind, slots in rope_slots.items()}
        self._visible: dict[int, torch.Tensor] = {}
        self._rows: dict[tuple, torch.Tensor] = {}

    def _gather(self, table: torch.Tensor, m: int) -> torch.Tensor:
        return table[(self.positions + 1 - m).clamp(min=0)]

    def cs(self, kind: str, m: int = 1) -> torch.Tensor:
        """table[(positions + 1 - m).clamp(min=0)] of RoPE table `kind`: the token's own row (m = 1) or the first
        row of the m-token window it closes."""
        rows = self._rope.setdefault(kind, {})
        if m not in rows:  # an offset without a scratch slot
            rows[m] = self._gather(self._tables[kind], m)
        return rows[m]

    def visible(self, m: int) -> torch.Tensor:
        """(positions + 1) // m: the compressed entries of ratio m a decode token sees."""
        if m not in self._visible:
            self._visible[m] = in_slot(self._nvis_slots, m, (self.positions + 1) // m)
        return self._visible[m]

    def shared_rows(self, key: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The attended row list of key (window, ratio, entries), computed by the first layer that asks."""
        if key not in self._rows:
            self._rows[key] = in_slot(self._attn_slots.get(key), key, compute())
        return self._rows[key]


class TokenSteps(list):
    """The T DecodeSteps of a multi-token decode (Transformer.decode_tokens: rows t * B + b hold token t of row b,
    at positions + t), and `stacked`: one DecodeStep over all T * B rows at their own positions, where the layers
    project, select and attend the T tokens in one call each (Attention.decode_tokens); built on first use, then
    shared. scratch: a StepScratch of T * B rows or more for the stacked step's positions and values (as a decode
    step's: computed once, read in place by every layer's ops); None: tensors of their own."""

    def __init__(self, positions: torch.Tensor, T: int, options: DecodeOptions, tables: dict[str, torch.Tensor],
                 scratch: StepScratch | None = None):
        super().__init__(DecodeStep(positions + t, options, tables, {}, None, {}) for t in range(T))
        self._tables = tables
        self._scratch = scratch
        self._stacked: DecodeStep | None = None

    @property
    def stacked(self) -> DecodeStep:
        if self._stacked is None:
            positions = torch.cat([st.positions for st in self])
            sc = self._scratch
            if sc is None:
                self._stacked = DecodeStep(positions, self[0].options, self._tables, {}, None, {})
            else:
                positions = in_slot((sc.positions, [0]), 0, positions)
                self._stacked = DecodeStep(positions, self[0].options, self._tables, *sc.slots())
        return self._stacked

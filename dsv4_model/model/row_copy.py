"""Whole cache rows moved between rows of every row-state buffer (the caches, compressor states, DSpark's rings):
the scheduler's prefill placement (swap), its prefix snapshots (copy) and the rows it protects during a decode
step (save / restore).

A 43-layer model has ~230 such buffers; a gather + scatter per buffer is ~460 small kernels and as many host
round trips per move (3.7 ms for one flash43 row on an H100, 87x one flat copy of its bytes: bench/RESULTS.md).
So the rows move as lists of row views through torch's multi-tensor copy (`torch._foreach_copy_`: a few fused
launches per dtype on CUDA), and what does not change between moves (the dtype groups, each row's views) is made
once per buffer list. Every source row is read before any row is written, as a gather + scatter would: a plan
whose destination is another pair's source reads that row as it was before the plan.
"""
from __future__ import annotations

from collections import defaultdict

import torch


def _check(src: list[int], dst: list[int]) -> None:
    if len(src) != len(dst) or len(set(dst)) != len(dst):
        raise ValueError(f"row moves: src {src} and dst {dst} must pair up, each destination once")


class RowMoves:
    """Row moves over one model's row-state buffers. The caches below are remade whenever the buffer list given
    differs (by identity) from the last one: moving or reallocating the model's buffers cannot leave stale views."""

    def __init__(self):
        self._bufs: list[torch.Tensor] = []
        self._groups: list[tuple[list[torch.Tensor], list[int]]] = []  # (one dtype's buffers, numel of a row of each)
        self._views: dict[int, list[list[torch.Tensor]]] = {}  # row -> per group: its flattened row views

    def _sync(self, buffers: list[torch.Tensor]) -> None:
        if len(buffers) == len(self._bufs) and all(a is b for a, b in zip(buffers, self._bufs)):
            return
        groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for buf in buffers:
            groups[(buf.device, buf.dtype)].append(buf)
        self._bufs = list(buffers)
        self._groups = [(g, [b[0].numel() for b in g]) for g in groups.values()]
        self._views = {}

    def _rows(self, rows: list[int]) -> list[list[torch.Tensor]]:
        """Per group: the flattened views of rows `rows` of each buffer (row-major over rows)."""
        per_row = []
        for r in rows:
            v = self._views.get(r)
            if v is None:
                v = self._views[r] = [[b[r].view(-1) for b in g] for g, _ in self._groups]
            per_row.append(v)
        return [[t for v in per_row for t in v[gi]] for gi in range(len(self._groups))]

    def _held(self, gi: int, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One allocation holding k rows of group gi, and its pieces in _rows order."""
        g, sizes = self._groups[gi]
        flat = torch.empty(k * sum(sizes), dtype=g[0].dtype, device=g[0].device)
        return flat, list(flat.split(sizes * k))

    @torch.no_grad()
    def copy(self, buffers: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        """Row src[i] -> row dst[i] of each buffer, every source read before any row is written."""
        _check(src, dst)
        if not src:
            return
        self._sync(buffers)
        chained = bool(set(src) & set(dst))
        sources, dests = self._rows(src), self._rows(dst)
        for gi in range(len(self._groups)):
            s = sources[gi]
            if chained:  # a destination is also a source: hold the sources first
                _, s = self._held(gi, len(src))
                torch._foreach_copy_(s, sources[gi])
            torch._foreach_copy_(dests[gi], s)

    @torch.no_grad()
    def swap(self, buffers: list[torch.Tensor], a: list[int], b: list[int]) -> None:
        """Exchange rows a[i] and b[i] of each buffer (the rows of a and b disjoint)."""
        _check(a, b)
        if len(set(a)) != len(a) or set(a) & set(b):
            raise ValueError(f"row swaps: rows {a} and {b} must be distinct and not overlap")
        if not a:
            return
        self._sync(buffers)
        ra, rb = self._rows(a), self._rows(b)
        for gi in range(len(self._groups)):
            _, held = self._held(gi, len(a))
            torch._foreach_copy_(held, ra[gi])
            torch._foreach_copy_(ra[gi], rb[gi])
            torch._foreach_copy_(rb[gi], held)

    @torch.no_grad()
    def save(self, buffers: list[torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
        """Copies of rows `rows` of each buffer, one tensor per dtype group (restore puts them back)."""
        if not rows:
            return []
        self._sync(buffers)
        views, saved = self._rows(rows), []
        for gi in range(len(self._groups)):
            flat, held = self._held(gi, len(rows))
            torch._foreach_copy_(held, views[gi])
            saved.append(flat)
        return saved

    @torch.no_grad()
    def restore(self, buffers: list[torch.Tensor], rows: list[int], saved: list[torch.Tensor]) -> None:
        """Rows `rows` of each buffer back to what save(buffers, rows) returned."""
        if not rows and not saved:
            return
        self._sync(buffers)
        if len(saved) != len(self._groups):
            raise ValueError(f"restore: {len(saved)} saved groups for {len(self._groups)} buffer dtypes")
        views = self._rows(rows)
        for gi, flat in enumerate(saved):
            sizes = self._groups[gi][1] * len(rows)
            if flat.numel() != sum(sizes):
                raise ValueError(f"restore: saved rows of {flat.numel()} elements for {sum(sizes)}")
            torch._foreach_copy_(views[gi], list(flat.split(sizes)))

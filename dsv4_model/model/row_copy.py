"""Whole cache rows moved between rows of every row-state buffer (the caches, compressor states, DSpark's rings):
the scheduler's prefill placement (swap) and its prefix snapshots (copy).

A 43-layer model has ~260 such buffers; a gather + scatter per buffer is ~520 small kernels and as many host
round trips per move (3.6 ms for one flash43 row on an H100, 87x one flat copy of its bytes: bench/RESULTS.md).
So the rows move as lists of row views through torch's multi-tensor copy (`torch._foreach_copy_`: a few fused
launches per dtype on CUDA). Every source row is read before any row is written, as a gather + scatter would:
a plan whose destination is another pair's source reads that row as it was before the plan.
"""
from __future__ import annotations

from collections import defaultdict

import torch


def _by_dtype(buffers: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The buffers grouped by (device, dtype): one multi-tensor launch per group."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for buf in buffers:
        groups[(buf.device, buf.dtype)].append(buf)
    return list(groups.values())


def _rows(group: list[torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
    return [buf[r] for r in rows for buf in group]


def _check(src: list[int], dst: list[int]) -> None:
    if len(src) != len(dst) or len(set(dst)) != len(dst):
        raise ValueError(f"row moves: src {src} and dst {dst} must pair up, each destination once")


@torch.no_grad()
def copy_rows_of_(buffers: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Row src[i] -> row dst[i] of each buffer, every source read before any row is written."""
    _check(src, dst)
    if not src:
        return
    chained = bool(set(src) & set(dst))
    for group in _by_dtype(buffers):
        sources = _rows(group, src)
        if chained:  # a destination is also a source: hold the sources first
            held = [torch.empty_like(v) for v in sources]
            torch._foreach_copy_(held, sources)
            sources = held
        torch._foreach_copy_(_rows(group, dst), sources)


@torch.no_grad()
def swap_rows_of_(buffers: list[torch.Tensor], a: list[int], b: list[int]) -> None:
    """Exchange rows a[i] and b[i] of each buffer (the rows of a and b disjoint)."""
    _check(a, b)
    if set(a) & set(b):
        raise ValueError(f"row swaps: rows {a} and {b} must not overlap")
    for group in _by_dtype(buffers):
        ra, rb = _rows(group, a), _rows(group, b)
        held = [torch.empty_like(v) for v in ra]
        torch._foreach_copy_(held, ra)
        torch._foreach_copy_(ra, rb)
        torch._foreach_copy_(rb, held)


@torch.no_grad()
def save_rows(buffers: list[torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
    """Copies of rows `rows` of each buffer (restore_rows_ puts them back)."""
    held = []
    for group in _by_dtype(buffers):
        views = _rows(group, rows)
        copies = [torch.empty_like(v) for v in views]
        torch._foreach_copy_(copies, views)
        held += copies
    return held


@torch.no_grad()
def restore_rows_(buffers: list[torch.Tensor], rows: list[int], held: list[torch.Tensor]) -> None:
    """Rows `rows` of each buffer back to what save_rows(buffers, rows) returned."""
    views = [v for group in _by_dtype(buffers) for v in _rows(group, rows)]
    if len(views) != len(held):
        raise ValueError(f"restore_rows_: {len(held)} saved rows for {len(views)} row views")
    torch._foreach_copy_(views, held)

"""Host values onto the device without waiting for it.

`torch.tensor(values, device="cuda")` and `cpu_tensor.to("cuda")` copy from pageable memory, which makes the host
wait for every kernel queued on the stream: called while a decode step runs (the scheduler plans the next
iteration then: rows to swap, compressor states to protect, a prefill chunk's tokens), the host stalls until that
step ends and the GPU then idles while the host finishes planning. A pinned staging copy goes asynchronously in
stream order; torch's caching host allocator keeps the staging buffer until its copy has run."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device`; a host tensor going to a GPU is copied without a sync: a pageable or strided one through a
    contiguous pinned staging copy (t may change afterwards; a strided pinned source would make the copy stage
    through pageable memory again), a contiguous pinned one directly (as any non-blocking copy, it must keep its
    values until the stream has run the copy: the scheduler's pinned double buffers are rewritten two iterations
    later, after that iteration's event)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or torch.compiler.is_compiling():
        return t.to(device)
    if not (t.is_pinned() and t.is_contiguous()):
        t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device, non_blocking=True)


def device_longs(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """An int64 tensor of `values` on `device` (row indices, positions), copied as to_device does."""
    return to_device(torch.tensor(values, dtype=torch.long), device)

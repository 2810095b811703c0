"""What gets exported: the model's decode step and prefill, with the caches as EXPLICIT inputs.

The model keeps its caches as preallocated module buffers. For export they must not be baked into the
package as constants (each loaded copy would own private, invisible state), so ``CacheAsInputs`` detaches
them from the module while tracing and plugs the caller's tensors in instead: every cache becomes a graph
input that the graph mutates in place (``user_inputs_to_mutate`` after functionalization).

Calling convention of every entry (flattened, the order the C++ runner passes tensors):
  decode:  tokens int64[B], positions int64[B], *caches  -> logits float32[B, V]
  prefill: tokens int64[B, S], lengths int64[B], *caches -> logits float32[B, V] at position lengths[b]-1
           (from position 0; rows are right-padded to S, valid below lengths[b])
  prefill_chunk: tokens int64[B, C], lengths int64[B], start int64[B], *caches -> the same, row b's tokens at
           positions start[b] .. (a chunk of a longer prompt: the caches hold the row's earlier positions; one
           graph for any start, the padding may run past max_seq_len)
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Callable, Iterator, Sequence

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    name: str  # buffer name in the model (e.g. "layers.0.attn.kv_cache")
    shape: tuple[int, ...]
    dtype: torch.dtype

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @staticmethod
    def from_json(d: dict) -> "CacheSpec":
        return CacheSpec(d["name"], tuple(d["shape"]), getattr(torch, d["dtype"]))


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf


def cache_names(model: nn.Module, probe: Callable[[], None] | None = None) -> list[str]:
    """Names of the model's state buffers, i.e. the buffers a decode step writes.

    A model may say so itself (``model.cache_buffer_names()``). Otherwise the buffers whose in-place version
    counter moves while ``probe()`` runs (an eager decode step) are the caches; they are restored afterwards.
    """
    if hasattr(model, "cache_buffer_names"):
        return list(model.cache_buffer_names())
    if probe is None:
        raise ValueError("cannot tell the caches apart: give a probe() that runs one decode step")
    buffers = dict(model.named_buffers())
    before = {n: b._version for n, b in buffers.items()}
    saved = {n: b.detach().clone() for n, b in buffers.items()}
    try:
        with torch.no_grad():
            probe()
    finally:
        changed = [n for n, b in buffers.items() if b._version != before[n]]
        with torch.no_grad():
            for n in changed:
                buffers[n].copy_(saved[n])
    return changed


def cache_specs(model: nn.Module, names: Sequence[str]) -> list[CacheSpec]:
    out = []
    for n in names:
        owner, leaf = _owner(model, n)
        b = owner._buffers[leaf]
        if b is None:
            raise ValueError(f"cache buffer {n!r} is not set")
        out.append(CacheSpec(n, tuple(b.shape), b.dtype))
    return out


@contextlib.contextmanager
def caches_detached(model: nn.Module, names: Sequence[str]) -> Iterator[list[torch.Tensor]]:
    """Unregisters the cache buffers (so export does not lift them as constants); yields the originals."""
    owners = [_owner(model, n) for n in names]
    originals = [o._buffers[leaf] for o, leaf in owners]
    for o, leaf in owners:
        o._buffers[leaf] = None
    try:
        yield originals
    finally:
        for (o, leaf), t in zip(owners, originals):
            o._buffers[leaf] = t


class CacheAsInputs(nn.Module):
    """forward(inputs, caches) = fn(model, *inputs) with ``caches`` standing in for the model's cache buffers."""

    def __init__(self, model: nn.Module, names: Sequence[str], fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self._names = list(names)
        self._owners = [_owner(model, n) for n in names]
        self._fn = fn

    def forward(self, inputs: tuple[torch.Tensor, ...], caches: tuple[torch.Tensor, ...]):
        saved = [o._buffers[leaf] for o, leaf in self._owners]
        for (o, leaf), t in zip(self._owners, caches):
            o._buffers[leaf] = t
        try:
            return self._fn(self.model, *inputs)
        finally:
            for (o, leaf), t in zip(self._owners, saved):
                o._buffers[leaf] = t


def call_decode(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model.decode_step(tokens, positions)


def call_prefill(model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A dsv4 Transformer's prefill with its float experts on the static-shape path: the per-expert loop has
    data-dependent shapes, which export cannot trace (NVFP4 experts run one op either way)."""
    if "static_moe" in inspect.signature(model.prefill).parameters:
        return model.prefill(tokens, lengths, static_moe=True)
    return model.prefill(tokens, lengths)


def call_prefill_chunk(model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor,
                       start: torch.Tensor) -> torch.Tensor:
    """A dsv4 Transformer's prefill of a chunk at per-row starts, its shapes those of any start (span =
    max_seq_len); float experts on the static-shape path as in call_prefill."""
    return model.prefill(tokens, lengths, static_moe=True, start=start, span=model.max_seq_len)

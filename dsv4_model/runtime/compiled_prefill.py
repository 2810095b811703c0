"""Compiled prefill chunks for the scheduler (`Engine.prefill_at`): one torch.compile graph (fullgraph, static shapes)
per (row bucket, token bucket), or with `regional` one per (distinct layer, bucket).

A chunk of rows [:B] x S tokens is padded to the buckets (rows: the decode buckets 1, 2, 4, ..., max_batch_size;
tokens: 16, 32, ..., max_seq_len) and run as `Transformer.prefill(start=tensor, span=max_seq_len, static_moe=True)`,
whose shapes then depend on the buckets only (docs/architecture.md, "Compiled prefill"). Padded rows have length 0
at position 1: a row with no tokens at a start > 0 is left exactly as it is (its caches and compressor states are
cache rows the scheduler may hold: another request's), and padded tokens lie past every row's length (never read
by a valid query). Span max_seq_len is what the eager tensor-start prefill uses too.

Graphs compile lazily, on the first chunk of their buckets: up to len(row buckets) x len(token buckets) of them
(63 at 64 rows x 4096 positions), far more than a server should compile before it answers. `prepare()` compiles
chosen buckets ahead (a call with every length 0: it writes nothing, so it may run while rows hold sequences).

Float experts run their static-shape gather path (the per-expert loop has data-dependent shapes), which
materializes each token's k experts' weights: a bucket whose gather would exceed `moe_gather_bytes` runs eagerly
instead (the caller's fallback). NVFP4 experts are one static-shape op: no limit.
"""
from __future__ import annotations

import bisect
import contextlib
from typing import Callable

import torch

from dsv4_model.runtime.compiled import batch_buckets, progress

MIN_TOKENS = 16  # smallest token bucket: fewer graphs; a 1-token chunk pads to 16
MOE_GATHER_BYTES = 4 << 30  # float experts: the gathered expert weights a compiled chunk may hold at once
PAD_START = 1  # padded rows' position: > 0, so a length-0 row keeps its compressor state (0 would restart it)


def token_buckets(limit: int, least: int = MIN_TOKENS) -> list[int]:
    """least, 2 x least, ... below limit, then limit itself."""
    out, s = [], least
    while s < limit:
        out.append(s)
        s *= 2
    return out + [limit]


def _chunk(model, tokens, lengths, start, span: int):
    """One prefill chunk (module-level: every engine compiles this one code object, a variant per bucket)."""
    return model.prefill(tokens, lengths, static_moe=True, start=start, span=span)


def _layer_prefill(layer, h, ids, lengths, rope, at, static_moe: bool):
    """One decoder layer's prefill of a chunk (what regional compilation compiles; module-level, so that every
    layer shares one code object and, where layers differ only in weights and caches, one compiled variant)."""
    return layer.prefill(h, ids, lengths, rope, at, static_moe)


def gather_bytes_per_token(model) -> int:
    """Bytes of expert weights the float experts' static path gathers per token (the largest layer's), 0 without
    float experts."""
    from dsv4_model.model.moe import MoE

    out = 0
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if getattr(moe.backend, "quantized", True):
            continue
        ex = moe.experts
        per = sum(w[0].numel() * w.element_size() for w in (ex.w1, ex.w2, ex.w3))
        out = max(out, moe.gate.topk * per)
    return out


class CompiledPrefill:
    """Runs prefill chunks of `model` (a Transformer) through per-bucket compiled graphs.

    backend: torch.compile backend ("inductor"; CPU tests use "aot_eager"). log: progress lines while a bucket
    compiles. moe_gather_bytes: see the module docstring. regional: compile one decoder layer at a time (the
    embedding, the head and the last-token gather run eagerly): layers that differ only in weights and caches share
    a compiled variant, so a bucket's compile time grows with the kinds of layers, not the depth (a whole-chunk
    graph of a 43-layer model compiles every layer anew)."""

    def __init__(self, model, *, backend: str = "inductor", log: Callable[[str], None] | None = None,
                 moe_gather_bytes: int = MOE_GATHER_BYTES, regional: bool = False):
        self.model = model
        self.log = log
        self.span = int(model.max_seq_len)
        self.row_buckets = batch_buckets(int(model.max_batch_size))
        self.token_buckets = token_buckets(self.span, min(MIN_TOKENS, self.span))
        per_token = gather_bytes_per_token(model)
        self.max_tokens = None if per_token == 0 else moe_gather_bytes // per_token  # rows x tokens per graph
        self._ready: set[tuple[int, int]] = set()
        # Dynamo counts variants per code object; every engine compiles `_chunk` (a variant per bucket and model):
        # leave room for them (past the limit it would fall back to eager silently, or fail under fullgraph)
        n = len(self.row_buckets) * len(self.token_buckets)
        self.regional = bool(regional)
        if self.regional:  # a variant per distinct layer, per bucket
            n *= len(model.layers)
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 4 * n)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 16 * n)
        from dsv4_ops.inductor import register_inductor_fallbacks

        register_inductor_fallbacks()
        if self.regional:
            self._layer_fn = torch.compile(_layer_prefill, fullgraph=True, dynamic=False, backend=backend)
            self._fn = self._regional_chunk
        else:
            self._fn = torch.compile(_chunk, fullgraph=True, dynamic=False, backend=backend)

    def _regional_chunk(self, model, tokens, lengths, start, span: int):
        """_chunk with each layer's prefill compiled and the rest eager."""
        return model.prefill(tokens, lengths, static_moe=True, start=start, span=span, layer_call=self._layer_fn)

    @property
    def compiled(self) -> int:
        """Buckets compiled so far."""
        return len(self._ready)

    def bucket(self, rows: int, tokens: int) -> tuple[int, int] | None:
        """The (rows, tokens) buckets of a chunk, or None where it runs eagerly (the float experts' gather bound)."""
        if not 1 <= rows <= self.row_buckets[-1] or not 1 <= tokens <= self.span:
            raise ValueError(f"prefill chunk of {rows} rows x {tokens} tokens: must be within max_batch_size="
                             f"{self.row_buckets[-1]} x max_seq_len={self.span}")
        b = self.row_buckets[bisect.bisect_left(self.row_buckets, rows)]
        s = self.token_buckets[bisect.bisect_left(self.token_buckets, tokens)]
        if self.max_tokens is not None and b * s > self.max_tokens:
            return None
        return b, s

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor) -> torch.Tensor | None:
        """tokens [B, S], lengths [B], start [B] (device tensors, as Engine.prefill_at's) -> fp32 logits [B, V] at
        each row's last token, or None where the chunk's bucket runs eagerly."""
        B, S = tokens.shape
        key = self.bucket(B, S)
        if key is None:
            return None
        b, s = key
        if (b, s) != (B, S):
            t = tokens.new_zeros(b, s)
            t[:B, :S] = tokens
            n = lengths.new_zeros(b)
            n[:B] = lengths
            st = start.new_full((b,), PAD_START)
            st[:B] = start
            tokens, lengths, start = t, n, st
        with self._progress(key):
            out = self._fn(self.model, tokens, lengths, start, self.span)
        self._ready.add(key)
        return out[:B]

    def prepare(self, rows: int, tokens: int) -> None:
        """Compile the bucket of a chunk of `rows` x `tokens` now (every row length 0: nothing is written)."""
        key = self.bucket(rows, tokens)
        if key is None or key in self._ready:
            return
        b, s = key
        dev = self.model.device
        self(torch.zeros(b, s, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
             torch.full((b,), PAD_START, dtype=torch.long, device=dev))

    def prepare_all(self, rows: int, tokens: int) -> None:
        """Every bucket up to that of `rows` x `tokens` (the scheduler's rows and max_prefill_tokens)."""
        top_b, top_s = (self.row_buckets[bisect.bisect_left(self.row_buckets, rows)],
                        self.token_buckets[bisect.bisect_left(self.token_buckets, min(tokens, self.span))])
        for b in (r for r in self.row_buckets if r <= top_b):
            for s in (t for t in self.token_buckets if t <= top_s):
                self.prepare(b, s)

    def _progress(self, key: tuple[int, int]):
        if self.log is None or key in self._ready:
            return contextlib.nullcontext()
        return progress(self.log, f"compiling the prefill chunk for {key[0]} rows x {key[1]} tokens")

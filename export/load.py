"""Loads a dsv4 ``.pt2`` package in a fresh process and runs it: ``ExportedEngine``.

Order matters: the op library is loaded first (the package calls ``dsv4::*`` ops through the dispatcher and
its load fails with "Could not find schema" otherwise), then the package metadata is checked against this
process (torch version, device, GPU arch, op schemas, optionally the model config) so a mismatch is a clear
error instead of a crash inside dlopen, and only then is each entry loaded with ``aoti_load_package``.
"""
from __future__ import annotations

import json
from typing import Sequence

import torch

from export import metadata as md
from export.entrypoints import CacheSpec
from export.metadata import PackageMismatch

__all__ = ["ExportedEngine", "get_metadata", "load_op_library", "PackageMismatch"]


def load_op_library() -> str:
    """Imports dsv4_ops (library + fakes); returns the library path. Clear error if it cannot be loaded."""
    try:
        import dsv4_ops
    except ImportError as e:
        raise PackageMismatch(f"the dsv4 op library could not be loaded, and a dsv4 package calls its ops: {e}") from e
    return dsv4_ops.library_path()


def get_metadata(path: str) -> dict[str, str]:
    """The package's metadata (string -> string; JSON-valued keys documented in export/metadata.py)."""
    return md.read_from_archive(path)


def _bucket(buckets: Sequence[int], n: int, what: str) -> int:
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"batch {n} exceeds the largest {what} bucket {max(buckets)} in the package")


class ExportedEngine:
    """prefill / decode / reset over a loaded package; the caches are tensors this object owns.

    ``decode(tokens[B], positions[B]) -> float32 logits [B, V]`` (runs the smallest decode bucket >= B;
    padded rows write into cache rows B.. which no sequence uses).
    ``prefill(tokens[B, T]) -> float32 logits [B, V]`` (positions 0..T-1 of rows 0..B-1).
    ``cuda_graph=True`` captures each decode bucket in a CUDA graph on first use (needs a CUDA package;
    the entries are loaded with ``run_single_threaded=True`` so the call can be captured).
    """

    def __init__(self, path: str, *, device: str | None = None, config: dict | None = None,
                 cuda_graph: bool = False, run_single_threaded: bool | None = None, entries: Sequence[str] | None = None):
        self.library_path = load_op_library()
        self.path = path
        self.metadata = get_metadata(path)
        md.check(self.metadata, device=device, config=config)
        self.device = torch.device(self.metadata[md.K_DEVICE] if device is None else device)
        if cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph=True needs a CUDA package")
        self.config = json.loads(self.metadata[md.K_CONFIG])
        self.max_batch_size = int(self.metadata[md.K_MAX_BATCH])
        self.max_seq_len = int(self.metadata[md.K_MAX_SEQ])
        self.vocab_size = int(self.metadata[md.K_VOCAB])
        self.entries: dict[str, dict] = json.loads(self.metadata[md.K_ENTRIES])
        self.cache_specs = [CacheSpec.from_json(d) for d in json.loads(self.metadata[md.K_CACHES])]
        self.caches = [torch.zeros(s.shape, dtype=s.dtype, device=self.device) for s in self.cache_specs]
        self.cuda_graph = cuda_graph
        single = cuda_graph if run_single_threaded is None else run_single_threaded
        from torch._inductor.package import load_package

        wanted = list(self.entries) if entries is None else list(entries)
        self._models = {}
        for name in wanted:
            if name not in self.entries:
                raise KeyError(f"no entry {name!r} in {path} (has {', '.join(self.entries)})")
            self._models[name] = load_package(path, name, run_single_threaded=single,
                                              device_index=self.device.index if self.device.index is not None else -1)
        self._decode = {e["batch"]: n for n, e in self.entries.items() if e["kind"] == "decode" and n in self._models}
        self._prefill = {e["batch"]: n for n, e in self.entries.items() if e["kind"] == "prefill" and n in self._models}
        self._graphs: dict[int, tuple] = {}

    # -- state -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        for c in self.caches:
            c.zero_()

    def entry_metadata(self, name: str) -> dict[str, str]:
        """AOTI metadata of one loaded entry (what C++ ``get_metadata()`` returns)."""
        return self._models[name].get_metadata()

    # -- steps -------------------------------------------------------------------------------------------
    def _run(self, name: str, *inputs: torch.Tensor) -> torch.Tensor:
        out = self._models[name].loader.boxed_run([*inputs, *self.caches])
        return out[0]

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device, torch.long)
        b, t = tokens.shape
        if not 1 <= t <= self.max_seq_len:
            raise ValueError(f"prompt length {t} outside [1, {self.max_seq_len}]")
        bb = _bucket(list(self._prefill), b, "prefill")
        if bb != b:
            tokens = torch.cat([tokens, tokens.new_zeros(bb - b, t)])
        return self._run(self._prefill[bb], tokens)[:b]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device, torch.long).reshape(-1)
        positions = positions.to(self.device, torch.long).reshape(-1)
        b = tokens.shape[0]
        bb = _bucket(list(self._decode), b, "decode")
        if bb != b:
            # Padded rows write at position 0 of cache rows b..bb-1, which no live sequence uses.
            tokens = torch.cat([tokens, tokens.new_zeros(bb - b)])
            positions = torch.cat([positions, positions.new_zeros(bb - b)])
        if self.cuda_graph:
            return self._graph_decode(bb, tokens, positions)[:b]
        return self._run(self._decode[bb], tokens, positions)[:b]

    def _graph_decode(self, bb: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if bb not in self._graphs:
            static_tok, static_pos = tokens.clone(), positions.clone()
            name = self._decode[bb]
            saved = [c.clone() for c in self.caches]
            # Warm up outside capture (first-run allocations, lazy init), then capture one call.
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._run(name, static_tok, static_pos)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = self._run(name, static_tok, static_pos)
            for c, v in zip(self.caches, saved):  # warm-up and capture wrote into the caches
                c.copy_(v)
            self._graphs[bb] = (g, static_tok, static_pos, static_out)
        g, static_tok, static_pos, static_out = self._graphs[bb]
        static_tok.copy_(tokens)
        static_pos.copy_(positions)
        g.replay()
        return static_out.clone()

    # -- generation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_greedy(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of one prompt (the same loop the C++ runner runs)."""
        self.reset()
        tokens = torch.tensor([list(prompt_ids)], dtype=torch.long)
        pos = len(prompt_ids)
        if pos + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({pos}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                             f"{self.max_seq_len}")
        logits = self.prefill(tokens)
        out: list[int] = []
        for i in range(max_new_tokens):
            nxt = int(logits[0].argmax())
            out.append(nxt)
            if i + 1 == max_new_tokens:
                break
            logits = self.decode(torch.tensor([nxt]), torch.tensor([pos]))
            pos += 1
        return out

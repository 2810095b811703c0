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

from dsv4_export import metadata as md
from dsv4_export.entrypoints import CacheSpec
from dsv4_export.metadata import PackageMismatch
from dsv4_export.toolchain import cpu_isa_probe_skipped
from dsv4_model.model.to_device import device_longs, to_device
from dsv4_model.runtime.prefill_chunks import padded_chunks
from dsv4_model.runtime.session import EngineSession, RunnerOptions

__all__ = ["ExportedEngine", "get_metadata", "load_op_library", "PackageMismatch"]


def load_op_library() -> str:
    """Imports dsv4_ops (library + fakes); returns the library path. Clear error if it cannot be loaded."""
    try:
        import dsv4_ops
    except ImportError as e:
        raise PackageMismatch(f"the dsv4 op library could not be loaded (dsv4 packages call its ops): {e}") from e
    return dsv4_ops.library_path()


def get_metadata(path: str) -> dict[str, str]:
    """The package's metadata (string -> string; JSON-valued keys documented in dsv4_export/metadata.py)."""
    return md.read_from_archive(path)


def check_archive(path: str, entries: Sequence[str]) -> None:
    """Reads the members the given entries load (and the package's own files) through zipfile, which checks each
    one's CRC-32: a damaged package is one error naming the member, not a crash inside the AOTI loader. Members
    of entries not loaded are skipped. Costs about what the load reads anyway (~0.8 s per GB with the file in the
    page cache, CRC included)."""
    import zipfile
    import zlib

    want = set(entries)
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if "aotinductor" in parts[:-2] and parts[parts.index("aotinductor") + 1] not in want:
                    continue
                with z.open(info) as f:
                    while f.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise PackageMismatch(f"{path}: damaged package ({e}): copy it again or rebuild it") from None


def _config_dict(config) -> dict | None:
    """The config= of ExportedEngine: a ModelConfig (to_dict()) or its dict, as JSON round-trips it (the metadata's
    form: lists, not tuples)."""
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ValueError(f"config must be a ModelConfig or a dict, got {type(config).__name__}")
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError) as e:
        raise ValueError(f"config is not JSON-able: {e}") from None


def _bucket(buckets: Sequence[int], n: int, what: str) -> int:
    if not buckets:
        raise ValueError(f"no {what} entry is loaded from this package")
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"batch {n} exceeds the largest {what} bucket {max(buckets)} in the package")


def package_tokenizer(path: str, meta: dict[str, str], config):
    """The tokenizer a package carries (metadata K_TOKENIZER), built as load_tokenizer builds a checkpoint's; None
    for a package built before packages carried one."""
    import os
    import tempfile
    import zipfile

    from dsv4_model.checkpoint.tokenizer import load_tokenizer

    kind = meta.get(md.K_TOKENIZER)
    if kind in (None, "bytes"):
        return None if kind is None else load_tokenizer(None, config)
    with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory() as d:
        name = next((n for n in z.namelist() if n.endswith("/extra/" + md.TOKENIZER_FILE)), None)
        if name is None:
            raise PackageMismatch(f"{path}: its metadata names {kind}, the archive has no extra/{md.TOKENIZER_FILE}")
        with open(os.path.join(d, md.TOKENIZER_FILE), "wb") as f:
            f.write(z.read(name))
        return load_tokenizer(d, config)


class _PackageModel:
    """The part of the Transformer interface ``dsv4_model.runtime.compiled.DecodeRunner`` uses, backed by the package."""

    def __init__(self, engine: "ExportedEngine"):
        self._engine = engine
        self.max_batch_size = engine.max_batch_size
        self.max_seq_len = engine.max_seq_len
        self.device = engine.device
        self.decode_buckets = sorted(engine._decode)  # the batches the package's decode entries run

    def compressor_ratios(self) -> set[int]:
        return {int(r) for r in getattr(self._engine.config, "compress_ratios", ()) if r}

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, options=None) -> torch.Tensor:
        if options is not None and options != type(options)():
            raise ValueError("a package's decode step was built when it was exported: it takes no DecodeOptions")
        # the runner's ids come from its own sampler and its positions from the session's checked bookkeeping
        return self._engine._decode_raw(tokens, positions)


def _config_object(d: dict):
    try:
        from dsv4_model.model.config import ModelConfig

        return ModelConfig.from_dict(d)
    except Exception:  # a non-dsv4 config (e.g. the tests' toy model): attribute access is all generate() needs
        import types

        return types.SimpleNamespace(**d)


class ExportedEngine(EngineSession):
    """The engine interface (``dsv4_model.runtime.engine.Engine``) over a loaded package; it owns the caches.

    ``prefill(input_ids [B, S], lengths=None) -> float32 logits [B, V]`` (last valid position of each row; runs
    the smallest prefill bucket >= (B, S), right-padded, else chunks through a prefill_chunk entry). ``decode(next_ids [B]) -> [B, V]`` continues each row
    at its own position. ``decode_step(tokens [B], positions [B])`` is the raw step (smallest decode bucket >= B;
    padded rows run token 0 at position 0 in cache rows B.., which no live sequence uses). ``config``: a
    ``ModelConfig`` or its dict (``to_dict()``); the package is refused unless it was built for that config.
    ``generate(prompts, ...)`` is ``dsv4_model.runtime.generate.generate`` on this engine: its DecodeRunner (sampling op,
    per-bucket CUDA graphs when ``cuda_graph``; default on for CUDA packages) drives the decode entries (without
    ``decode_step``'s checks: it feeds back its own samples).
    """

    def __init__(self, path: str, *, device: str | None = None, config=None,
                 cuda_graph: bool | None = None, run_single_threaded: bool | None = None,
                 entries: Sequence[str] | None = None):
        from dsv4_model.model.checks import parse_device

        if device is not None:
            device = str(parse_device(device))
        config = _config_dict(config)
        self.library_path = load_op_library()
        self.path = path
        self.metadata = get_metadata(path)
        md.check(self.metadata, device=device, config=config)
        self.device = torch.device(self.metadata[md.K_DEVICE] if device is None else device)
        on_cuda = self.device.type == "cuda"
        self.cuda_graph = on_cuda if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and not on_cuda:
            raise ValueError("cuda_graph=True needs a CUDA package")
        self.config_dict = json.loads(self.metadata[md.K_CONFIG])
        self.config = _config_object(self.config_dict)
        self.max_batch_size = int(self.metadata[md.K_MAX_BATCH])
        self.max_seq_len = int(self.metadata[md.K_MAX_SEQ])
        self.vocab_size = int(self.metadata[md.K_VOCAB])
        self.entries: dict[str, dict] = json.loads(self.metadata[md.K_ENTRIES])
        self.cache_specs = [CacheSpec.from_json(d) for d in json.loads(self.metadata[md.K_CACHES])]
        self.caches = [torch.zeros(s.shape, dtype=s.dtype, device=self.device) for s in self.cache_specs]
        # Single-threaded runners can be captured in a CUDA graph (the multi-threaded container cannot).
        single = on_cuda if run_single_threaded is None else run_single_threaded
        from torch._inductor.package import load_package

        wanted = list(self.entries) if entries is None else list(entries)
        for name in wanted:
            if name not in self.entries:
                raise KeyError(f"no entry {name!r} in {path} (has {', '.join(self.entries)})")
        check_archive(path, wanted)
        self._models = {}
        for name in wanted:
            with cpu_isa_probe_skipped(self.device):
                self._models[name] = load_package(path, name, run_single_threaded=single,
                                                  device_index=-1 if self.device.index is None else self.device.index)
        self._decode = {e["batch"]: n for n, e in self.entries.items() if e["kind"] == "decode" and n in self._models}
        self._prefill = {(e["batch"], e["seq_len"]): n for n, e in self.entries.items()
                         if e["kind"] == "prefill" and n in self._models}
        self._prefill_chunk = {(e["batch"], e["seq_len"]): n for n, e in self.entries.items()
                               if e["kind"] == "prefill_chunk" and n in self._models}
        # the Scheduler's chunked prefill (prefill_at) runs through the prefill_chunk entries
        self.can_prefill_at = bool(self._prefill_chunk)
        self.prefill_chunk = max((c for _, c in self._prefill_chunk), default=0)
        self.model = _PackageModel(self)
        self.runner_options = RunnerOptions(compile=False, cuda_graphs=self.cuda_graph)
        self._init_session()

    def get_tokenizer(self):
        """The tokenizer the package carries; the byte-level fallback for a package built before (ids only)."""
        if self.tokenizer is None:
            from dsv4_model.checkpoint.tokenizer import load_tokenizer

            self.tokenizer = package_tokenizer(self.path, self.metadata, self.config) or load_tokenizer(None,
                                                                                                         self.config)
        return self.tokenizer

    def entry_metadata(self, name: str) -> dict[str, str]:
        """AOTI metadata of one loaded entry (what C++ ``get_metadata()`` returns)."""
        return self._models[name].get_metadata()

    # -- raw entries -------------------------------------------------------------------------------------
    def _run(self, name: str, *inputs: torch.Tensor) -> torch.Tensor:
        return self._models[name].loader.boxed_run([*inputs, *self.caches])[0]

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step of rows [:B]: tokens int64 [B], positions int64 [B] (tensors, or lists) -> fp32 logits
        [B, V]. Dtypes, shapes and devices are checked on every call; the values (ids in [0, vocab_size), positions
        in [0, max_seq_len)) only when they are on the CPU: checking CUDA tensors would make each step wait for the
        GPU, so on CUDA out-of-range values are the caller's to prevent."""
        tokens, positions = self._checked_step(tokens, positions)
        return self._decode_raw(tokens, positions)

    def _checked_step(self, tokens, positions) -> tuple[torch.Tensor, torch.Tensor]:
        got = {}
        limits = {"tokens": (self.vocab_size, "token id", "vocab_size"),
                  "positions": (self.max_seq_len, "position", "max_seq_len")}
        for what, t in (("tokens", tokens), ("positions", positions)):
            if not isinstance(t, torch.Tensor):
                try:
                    t = torch.as_tensor(t)
                except (TypeError, ValueError, RuntimeError):
                    raise ValueError(f"{what} must be an int64 tensor [B], got {type(t).__name__}") from None
            if t.dtype != torch.int64:
                raise ValueError(f"{what} must be an int64 tensor [B], got dtype "
                                 f"{str(t.dtype).removeprefix('torch.')}")
            if t.dim() != 1 or t.shape[0] < 1:
                raise ValueError(f"{what} must be an int64 tensor [B], got shape {tuple(t.shape)}")
            if t.device.type == "cpu":
                lo, hi = (int(v) for v in t.aminmax())
                limit, item, name = limits[what]
                if lo < 0 or hi >= limit:
                    raise ValueError(f"{what} contains {item} {lo if lo < 0 else hi} outside [0, {name}={limit})")
                t = t.to(self.device)
            elif t.device.type != self.device.type:
                raise ValueError(f"{what} are on {t.device}, the package runs on {self.device}")
            got[what] = t
        if got["positions"].shape != got["tokens"].shape:
            raise ValueError(f"positions must have the shape of tokens {tuple(got['tokens'].shape)}, got "
                             f"{tuple(got['positions'].shape)}")
        return got["tokens"], got["positions"]

    def _decode_raw(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        bb = _bucket(list(self._decode), b, "decode")
        if bb != b:
            tokens = torch.cat([tokens, tokens.new_zeros(bb - b)])
            positions = torch.cat([positions, positions.new_zeros(bb - b)])
        return self._run(self._decode[bb], tokens, positions)[:b]

    def prefill_step(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        fits = [(bb, ss) for bb, ss in self._prefill if bb >= b and ss >= s]
        chunks = [(bb, c) for bb, c in self._prefill_chunk if bb >= b]
        if not fits and chunks:
            return self._prefill_in_chunks(tokens, lengths, *min(chunks, key=lambda k: (k[0], -k[1])))
        if not fits:
            raise ValueError(f"no prefill bucket holds a batch of {b} x {s} tokens (package has "
                             f"{sorted(self._prefill)} as (batch, length))")
        bb, ss = min(fits, key=lambda k: (k[0] * k[1], k))
        padded = tokens.new_zeros(bb, ss)
        padded[:b, :s] = tokens
        lens = lengths.new_ones(bb)  # padded rows: one token, never read
        lens[:b] = lengths
        return self._run(self._prefill[(bb, ss)], padded, lens)[:b]

    def _prefill_in_chunks(self, tokens: torch.Tensor, lengths: torch.Tensor, bb: int, c: int) -> torch.Tensor:
        """A prompt longer than every prefill bucket: chunks of c positions through prefill_chunk_b{bb}_s{c}
        (rows past the batch: no tokens, nothing written)."""
        b = tokens.shape[0]
        padded = tokens.new_zeros(bb, tokens.shape[1])
        padded[:b] = tokens
        lens = lengths.new_zeros(bb)
        lens[:b] = lengths
        name = self._prefill_chunk[(bb, c)]
        return padded_chunks(padded, lens, c, lambda t, n, s: self._run(name, t, n, s))[:b]

    # -- the Scheduler's interface (dsv4_model.runtime.scheduler) ----------------------------------------------
    def prefill_at(self, tokens: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One prefill chunk of rows [:B] each from its own position (Engine.prefill_at) through the
        prefill_chunk entry of the smallest batch >= B, c positions per call: tokens [B, S], lengths [B] (0: the
        row is left as it is), start [B] -> fp32 logits [B, V] at each row's last token."""
        b, S = tokens.shape
        fits = [(bb, c) for bb, c in self._prefill_chunk if bb >= b]
        if not fits:
            raise ValueError(f"no prefill_chunk entry holds {b} rows (package has {sorted(self._prefill_chunk)})")
        bb, c = min(fits, key=lambda k: (k[0], -k[1]))
        dev = self.device
        lengths, start = to_device(lengths, dev), to_device(start, dev)
        # rows past B: no tokens, at position 1 (a row of length 0 at position 0 would restart its compressor
        # state, and rows past B may hold sequences)
        starts = torch.ones(bb, dtype=torch.long, device=dev)
        starts[:b] = start
        out = None
        for s in range(0, S, c):
            part = torch.zeros(bb, c, dtype=torch.long, device=dev)
            part[:b, :min(c, S - s)] = to_device(tokens[:, s:s + c], dev)
            n = torch.zeros(bb, dtype=torch.long, device=dev)
            n[:b] = (lengths - s).clamp(0, c)
            logits = self._run(self._prefill_chunk[(bb, c)], part, n, starts + s)[:b]
            ends = ((lengths - 1 >= s) & (lengths - 1 < s + c)).unsqueeze(1)
            out = logits if out is None else torch.where(ends, logits, out)
        return out

    def protect_rows(self, rows: list[int]):
        """Their compressor states, to put back after a decode step they ride along in (restore())."""
        idx = device_longs(rows, self.device)
        states = [c for spec, c in zip(self.cache_specs, self.caches) if spec.name.endswith(("kv_state",
                                                                                          "score_state"))]
        saved = [c.index_select(0, idx) for c in states]

        def restore() -> None:
            for c, held in zip(states, saved):
                c.index_copy_(0, idx, held)

        return restore

    # -- the engine interface (dsv4_model.runtime.session.EngineSession: prefill, decode, generate, state) ------
    _prefill_logits = prefill_step
    _decode_logits = _decode_raw  # decode() has checked its ids; the positions are its own

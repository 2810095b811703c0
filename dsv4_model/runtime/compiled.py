"""Decode-step execution: eager, torch.compile, and CUDA graphs (one per batch bucket).

One decode step = `model.decode_step` + `dsv4::sample` + feeding the sampled ids back as the next input,
advancing the positions and the RNG offsets. All of it reads and writes static device buffers owned by
`DecodeRunner`, so a CUDA-graph replay needs no host input at all: the host only copies the sampled ids
out (asynchronously) to stream them and check stop conditions.

Batch sizes are padded to buckets 1, 2, 4, ..., max_batch_size (compile/graph modes), so there is one
compiled graph and one CUDA graph per bucket and none in between. Padded rows run greedy on token 0
from position 0 in cache rows [B:bucket]; those rows belong to no live sequence, and the model derives
cache validity from positions only, so whatever they write is never read by a live row.

Graph modes (`graph_mode`):
  * "manual": torch.compile(mode="default") warmed up on a side stream, then captured into one
    `torch.cuda.CUDAGraph` per bucket, all sharing one memory pool; replay = one graph launch.
  * "reduce-overhead": torch.compile's CUDA-graph trees (static inputs marked with mark_static_address).
The default is "manual" (bench/bench_decode.py measures both; see docs/architecture.md).
"""
from __future__ import annotations

import bisect
import contextlib
import threading
import time
from typing import Callable

import torch

from dsv4_ops import ops

from dsv4_model.model.decode_options import DecodeOptions
from dsv4_model.model.to_device import device_longs
from dsv4_model.runtime.sampling import SamplerBuffers, SamplingParams

GRAPH_MODES = ("manual", "reduce-overhead")


@contextlib.contextmanager
def progress(log: Callable[[str], None], what: str, every_s: float = 15.0):
    """log(what ...), then every `every_s` seconds the time so far, then the total: nobody stares at a silent
    terminal while Inductor compiles."""
    t0, done = time.perf_counter(), threading.Event()
    log(f"{what} ...")

    def beat():
        while not done.wait(every_s):
            log(f"  ... {what}: {time.perf_counter() - t0:.0f} s so far")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    log(f"{what}: done in {time.perf_counter() - t0:.1f} s")


def _layer_decode(layer, h, ids, step, pending, fold_rows):
    """One decoder layer's decode (what regional compilation compiles; module-level, so that every runner and
    every layer share one code object and its compiled variants)."""
    return layer.decode(h, ids, step, pending, fold_rows=fold_rows)


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, then max_batch_size itself."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


class DecodeRunner:
    """Runs decode steps of `model` (a `Transformer`) on static buffers of `model.max_batch_size` rows.

    compile: torch.compile the step (fullgraph, static shapes). Default: on for CUDA, off for CPU.
    cuda_graphs: replay CUDA graphs. Default: on for CUDA. Needs a CUDA model.
    graph_mode: "manual" (default) or "reduce-overhead" (implies compile).
    compile_backend: torch.compile backend ("inductor"; tests on CPU may use "aot_eager").
    log: called with one line of progress while a bucket compiles / captures (the CLI prints it on stderr).
    step_options: how the decode step is built (dsv4_model.model.decode_options.DecodeOptions; the defaults are the
    shipped path, the rest debug overrides), fixed for the runner's lifetime.
    regional: with compile, compile one decoder layer at a time instead of the whole step: Dynamo reuses a layer's
    compiled code for every later layer that traces the same (layers differ only in weights and caches), so
    compile time grows with the kinds of layers, not the depth; the rest of the step runs eagerly, and the CUDA
    graph still captures the whole step. Not with graph_mode "reduce-overhead".

    Use: `prepare(B)` (compiles / captures; scribbles on cache rows [:bucket], so call it BEFORE prefill),
    prefill, `begin(positions, params)`, `sample_first(prefill_logits)`, then `step()` per token.
    """

    def __init__(self, model, *, compile: bool | None = None, cuda_graphs: bool | None = None,
                 graph_mode: str = "manual", compile_backend: str = "inductor",
                 log: Callable[[str], None] | None = None, step_options: DecodeOptions | None = None,
                 regional: bool = False):
        self.model = model
        self.log = log
        self.step_options = step_options if step_options is not None else DecodeOptions()
        if not isinstance(self.step_options, DecodeOptions):
            raise TypeError(f"step_options must be a DecodeOptions, got {type(self.step_options).__name__}")
        self.device = model.device
        on_cuda = self.device.type == "cuda"
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device (it is on {self.device})")
        self.graph_mode = graph_mode if self.cuda_graphs else None
        self.compile = on_cuda if compile is None else bool(compile)
        if self.graph_mode == "reduce-overhead":
            self.compile = True
        self.max_rows = int(model.max_batch_size)
        # a model that runs fixed batches only (an exported package's decode entries) pads to them even eagerly:
        # its own padding would put the rows past a batch at position 0, and the scheduler's rows hold sequences
        self._fixed_buckets = getattr(model, "decode_buckets", None)
        self.buckets = list(self._fixed_buckets or batch_buckets(self.max_rows))
        self.tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        self.sampler = SamplerBuffers(self.max_rows, self.device)
        self.rows = 0
        self.padded = 0
        self._next_pos = 0  # the largest position the next step writes (host copy of what begin() was given)
        self.last_logits: torch.Tensor | None = None  # what the latest step() returned
        self._views: dict = {}  # per _key(bucket)
        self._graphs: dict = {}  # per _key(bucket): (graph, the step's output buffers)
        self._ready: set = set()
        self._pool = None
        self._fn = self._step_impl
        self._layer_call = None
        self.regional = bool(regional) and self.compile
        if self.regional and self.graph_mode == "reduce-overhead":
            raise ValueError("regional compilation captures the step in manual CUDA graphs, not reduce-overhead")
        if self.compile:
            # Dynamo counts compiled variants per code object, and every runner compiles the same
            # `_step_impl`: leave room for one variant per bucket for several runners (past the limit
            # dynamo would silently fall back to eager).
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, 8 * len(self.buckets))
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 32 * len(self.buckets))
            mode = "reduce-overhead" if self.graph_mode == "reduce-overhead" else None
            from dsv4_ops.inductor import register_inductor_fallbacks

            register_inductor_fallbacks()
            if self.regional:
                # one variant per distinct layer (kind, first user of a shared value, last layer), per bucket
                n = len(model.layers) * len(self.buckets)
                cfg.recompile_limit = max(cfg.recompile_limit, n)
                cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * n)
                self._layer_call = torch.compile(_layer_decode, fullgraph=True, dynamic=False,
                                                 backend=compile_backend)
            else:
                self._fn = torch.compile(self._step_impl, fullgraph=True, dynamic=False, mode=mode,
                                         backend=compile_backend)

    @property
    def mode_name(self) -> str:
        return self._mode()

    def _mode(self) -> str:
        compiled = "regional" if self.regional else "compiled"
        if self.graph_mode == "manual":
            return f"{compiled}+graph" if self.compile else "eager+graph"
        if self.graph_mode == "reduce-overhead":
            return "reduce-overhead"
        return compiled if self.compile else "eager"

    # ------------------------------------------------------------------ the step
    def _step_impl(self, tokens, positions, temperature, top_k, top_p, seed, offset):
        if self._layer_call is None:  # (an exported package's model takes no layer_call)
            logits = self.model.decode_step(tokens, positions, self.step_options)
        else:
            logits = self.model.decode_step(tokens, positions, self.step_options, layer_call=self._layer_call)
        nxt = ops.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)
        tokens.copy_(nxt)
        positions.add_(1)
        offset.add_(1)
        return logits, nxt

    def _key(self, n: int):
        """What a compiled step and its CUDA graph are built for (a subclass adds its own variants)."""
        return n

    def _inputs(self, n: int) -> tuple[torch.Tensor, ...]:
        """The step function's arguments for bucket n: views of the static buffers."""
        return (self.tokens[:n], self.positions[:n], *self.sampler.rows(n))

    def _view(self, n: int) -> tuple[torch.Tensor, ...]:
        # The same view objects every call: dynamo and the cudagraph trees see one static input per bucket.
        key = self._key(n)
        if key not in self._views:
            v = self._inputs(n)
            if self.graph_mode == "reduce-overhead":
                for t in v:
                    torch._dynamo.mark_static_address(t)
            self._views[key] = v
        return self._views[key]

    def bucket(self, rows: int) -> int:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"batch of {rows} rows: must be in [1, max_batch_size={self.max_rows}]")
        if not (self.compile or self.cuda_graphs or self._fixed_buckets):
            return rows  # eager: no reason to pad
        return self.buckets[bisect.bisect_left(self.buckets, rows)]

    # ------------------------------------------------------------------ set-up
    @torch.no_grad()
    def prepare(self, rows: int) -> int:
        """Compile / capture the bucket of `rows` if not done yet; returns the padded row count.

        Warm-up steps write cache rows [:bucket] at positions 0.., so call this before prefill."""
        n = self.bucket(rows)
        if self._key(n) in self._ready:
            return n
        with self._progress(n):
            self._build(n)
        return n

    def _progress(self, n: int):
        if self.log is None or not (self.compile or self.cuda_graphs):
            return contextlib.nullcontext()
        what = {"compiled+graph": "compiling + capturing", "eager+graph": "capturing",
                "reduce-overhead": "compiling (reduce-overhead)", "compiled": "compiling",
                "regional+graph": "compiling layer by layer + capturing",
                "regional": "compiling layer by layer"}[self._mode()]
        return progress(self.log, f"{what} the decode step for batch bucket {n}")

    def _build(self, n: int) -> None:
        self._reset_buffers()
        view = self._view(n)
        if self.graph_mode == "manual":
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compile + autotune outside capture
                for _ in range(2):
                    self._fn(*view)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._reset_buffers()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outs = self._fn(*view)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[self._key(n)] = (graph, outs)
        elif self.compile:
            for _ in range(3 if self.graph_mode == "reduce-overhead" else 1):  # warm-up, record, replay
                if self.graph_mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                self._fn(*view)
        self._reset_buffers()
        self._ready.add(self._key(n))

    def prepare_all(self, buckets: list[int] | None = None) -> None:
        """Capture several buckets up front, largest first (the pool is sized by the first capture)."""
        for n in sorted(buckets or self.buckets, reverse=True):
            self.prepare(n)

    def _reset_buffers(self) -> None:
        self.tokens.zero_()
        self.positions.zero_()
        self.sampler.set([])

    @torch.no_grad()
    def begin(self, positions, params: list[SamplingParams]) -> None:
        """Start a batch: row b decodes from positions[b] with params[b]; padded rows are reset. positions: host
        values (a list or CPU tensor; a device tensor is read back once), so that step() can refuse a step past
        the caches on the host."""
        rows = len(params)
        positions = torch.as_tensor(positions, dtype=torch.long)
        if positions.shape != (rows,):
            raise ValueError(f"positions must have shape [{rows}], got {tuple(positions.shape)}")
        host = positions.tolist()
        if min(host) < 0 or max(host) > self.model.max_seq_len:  # == max_seq_len: a full row, no step may run
            raise ValueError(f"positions {host} outside [0, max_seq_len={self.model.max_seq_len}]")
        self.padded = self.prepare(rows)
        self.rows = rows
        self._reset_buffers()
        self.positions[:rows].copy_(positions)
        self._next_pos = max(host)
        self.sampler.set(params)

    @torch.no_grad()
    def sample_first(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample the first token of every live row from prefill logits [rows, V]; it becomes the next input."""
        t, k, p, s, o = self.sampler.rows(self.rows)
        nxt = ops.sample(logits.float(), temperature=t, top_k=k, top_p=p, seed=s, offset=o)
        self.tokens[: self.rows].copy_(nxt)
        o.add_(1)
        return nxt

    # ------------------------------------------------------------------ rows joining and leaving (the scheduler)
    @torch.no_grad()
    def sample_rows(self, logits: torch.Tensor, rows: list[int], logit_rows: list[int] | None = None) -> torch.Tensor:
        """The first token of each of `rows` from prefill logits (row r's at logits[r], or at logits[logit_rows[i]]),
        drawn with that row's sampler row at offset 0, as sample_first draws it; it becomes the row's next input.
        Returns the ids [len(rows)]."""
        idx = device_longs(rows, self.device)
        at = idx if logit_rows is None else device_longs(logit_rows, self.device)
        s = self.sampler
        s.offset.index_fill_(0, idx, 0)
        nxt = ops.sample(logits.index_select(0, at).float(), temperature=s.temperature[idx], top_k=s.top_k[idx],
                         top_p=s.top_p[idx], seed=s.seed[idx], offset=s.offset[idx])
        self.tokens.index_copy_(0, idx, nxt)
        s.offset.index_fill_(0, idx, 1)
        return nxt

    @torch.no_grad()
    def launch(self, rows: int, positions: torch.Tensor) -> torch.Tensor:
        """One decode step over rows [:rows] (padded to their bucket, which prepare() must have built), each row at
        positions[r] (a host tensor of the bucket's length; the host decides every row's position each step, so a
        row that is not decoding can be held where its writes are harmless: docs/architecture.md). Returns the
        next ids [rows] (a static buffer in graph modes)."""
        n = self.bucket(rows)
        if (self.compile or self.cuda_graphs) and self._key(n) not in self._ready:
            raise RuntimeError(f"batch bucket {n} is not prepared: prepare it before any row holds a sequence")
        self.padded, self.rows = n, rows
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        logits, nxt = self._run()
        self.last_logits = logits[:rows]
        return nxt[:rows]

    # ------------------------------------------------------------------ steady state
    @torch.no_grad()
    def step(self, replay: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the live batch -> (logits [rows, V], next ids [rows]).

        In graph modes both are static buffers overwritten by the next step: copy what you keep.
        replay=False runs the (compiled) step function directly instead of the manual CUDA graph. A step whose
        position would lie past the caches is refused here, on the host (on the device it would be an
        out-of-bounds cache write)."""
        if self._next_pos >= self.model.max_seq_len:
            raise ValueError(f"decode step at position {self._next_pos}: the caches hold max_seq_len="
                             f"{self.model.max_seq_len} positions (begin a new batch, or build with a longer one)")
        self._next_pos += 1
        logits, nxt = self._run(replay)
        self.last_logits = logits[: self.rows]
        return self.last_logits, nxt[: self.rows]

    def _run(self, replay: bool = True) -> tuple:
        """The step of the live bucket: replay its graph, or call the step function; returns its outputs."""
        n = self.padded
        if self.graph_mode == "manual" and replay:
            graph, outs = self._graphs[self._key(n)]
            graph.replay()
            return outs
        if self.graph_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return self._fn(*self._view(n))

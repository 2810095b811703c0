"""Exports the decode step and prefill to ONE AOTInductor package (``.pt2``), plus the plain ExportedPrograms.

Entries (each an AOTI model inside the package, loadable by name from Python and C++), all with STATIC shapes:
  ``decode_b{B}``        one per decode batch bucket. Static rather than one dynamic-batch graph because that
                         is how the engine runs decode (one compiled graph / CUDA graph per bucket): Inductor
                         picks kernels for the exact shape, no size guards run per step, a loaded entry can be
                         captured in a CUDA graph as is, and model code never meets a symbolic batch.
  ``prefill_b{B}_s{S}``  one per (batch, length) bucket. Prefill cannot take a symbolic length: the model's
                         prefill has Python control flow on S (query-block loop, ``span // ratio``, ``min(topk, n)``)
                         that export would have to specialize. Prompts are right-padded to the bucket length and
                         ``lengths`` tells the model where each row ends (its caches/compressor state end there).
  ``prefill_chunk_b{B}_s{C}``  (optional) a chunk of C positions at per-row starts (an input): a prompt longer than
                         every prefill bucket runs as chunks through it, one graph for any start.
Weights are constants inside each entry's .so (``package_constants_in_so``, the default): the simplest layout
that loads the same way from Python and C++ on torch 2.11 and 2.13 (on-disk weight formats differ between the
two and the pickled one cannot be loaded from C++). The price is one copy of the weights per entry, on disk
and in memory once loaded: fine for the small models this is meant for; a large model wants few buckets.
Caches are explicit inputs mutated in place (see entrypoints.py); the package has no hidden state.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_model.runtime.compiled import progress
from dsv4_ops.inductor import register_inductor_fallbacks
from dsv4_export import metadata as md
from dsv4_export import toolchain
from dsv4_export.entrypoints import CacheAsInputs, CacheSpec, cache_names, cache_specs, caches_detached, call_decode, \
    call_prefill, call_prefill_chunk


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # "decode" | "prefill" | "prefill_chunk"
    batch: int
    seq_len: int = 1  # prefill: the (padded) prompt length S

    def to_json(self) -> dict:
        return {"kind": self.kind, "batch": self.batch, "seq_len": self.seq_len}


def default_prefill_lengths(max_seq_len: int) -> list[int]:
    """64, 256, 1024, ... below max_seq_len, plus max_seq_len: padding costs at most 4x of a short prompt."""
    out, s = [], 64
    while s < max_seq_len:
        out.append(s)
        s *= 4
    return out + [max_seq_len]


def _namer(flags: bool) -> Callable[[str], str]:
    """How errors name an argument: the Python parameter, or the CLI's flag (decode_batches -> --decode-batches)."""
    return (lambda n: "--" + n.replace("_", "-")) if flags else (lambda n: n)


def plan_entries(decode_batches: Sequence[int], prefill_batches: Sequence[int], prefill_lengths: Sequence[int],
                 max_batch_size: int, max_seq_len: int, prefill_chunks: Sequence[int] = (), *,
                 flags: bool = False) -> list[Entry]:
    """The entries of a package; a bad bucket is one ValueError naming its argument (``flags``: as the CLI's
    flag)."""
    arg = _namer(flags)
    for what, values in (("decode_batches", decode_batches), ("prefill_batches", prefill_batches)):
        for b in values:
            if not 1 <= b <= max_batch_size:
                raise ValueError(f"{arg(what)}: batch bucket {b} outside [1, {arg('max_batch_size')}="
                                 f"{max_batch_size}]")
    for what, values in (("prefill_lengths", prefill_lengths), ("prefill_chunks", prefill_chunks)):
        for s in values:
            if not 1 <= s <= max_seq_len:
                raise ValueError(f"{arg(what)}: {'chunk ' if what == 'prefill_chunks' else ''}length {s} outside "
                                 f"[1, {arg('max_seq_len')}={max_seq_len}]")
    if prefill_chunks and not prefill_batches:
        raise ValueError(f"{arg('prefill_chunks')} need {arg('prefill_batches')} (prefill batch buckets)")
    if not decode_batches:
        raise ValueError(f"{arg('decode_batches')}: need at least one decode batch bucket")
    if prefill_batches and not prefill_lengths:
        raise ValueError(f"{arg('prefill_batches')} need at least one of {arg('prefill_lengths')}")
    entries = [Entry(f"decode_b{b}", "decode", b) for b in sorted(set(decode_batches))]
    entries += [Entry(f"prefill_b{b}_s{s}", "prefill", b, s)
                for b in sorted(set(prefill_batches)) for s in sorted(set(prefill_lengths))]
    entries += [Entry(f"prefill_chunk_b{b}_s{c}", "prefill_chunk", b, c)
                for b in sorted(set(prefill_batches)) for c in sorted(set(prefill_chunks))]
    return entries


def check_out(out: str, what: str = "out") -> None:
    """The package path: ends in .pt2, is not a folder, and its folder (or the nearest existing one above it: the
    build creates the rest) takes new files. Probed by creating a file there, as a root process may write where
    the mode bits say no, and not in /proc."""
    out = os.fspath(out)
    if not out.endswith(".pt2") or os.path.basename(out) == ".pt2":
        raise ValueError(f"{what} {out}: a package path must end in .pt2 (e.g. model.pt2)")
    if os.path.isdir(out):
        raise ValueError(f"{what} {out}: is a directory")
    top = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(top):
        top = os.path.dirname(top)
    if not os.path.isdir(top):
        raise ValueError(f"{what} {out}: {top} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dsv4_export-probe-", dir=top)
    except OSError as e:
        raise ValueError(f"{what} {out}: directory {top} is not writable ({e.strerror})") from None
    os.close(fd)
    os.remove(probe)


def plan_build(out: str, *, max_batch_size: int, max_seq_len: int, decode_batches: Sequence[int] | None = None,
               prefill_batches: Sequence[int] | None = None, prefill_lengths: Sequence[int] | None = None,
               prefill_chunks: Sequence[int] = (), flags: bool = False) -> list[Entry]:
    """Every check of a build's arguments that needs no model (before the checkpoint is read), with
    build_package's defaults; returns the entries."""
    from dsv4_model.model.checks import check_positive_int

    arg = _namer(flags)
    check_out(out, arg("out"))
    check_positive_int(max_batch_size, arg("max_batch_size"))
    check_positive_int(max_seq_len, arg("max_seq_len"))
    return plan_entries(decode_batches or [max_batch_size], [1] if prefill_batches is None else prefill_batches,
                        prefill_lengths or default_prefill_lengths(max_seq_len), max_batch_size, max_seq_len,
                        prefill_chunks or (), flags=flags)


def entry_fn(entry: Entry, decode_fn: Callable, prefill_fn: Callable) -> Callable:
    return {"decode": decode_fn, "prefill": prefill_fn, "prefill_chunk": call_prefill_chunk}[entry.kind]


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[export] {msg}", file=sys.stderr, flush=True)


class _OpRecorder(TorchDispatchMode):
    """Records the dsv4 ops an eager run dispatches (to check the exported graph calls the same ones)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dsv4":
            self.ops.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def _example_inputs(entry: Entry, device: str) -> tuple[torch.Tensor, ...]:
    if entry.kind == "decode":
        return (torch.zeros(entry.batch, dtype=torch.long, device=device),
                torch.arange(entry.batch, dtype=torch.long, device=device))
    # Arbitrary ids; full-length rows (the values only matter for the eager probes); chunks at position 0.
    ids = torch.arange(entry.batch * entry.seq_len, device=device).remainder(7).view(entry.batch, entry.seq_len)
    lengths = torch.full((entry.batch,), entry.seq_len, dtype=torch.long, device=device)
    if entry.kind == "prefill_chunk":
        return ids, lengths, torch.zeros(entry.batch, dtype=torch.long, device=device)
    return ids, lengths


def _dsv4_ops_in(ep: torch.export.ExportedProgram) -> dict[str, str]:
    out = {}
    for node in ep.graph.nodes:
        t = node.target
        if node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace == "dsv4":
            out[t._schema.name] = str(t._schema)
    return dict(sorted(out.items()))


def export_entry(model: nn.Module, names: Sequence[str], entry: Entry, *, device: str,
                 decode_fn: Callable = call_decode, prefill_fn: Callable = call_prefill
                 ) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of one entry with the caches as inputs; checks caches are mutated in place."""
    fn = entry_fn(entry, decode_fn, prefill_fn)
    specs = cache_specs(model, names)
    caches = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs)
    inputs = _example_inputs(entry, device)
    wrapper = CacheAsInputs(model, names, fn)
    with caches_detached(model, names), torch.no_grad():
        ep = torch.export.export(wrapper, (inputs, caches), strict=False)
    written = written_inputs(ep)
    cache_inputs = ep.graph_signature.user_inputs[len(inputs):]
    # a decode step's scratch (written and read within the step) need not be written by every entry
    scratch = set(model.scratch_buffer_names()) if hasattr(model, "scratch_buffer_names") else set()
    not_written = [n for n, i in zip(names, cache_inputs) if i not in written and n not in scratch]
    if not_written:
        raise RuntimeError(f"{entry.name}: the exported graph does not write caches {not_written}; they would not "
                           "be updated in place (is the model reading a stale copy of its buffers?)")
    return ep


def written_inputs(ep: torch.export.ExportedProgram) -> set[str]:
    """Names of the graph inputs that some in-place op writes, directly or through a chain of views.

    The training IR keeps in-place ops as they are, so following each op's schema alias annotations is
    enough; this is what ``run_decompositions().graph_signature.user_inputs_to_mutate`` reports, without the
    cost of functionalizing the whole graph (tens of seconds for a small model on CPU).
    """
    root: dict[torch.fx.Node, str] = {n: n.name for n in ep.graph.nodes if n.op == "placeholder"}
    written: set[str] = set()
    for node in ep.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        schema = t._schema
        for i, arg in enumerate(schema.arguments):
            val = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            vals = val if isinstance(val, (list, tuple)) else [val]
            for v in vals:
                if isinstance(v, torch.fx.Node) and v in root and arg.alias_info is not None:
                    if arg.alias_info.is_write:
                        written.add(root[v])
                    elif i == 0 and t.is_view:
                        root[node] = root[v]
    return written


def eager_dsv4_ops(model: nn.Module, entry: Entry, device: str, fn: Callable) -> set[str]:
    """The dsv4 ops one eager call of an entry dispatches (state restored afterwards by the caller)."""
    rec = _OpRecorder()
    with torch.no_grad(), rec:
        fn(model, *_example_inputs(entry, device))
    return rec.ops


class _DropMessage:
    """A logging filter that drops the records whose message contains ``text``."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


# The reductions whose ATen kernels the eager model's fp32 math runs and Inductor re-implements (eager_numerics).
EAGER_KERNELS = ("mean.dim", "_softmax.default")


@contextlib.contextmanager
def eager_numerics(device: str):
    """While a CPU entry is lowered: ``aten.mean`` and ``aten._softmax`` run ATen's kernels, not Inductor's own
    reductions, and no constant is inlined into a kernel as a literal.

    Why: with ``eager_rounding`` alone a CPU package's prefill was still up to ~6e-2 from eager in max logit on the
    built-in model (its decode, whose norms and attention run in dsv4 ops, matched): Inductor sums the fp32 RMS
    factors (``x.square().mean(-1)``) and the attention softmax in another order than ATen (and its exp differs in
    the last bit), and inlining a small constant (<= 8 values: the package bakes the weights in) changed a row's
    rounding here and there; the mHC's fp32 weights carry each ulp on. With this the prefill gives eager's logits
    and caches bit for bit (same padded input; docs/export.md). CUDA packages keep Inductor's fused reductions. The
    package calls the two kernels through AOTI's proxy executor (no C shim: Inductor's warning per call site is
    dropped). Inductor's tables are process-wide: what was there is put back on the way out."""
    if torch.device(device).type != "cpu":
        yield
        return
    import logging

    from torch._inductor import decomposition, lowering
    from torch._inductor.graph import GraphLowering

    ops = [getattr(getattr(torch.ops.aten, packet), overload)
           for packet, overload in (name.split(".") for name in EAGER_KERNELS)]
    saved = [(op, decomposition.decompositions.pop(op, None), lowering.lowerings.pop(op, None),
              [st for st in (lowering.needs_realized_inputs, lowering.fallbacks) if op not in st]) for op in ops]
    for op in ops:
        lowering.make_fallback(op, warn=False)
    # Inductor lowers with a cached copy of its decomposition table (fast_random_decomps): one made by an earlier
    # compile in this process would still decompose the softmax (the CPU package then ~4e-3 from eager inside the
    # test suite, bit for bit alone), and one made in here would keep it out of later compiles. Rebuilt both ways.
    cached_table = getattr(decomposition, "fast_random_decomps", None)
    clear_table = getattr(cached_table, "cache_clear", lambda: None)
    clear_table()
    inline = GraphLowering.__dict__.get("can_inline_constant")
    GraphLowering.can_inline_constant = staticmethod(lambda t: False)
    ir_log = logging.getLogger("torch._inductor.ir")
    quiet = _DropMessage("is missing a c-shim implementation")
    ir_log.addFilter(quiet)
    try:
        yield
    finally:
        ir_log.removeFilter(quiet)
        if inline is None:
            del GraphLowering.can_inline_constant
        else:
            GraphLowering.can_inline_constant = inline
        for op, decomp, lower, sets in saved:
            lowering.lowerings.pop(op, None)
            if lower is not None:
                lowering.lowerings[op] = lower
            if decomp is not None:
                decomposition.decompositions[op] = decomp
            for st in sets:  # make_fallback added it there
                st.discard(op)
        clear_table()


def _aot_compile(ep: torch.export.ExportedProgram, args, kwargs, options: dict) -> list[str]:
    # What aoti_compile_and_package does for one model; done per entry so all land in one archive (the
    # multi-model recipe of its docstring: aot_compile(..., aot_inductor.package) + package_aoti).
    files = torch._inductor.aot_compile(ep.module(), args, kwargs, options=options)
    if not all(isinstance(f, str) for f in files):
        raise RuntimeError("AOTInductor returned weights outside the .so; constants are expected in the package")
    return files


def toolchain_metadata(verbose: bool = True) -> dict[str, str]:
    """Makes Inductor use the chosen C++ compiler; the metadata that records it (the libstdc++ a loader needs)."""
    choice = toolchain.configure_inductor(verbose=False)  # it would say so on stdout: progress goes to stderr
    _log(verbose, f"C++ compiler for AOTI: {choice.cxx} ({choice.reason})")
    lib = toolchain.compiler_libstdcxx(choice.cxx)
    return {md.K_CXX: choice.cxx, md.K_CXX_GLIBCXX: ".".join(map(str, lib.glibcxx)) if lib and lib.glibcxx else ""}


def export_and_compile(model: nn.Module, names: Sequence[str], entries: Sequence[Entry],
                       eager_ops: dict[str, set[str]], meta: dict[str, str], *, device: str,
                       ep_stem: str | None = None, verbose: bool = True, decode_fn: Callable = call_decode,
                       prefill_fn: Callable = call_prefill, log: Callable[[str], None] | None = None
                       ) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Exports every entry (all before any compile: an export error comes before minutes of compiling), then
    AOTInductor-compiles them. Returns {entry: (the AOTI files, the dsv4 ops its graph calls)}. ``meta`` (with
    the toolchain's) goes into every entry's AOTI metadata, with that entry's name and ops."""
    log = log or (lambda m: _log(verbose, m))
    eps: dict[str, torch.export.ExportedProgram] = {}
    in_graph: dict[str, dict[str, str]] = {}
    for e in entries:
        t0 = time.time()
        log(f"exporting {e.name} ...")
        ep = export_entry(model, names, e, device=device, decode_fn=decode_fn, prefill_fn=prefill_fn)
        in_graph[e.name] = _dsv4_ops_in(ep)
        lost = sorted(eager_ops[e.kind] - set(in_graph[e.name]))
        if lost:
            raise RuntimeError(f"{e.name}: dsv4 ops {lost} run eagerly but are not in the exported graph "
                               "(decomposed or traced through?)")
        eps[e.name] = ep
        log(f"  {e.name}: {time.time() - t0:.1f} s, dsv4 ops: {', '.join(in_graph[e.name]) or 'none'}")
        if ep_stem is not None:
            torch.export.save(ep, f"{ep_stem}.{e.name}.ep.pt2")
    register_inductor_fallbacks()
    out = {}
    for name, ep in eps.items():
        args, kwargs = ep.example_inputs
        options = {"aot_inductor.package": True,
                   "aot_inductor.metadata": dict(meta, **{"dsv4.entry": name,
                                                          md.K_OPS_USED: json.dumps(in_graph[name], sort_keys=True)})}
        with progress(log, f"AOTInductor-compiling {name}") if verbose else nullcontext(), \
                toolchain.cpu_isa_probe_skipped(device), eager_numerics(device):
            out[name] = (_aot_compile(ep, args, kwargs, options), in_graph[name])
    return out


def write_package(files: dict[str, list[str]], out: str, meta: dict[str, str], tokenizer_json: str | None = None
                  ) -> str:
    """Writes the entries' AOTI files as named models of one .pt2, with the package metadata (and the tokenizer
    file, when given)."""
    from torch.export.pt2_archive._package import package_pt2

    # Written under its final name in a scratch folder (the archive's root folder is named after the file),
    # then moved, so a failed build never leaves a truncated package behind.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as tmp_dir:
        tmp = os.path.join(tmp_dir, os.path.basename(out))
        extra = {md.EXTRA_FILE: json.dumps(meta, indent=1, sort_keys=True)}
        if tokenizer_json is not None:
            with open(tokenizer_json, encoding="utf-8") as f:
                extra[md.TOKENIZER_FILE] = f.read()
        package_pt2(tmp, aoti_files=files, extra_files=extra)
        os.replace(tmp, out)
    return out


def compile_jobs(jobs: int | None, model: nn.Module, n_entries: int, device: str) -> int:
    """How many worker processes export + compile the entries. ``None``: one per 3 CPU cores (each worker's
    Triton / C++ compiles are themselves parallel), no more than the entries, and only as many model copies
    as fit in a third of the free device memory and of the available host memory."""
    if jobs is not None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        return min(jobs, n_entries)
    n = min(n_entries, max(1, (os.cpu_count() or 1) // 3))
    if n == 1:
        return 1
    size = sum(t.nbytes for t in (*model.parameters(), *model.buffers())) + 2**30  # + a context, workspaces
    room = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if torch.device(device).type == "cuda":
        room = min(room, torch.cuda.mem_get_info(torch.device(device))[0])
    return max(1, min(n, int(room // 3 // size)))


def build_package(model: nn.Module, config: dict, out: str, *, max_batch_size: int, max_seq_len: int,
                  device: str, decode_batches: Sequence[int] | None = None,
                  prefill_batches: Sequence[int] | None = None, prefill_lengths: Sequence[int] | None = None,
                  save_exported_programs: bool = True, dtype: torch.dtype | None = None, verbose: bool = True,
                  decode_fn: Callable = call_decode, prefill_fn: Callable = call_prefill,
                  jobs: int | None = None, prefill_chunks: Sequence[int] = (), tokenizer_json: str | None = None
                  ) -> str:
    """Exports ``model`` (already on ``device``, caches allocated for max_batch_size x max_seq_len) to ``out``.

    Decode buckets default to [max_batch_size]; prefill to batch [1] x ``default_prefill_lengths``;
    ``prefill_batches=[]`` builds a decode-only package; ``prefill_chunks`` adds a prefill_chunk entry per chunk
    length and prefill batch (prompts longer than every prefill bucket then run in chunks). ``config`` (a
    JSON-able dict, e.g. ``ModelConfig.to_dict()``) is stored in the metadata. Returns the package path. With
    ``save_exported_programs`` also writes ``<out stem>.<entry>.ep.pt2`` (``torch.export.save``; load them with
    ``torch.export.load`` after ``import dsv4_ops``). ``jobs``: processes that export + compile the entries side
    by side (``compile_jobs``: by default one per 3 CPU cores where memory allows; 1 builds in this process).
    ``tokenizer_json``: the checkpoint's tokenizer.json, carried in the package (None: the byte-level fallback).
    Nothing is left under ``out``'s name unless the build completes: the ExportedPrograms are written to a
    scratch folder beside it and moved in with the package; an error or Ctrl-C removes them. ``out`` and the
    buckets are checked before anything runs (``plan_build``: one ValueError naming the argument); folders missing
    above ``out`` are created, and removed again if the build fails.
    """
    import dsv4_ops  # noqa: F401  (schemas + fakes must exist before tracing)

    entries = plan_build(out, max_batch_size=max_batch_size, max_seq_len=max_seq_len, decode_batches=decode_batches,
                         prefill_batches=prefill_batches, prefill_lengths=prefill_lengths,
                         prefill_chunks=prefill_chunks)
    model.eval()
    dtype = dtype if dtype is not None else getattr(model, "dtype", None)
    # Eager probes run one decode bucket and the smallest bucket of each prefill kind (which buffers get written
    # and which dsv4 ops run do not depend on the bucket size; a large prefill bucket could be costly to run).
    probes = [entries[0]] + [min((e for e in entries if e.kind == k), key=lambda e: e.batch * e.seq_len)
                             for k in ("prefill", "prefill_chunk") if any(e.kind == k for e in entries)]

    def run_probes():
        for e in probes:
            entry_fn(e, decode_fn, prefill_fn)(model, *_example_inputs(e, device))

    names = cache_names(model, probe=run_probes)
    if not names:
        raise RuntimeError("the decode step writes no buffer: nothing to pass as caches")
    for n in names:
        aliases = [m for m, b in model.named_buffers(remove_duplicate=False) if b is model.get_buffer(n) and m != n]
        if aliases:
            raise RuntimeError(f"cache {n} is also registered as {aliases}: a cache must have one owner to be "
                               "replaced by an input")
    specs = cache_specs(model, names)
    cache_mib = sum(model.get_buffer(n).nbytes for n in names) / 2**20
    _log(verbose, f"{len(specs)} cache tensors ({cache_mib:.1f} MiB) as explicit inputs; "
                  f"entries: {', '.join(e.name for e in entries)}")
    eager_ops = {p.kind: _restoring(model, names, lambda: eager_dsv4_ops(
        model, p, device, entry_fn(p, decode_fn, prefill_fn))) for p in probes}
    meta = md.environment(device)
    meta.update(toolchain_metadata(verbose))
    meta.update({
        md.K_CONFIG: json.dumps(config, sort_keys=True),
        md.K_ENTRIES: json.dumps({e.name: e.to_json() for e in entries}),
        md.K_CACHES: json.dumps([s.to_json() for s in specs]),
        md.K_MAX_BATCH: str(max_batch_size),
        md.K_MAX_SEQ: str(max_seq_len),
        md.K_DTYPE: str(dtype).removeprefix("torch.") if dtype is not None else "",
        md.K_QUANT: json.dumps(getattr(model, "quant_info", None) or {}, sort_keys=True),
        md.K_VOCAB: str(_vocab_size(config)),
        md.K_CPP_DECODE: ",".join(e.name for e in entries if e.kind == "decode"),
        md.K_CPP_PREFILL: ",".join(e.name for e in entries if e.kind == "prefill"),
        md.K_CPP_PREFILL_CHUNK: ",".join(e.name for e in entries if e.kind == "prefill_chunk"),
        md.K_CPP_CACHES: ";".join(f"{s.name}:{str(s.dtype).removeprefix('torch.')}:{'x'.join(map(str, s.shape))}"
                                  for s in specs),
        md.K_TOKENIZER: md.TOKENIZER_FILE if tokenizer_json is not None else "bytes",
    })
    out_dir = os.path.dirname(os.path.abspath(out))
    created = []  # the folders the build creates for out: removed again if it fails
    d = out_dir
    while not os.path.lexists(d):
        created.append(d)
        d = os.path.dirname(d)
    os.makedirs(out_dir, exist_ok=True)
    ep_stem = out[: -len(".pt2")] if save_exported_programs else None
    scratch, moved, ok = None, [], False
    try:
        jobs = compile_jobs(jobs, model, len(entries), device)
        scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=out_dir)  # same file system
        scratch_stem = os.path.join(scratch, "ep") if ep_stem is not None else None
        kwargs = dict(device=device, ep_stem=scratch_stem, verbose=verbose, decode_fn=decode_fn,
                      prefill_fn=prefill_fn)
        if jobs > 1:
            from dsv4_export.workers import export_and_compile_in_workers

            _log(verbose, f"exporting + compiling {len(entries)} entries in {jobs} worker processes")
            done = export_and_compile_in_workers(model, names, entries, eager_ops, meta, jobs=jobs, **kwargs)
        else:
            done = export_and_compile(model, names, entries, eager_ops, meta, **kwargs)
        used = {op: schema for _, ops in done.values() for op, schema in ops.items()}
        meta[md.K_OPS_USED] = json.dumps(dict(sorted(used.items())), sort_keys=True)
        if ep_stem is not None:
            for e in entries:
                moved.append(f"{ep_stem}.{e.name}.ep.pt2")
                os.replace(f"{scratch_stem}.{e.name}.ep.pt2", moved[-1])
            _log(verbose, f"ExportedPrograms saved as {ep_stem}.<entry>.ep.pt2")
        write_package({e.name: done[e.name][0] for e in entries}, out, meta, tokenizer_json)  # last: the commit
        ok = True
    finally:  # an error or Ctrl-C / SIGTERM included: no ExportedProgram without its package, no folder made for it
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if not ok:
            for f in moved:
                if os.path.exists(f):
                    os.remove(f)
            for d in created:  # deepest first; only if still empty
                try:
                    os.rmdir(d)
                except OSError:
                    break
    _log(verbose, f"package written: {out} ({os.path.getsize(out) / 2**20:.1f} MiB)")
    return out


def _vocab_size(config: dict) -> int:
    for k in ("vocab_size", "n_vocab", "vocab"):
        if k in config:
            return int(config[k])
    raise KeyError("config has no vocab_size")


def _restoring(model: nn.Module, names: Sequence[str], fn: Callable):
    """Runs fn, then puts the caches back as they were (eager probes must not leave state behind)."""
    bufs = [model.get_buffer(n) for n in names]
    saved = [b.detach().clone() for b in bufs]
    try:
        return fn()
    finally:
        with torch.no_grad():
            for b, s in zip(bufs, saved):
                b.copy_(s)


def build_from_checkpoint(path: str, out: str, *, max_batch_size: int, max_seq_len: int, device: str,
                          dtype: torch.dtype = torch.bfloat16, simulate_quant: bool = True,
                          quant: str | None = None, act_quant: str | None = None,
                          decode_batches: Sequence[int] | None = None, prefill_batches: Sequence[int] | None = None,
                          prefill_lengths: Sequence[int] | None = None, save_exported_programs: bool = True,
                          verbose: bool = True, allow_beyond_max_position: bool = False,
                          jobs: int | None = None, prefill_chunks: Sequence[int] = (),
                          head_quant: str = "none") -> str:
    """Loads a checkpoint (a directory, or a Hugging Face repo id in the local HF cache: see
    ``dsv4_model.checkpoint.hub``) with ``dsv4_model.checkpoint.loader.load_model`` and exports it (see
    ``build_package``).

    ``quant`` / ``act_quant``: as for the loader ("nvfp4" converts the weights at load: the exported graphs then
    call dsv4::nvfp4_linear / nvfp4_moe; None keeps what the checkpoint stores). ``head_quant``: "nvfp4" puts the
    head in NVFP4 before export (Engine.from_pretrained's option; recorded in the package's quant info)."""
    if head_quant not in ("none", "nvfp4"):
        raise ValueError(f"head_quant must be 'none' or 'nvfp4', got {head_quant!r}")
    # the argument checks that need no weights, before the load (minutes for a large checkpoint)
    plan_build(out, max_batch_size=max_batch_size, max_seq_len=max_seq_len, decode_batches=decode_batches,
               prefill_batches=prefill_batches, prefill_lengths=prefill_lengths, prefill_chunks=prefill_chunks)
    if jobs is not None:
        from dsv4_model.model.checks import check_positive_int

        check_positive_int(jobs, "jobs")
    from dsv4_model.checkpoint.hub import resolve_checkpoint
    from dsv4_model.checkpoint.loader import load_model

    path = resolve_checkpoint(path, "--model")
    _log(verbose, f"loading {path} on {device} ({dtype}) ...")
    model, config = load_model(path, device=device, dtype=dtype, max_batch_size=max_batch_size,
                               max_seq_len=max_seq_len, simulate_quant=simulate_quant, progress=verbose,
                               quant=quant, act_quant=act_quant, allow_beyond_max_position=allow_beyond_max_position)
    if head_quant == "nvfp4":
        from dsv4_model.quant.nvfp4_modules import quantize_head_

        quantize_head_(model.head)
        model.quant_info = {**(getattr(model, "quant_info", None) or {}), "head": "nvfp4"}
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    tok = os.path.join(path, md.TOKENIZER_FILE)  # carried along: `export run --prompt TEXT` encodes with it
    return build_package(model, cfg, out, max_batch_size=max_batch_size, max_seq_len=max_seq_len, device=device,
                         decode_batches=decode_batches, prefill_batches=prefill_batches,
                         prefill_lengths=prefill_lengths, save_exported_programs=save_exported_programs, dtype=dtype,
                         verbose=verbose, jobs=jobs, prefill_chunks=prefill_chunks,
                         tokenizer_json=tok if os.path.isfile(tok) else None)


__all__ = ["Entry", "plan_entries", "plan_build", "check_out", "export_entry", "export_and_compile", "write_package",
           "build_package", "build_from_checkpoint", "CacheSpec"]

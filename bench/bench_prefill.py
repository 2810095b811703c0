"""Prefill time against prompt length on the H200: one forward of the whole prompt and the engine's chunked prefill
(Engine(prefill_chunk=), dsv4_model/runtime/prefill_chunks.py), against one HF transformers forward on the same
weights where HF fits, in one run.

Model: V4-Flash widths, random weights, NVFP4 W4A16 (HF bf16), `--layers` layers in V4-Flash's order of compress
ratios from a CSA layer ([4, 128] for 2; `--layers 43`: the whole stack, with `--experts` routed experts so that
it fits one GPU: a prefill token's expert FLOPs do not depend on the expert count, top-6 of any).

Per length: seconds, tokens/s, the split between the lightning indexer's scores + top-k (quadratic in the prompt:
every query scores every compressed key; CUDA events around Indexer.scores and topk_indices) and the rest, and
the FLOP floor at 790 TFLOP/s (bf16 dense, measured): 2 x the weights a token multiplies (non-expert weights,
shared + 6 routed experts per layer) + the attention's and the indexer's products at the mean position.

--compiled: also the chunks through one torch.compile graph per prompt length (tensor starts; the figure to
decide on a compiled prefill in the engine); --regional: a graph per distinct layer instead (compile time
independent of depth: what a 43-layer model needs).

--gemm-kernels auto,cublas: the eager modes again under each nvfp4_gemm_kernel override (cublas: dequantize +
cuBLAS for every linear past 64 rows and the MoE on the skinny kernel, the default before the wgmma kernels).
--no-eager: the compiled rows only (and HF); --profile: after each length's compiled timing, one more call under
torch.profiler and the kernels that took its GPU time, the largest first (name, calls, ms, share), then the copy
kernels' time by the op chain that launched them.

Run: python bench/bench_prefill.py [--lengths 4096,8192,32768,131072] [--chunk 8192] [--layers 2]
       [--experts 256] [--hf-max 8192] [--budget SECONDS] [--compiled [--regional]]
       [--gemm-kernels auto,cublas] [--no-eager] [--profile]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import dsv4_ops  # noqa: E402,F401
from dsv4_ops.overrides import kernel_overrides  # noqa: E402
from common import build_models, cuda_missing, flash, flash_plan, print_header  # noqa: E402
from timing import event_timed  # noqa: E402
from dsv4_model.model import attention as attention_mod  # noqa: E402
from dsv4_model.model.config import ModelConfig  # noqa: E402
from dsv4_model.model.indexer import Indexer  # noqa: E402
from dsv4_model.quant.quantize_model import quantize_model_  # noqa: E402
from dsv4_model.runtime.compiled_prefill import _layer_prefill  # noqa: E402
from dsv4_model.runtime.prefill_chunks import padded_chunks, prefill_in_chunks  # noqa: E402

DENSE_FLOPS = 790e12


def model_config(layers: int, experts: int) -> ModelConfig:
    """V4-Flash's first `layers` layers (its first hash layers), but a CSA + HCA pair for 2."""
    full, hashed = flash_plan(ModelConfig.v4_flash().n_layers)
    ratios = [4, 128] if layers == 2 else full[:layers]
    return flash(ratios, hash_layers=min(hashed, layers), experts=experts)


class IndexerTimer:
    """Sums the GPU time of the indexer's prefill scores and top-k (events recorded around each call)."""

    def __init__(self):
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._scores, self._topk = Indexer.scores, attention_mod.topk_indices

    def __enter__(self):
        self.events.clear()
        Indexer.scores = event_timed(self._scores, self.events)
        attention_mod.topk_indices = event_timed(self._topk, self.events)
        return self

    def __exit__(self, *exc):
        Indexer.scores, attention_mod.topk_indices = self._scores, self._topk

    def seconds(self) -> float:
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.events) / 1e3


def flop_floor(cfg: ModelConfig, model, S: int) -> float:
    """Seconds at DENSE_FLOPS for an S-token prefill: the weights' products (the head on one token only), the
    attention and the indexer at the mean position S / 2."""
    k, E = cfg.n_activated_experts, cfg.n_routed_experts
    weights = 0
    for name, t in model.state_dict().items():  # weights (NVFP4: packed buffers), not the caches
        if (name.startswith(("embed.", "mtp.", "head.")) or not t.is_floating_point() and t.dtype != torch.uint8
                or name.endswith(("_scale", "scale_2", ".ape"))):
            continue
        n = t.numel() * (2 if t.dtype == torch.uint8 else 1)  # packed FP4: two weights a byte
        if ".ffn.nvfp4.w" in name or ".ffn.experts.w" in name:  # routed: k of E per token
            n = n * k // E
        weights += n
    flops = 2 * weights * S
    mean = S / 2
    for r in cfg.compress_ratios[:cfg.n_layers]:
        keys = cfg.window_size + (min(cfg.index_topk, mean / r) if r == 4 else mean / r if r else 0)
        flops += 4 * cfg.n_heads * cfg.head_dim * keys * S
        if r == 4:
            flops += 2 * cfg.index_n_heads * cfg.index_head_dim * (mean / r) * S
    return flops / DENSE_FLOPS


def compiled_chunks(model, chunk: int, span: int, regional: bool = False):
    """run(ids, lens): the prompt's chunks through one torch.compile graph (fullgraph, static shapes, the starts
    a tensor: Transformer.prefill(start=tensor, span=span)), the last chunk padded; regional: one graph per
    distinct layer instead (CompiledPrefill(regional=True)'s form), the rest eager."""
    if regional:
        layer = torch.compile(_layer_prefill, fullgraph=True, dynamic=False)
        step = lambda t, n, s: model.prefill(t, n, start=s, span=span, layer_call=layer)  # noqa: E731
    else:
        step = torch.compile(lambda t, n, s: model.prefill(t, n, start=s, span=span), fullgraph=True,
                             dynamic=False)
    return lambda ids, lens: padded_chunks(ids, lens, chunk, step)


def timed(fn, reps: int, split: bool = True) -> tuple[float, float]:
    """(seconds per call, indexer seconds per call or nan) after one warm-up call; split=False: no indexer
    events (a compiled graph cannot call the timer)."""
    fn()
    torch.cuda.synchronize()
    if not split:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps, float("nan")
    with IndexerTimer() as it:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / reps
    return wall, it.seconds() / reps


def kernel_split(fn, top: int = 15, activity=None) -> list[tuple[str, int, float]]:
    """One call of fn under torch.profiler: (kernel name, calls, ms) of the `top` kernels by GPU time summed over
    calls, the largest first, and a last row "all kernels" (the sum over every kernel). activity: the profiler
    activity whose events are summed (CUDA by default; CPU lets the CPU tests exercise it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    act = ProfilerActivity.CUDA if activity is None else activity
    dev = DeviceType.CUDA if act == ProfilerActivity.CUDA else DeviceType.CPU
    with profile(activities=[act]) as prof:
        fn()
        if dev == DeviceType.CUDA:
            torch.cuda.synchronize()
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != dev:
            continue
        row = by_name.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us() / 1e3
    rows = sorted(((n, c, ms) for n, (c, ms) in by_name.items()), key=lambda r: -r[2])
    total = sum(ms for _, _, ms in rows)
    return rows[:top] + [("all kernels", sum(c for _, c, _ in rows), total)]


def copy_sources(fn, top: int = 12, pattern: str = "copy") -> list[tuple[str, int, float]]:
    """One call of fn under torch.profiler with shapes: the GPU time of the kernels whose name holds `pattern`, by
    the CPU op chain that launched them (outermost op > ... > launching op, with the launching op's input shapes):
    (chain, calls, ms), the largest first. Which op's copies a prefill pays for."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    by_chain: dict[str, list] = {}
    for e in prof.events():
        ks = [k for k in e.kernels if pattern in k.name]
        if not ks:
            continue
        names, p = [], e
        while p is not None:
            names.append(p.name)
            p = p.cpu_parent
        names.reverse()  # outermost first; kept: the outermost, any dsv4 op, the two innermost
        kept = [n for i, n in enumerate(names) if i == 0 or i >= len(names) - 2 or n.startswith("dsv4::")]
        chain = " > ".join(n[:40] for n in kept)
        key = f"{chain} {e.input_shapes}"
        row = by_chain.setdefault(key, [0, 0.0])
        row[0] += len(ks)
        row[1] += sum(k.duration for k in ks) / 1e3
    return sorted(((n, c, ms) for n, (c, ms) in by_chain.items()), key=lambda r: -r[2])[:top]


def print_split(S: int, rows: list[tuple[str, int, float]]) -> None:
    total = rows[-1][2]
    print(f"[S={S}] GPU time by kernel (one compiled call under the profiler):")
    for name, calls, ms in rows:
        print(f"    {ms:9.1f} ms {ms / max(total, 1e-9):6.1%} {calls:6d} x  {name[:110]}")
    sys.stdout.flush()


@torch.no_grad()
def print_rows(S, res, floor):
    """One length's rows: each mode's (wall, indexer) seconds or its failure, then HF's forward."""
    hf_t = res.get("hf")
    for mode, v in res.items():
        if mode == "hf":
            continue
        if isinstance(v, str):
            print(f"{S:7d} {mode:30} {v}")
            continue
        wall, ix = v
        vs = f"{hf_t / wall:6.2f}x" if isinstance(hf_t, float) else "   n/a"
        print(f"{S:7d} {mode:30} {wall:8.3f} {S / wall:9.0f} {ix:9.3f} {wall - ix:7.3f} {floor:8.3f} "
              f"{floor / wall:7.1%} {vs}")
    if hf_t is not None:
        print(f"{S:7d} {'HF forward':30} " + (f"{hf_t:8.3f} {S / hf_t:9.0f}" if isinstance(hf_t, float) else hf_t))
    sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,8192,32768,131072")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hf-max", type=int, default=8192, help="longest prompt given to HF (0: none)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; later lengths are skipped")
    ap.add_argument("--gemm-kernels", default="auto",
                    help="nvfp4_gemm_kernel overrides the eager modes run under, e.g. auto,cublas (dsv4_ops.overrides)")
    ap.add_argument("--compiled", action="store_true",
                    help="also time the chunks through one compiled graph per length (its compile time printed)")
    ap.add_argument("--regional", action="store_true",
                    help="with --compiled: compile one layer at a time (a graph per distinct layer; what "
                         "--regional-compile does to the engine's compiled prefill)")
    ap.add_argument("--attn-kernels", default="auto",
                    help="with --compiled: attn_kernel overrides its graph is timed under, e.g. auto,wgmma (the same "
                         "compiled graph: the override is read at each launch)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager rows (compiled and HF only)")
    ap.add_argument("--profile", action="store_true",
                    help="with --compiled: the GPU time of one compiled call split by kernel")
    args = ap.parse_args(argv)
    if cuda_missing("bench_prefill"):
        return 0
    t_start = time.perf_counter()
    lengths = [int(s) for s in args.lengths.split(",")]
    cfg = model_config(args.layers, args.experts)
    ours, hf, note = build_models(cfg, 1, max(lengths), with_hf=args.hf_max > 0)
    quantize_model_(ours)
    torch.cuda.empty_cache()
    print(f"[V4-Flash widths, {cfg.n_layers} layers {cfg.compress_ratios[:cfg.n_layers]}, {cfg.n_routed_experts} "
          f"experts, NVFP4 W4A16] {note}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"\nPrefill, batch 1 (eager; indexer = its scores + top-k; floor = FLOPs at {DENSE_FLOPS / 1e12:.0f} "
          f"TFLOP/s); each length's rows print as it finishes")
    print_header(f"{'tokens':>7} {'mode':30} {'seconds':>8} {'tokens/s':>9} {'indexer s':>9} {'rest s':>7} "
                 f"{'floor s':>8} {'of floor':>8} {'vs HF':>7}")
    for S in lengths:
        if time.perf_counter() - t_start > args.budget:
            print(f"{S:7d} skipped (time budget)", flush=True)
            continue
        ids = torch.randint(2, cfg.vocab_size, (1, S), device="cuda", generator=g)
        lens = torch.full((1,), S, dtype=torch.long, device="cuda")
        reps = 1 if S > 16384 else 2
        res = {}
        for kernel in ([] if args.no_eager else args.gemm_kernels.split(",")):
            for mode, chunk in (("whole", S), (f"chunks of {args.chunk}", args.chunk)):
                if mode != "whole" and S <= args.chunk:
                    continue
                mode += "" if kernel == "auto" else f" [{kernel}]"
                try:
                    with kernel_overrides(nvfp4_gemm_kernel=kernel):
                        res[mode] = timed(lambda: prefill_in_chunks(ours, ids, lens, chunk), reps)
                except torch.cuda.OutOfMemoryError:
                    res[mode] = "out of memory"
                gc.collect()
                torch.cuda.empty_cache()
        if args.compiled:
            c = min(S, args.chunk)
            mode = f"compiled{' regional' if args.regional else ''}, chunks {c}"
            try:
                run = compiled_chunks(ours, c, S, args.regional)
                t0 = time.perf_counter()
                run(ids, lens)
                torch.cuda.synchronize()
                print(f"[S={S}] {mode}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
                for attn in args.attn_kernels.split(","):
                    name = mode if attn == "auto" else f"{mode} [attn {attn}]"
                    with kernel_overrides(attn_kernel=attn):
                        res[name] = timed(lambda: run(ids, lens), reps, split=False)
                        if args.profile:
                            print(f"[S={S}] {name}: GPU time by kernel", flush=True)
                            print_split(S, kernel_split(lambda: run(ids, lens)))
                            try:  # where the copy kernels come from (a failure here costs only these lines)
                                for chain, calls, ms in copy_sources(lambda: run(ids, lens)):
                                    print(f"    copies {ms:9.1f} ms {calls:6d} x  {chain[:200]}")
                            except Exception as e:  # noqa: BLE001
                                print(f"    copy sources not found: {type(e).__name__}: {e}")
            except Exception as e:  # report and go on: the eager rows stand
                res[mode] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
        if hf is not None and S <= args.hf_max:
            try:
                res["hf"] = timed(lambda: hf(input_ids=ids, use_cache=False, logits_to_keep=1), reps)[0]
            except torch.cuda.OutOfMemoryError:
                res["hf"] = "out of memory"
            gc.collect()
            torch.cuda.empty_cache()
        print_rows(S, res, flop_floor(cfg, ours, S))
        print(f"[S={S}] done at {time.perf_counter() - t_start:.0f} s", flush=True)

    return 0


if __name__ == "__main__":
    raise SystemExit(main())

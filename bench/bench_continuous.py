"""Continuous batching against a static batch on the same engine, in one process (no HTTP): issue #48's "Must show".

    python bench/bench_continuous.py                                  # the built-in model, concurrency 1, 8, 32
    python bench/bench_continuous.py --model flash2 --concurrency 1,8,64     # random NVFP4 V4-Flash widths
    python bench/bench_continuous.py --model flash43 --concurrency 1,8,64 --experts 160

For each concurrency C the scheduler (dsv4_model.runtime.scheduler) serves 3C requests (random prompts of
--prompt-len tokens, --max-tokens each, EOS ignored, greedy), all submitted at once on a scheduler of C rows, so
C are in flight and the others join as rows free up. Reported: output tokens/s over the run (prefill included),
TTFT and TPOT percentiles (TPOT includes the prefill chunks of requests that join meanwhile), and the steady state:
tokens per second over the iterations that ran decode alone. The peer, from the same run and engine: a static
batch of C rows (the decode runner's step at bucket C from position --prompt-len, as bench_parallel_decode times
it): tokens/s = C / step time; goal (issue #48): steady state >= 95% of it. Where it falls short, the lines under
the row say why: the steady steps in which all C rows emitted (the others: rows whose requests ended draining the
batch, which a static batch of equal requests never has), each steady step's device time, the stream's idle gap
before it and the host's time (CUDA).

--compiled-prefill: each C runs twice, prefill chunks eager and then compiled (Engine.compile_prefill: one graph per
(rows, tokens) bucket, compiled during the warm-up run; the line says how many and how long), TTFT side by side.
Without it the prefill is eager, as in earlier figures.

--model: the built-in model ("default"), a checkpoint directory, or bench/common.py's random NVFP4 presets
(flash2, flash43 = V4-Flash's 43 layers, micro...), built straight on the device. --speculate K: the scheduler's
steps speculative (greedy, K drafts from the model's MTP block or DSpark module: the built-in model or a
checkpoint; a preset with --drafter mtp|dspark gets a random one, whose drafts are rarely accepted: the pass's cost,
printed as ms per pass against the static batch's plain step), against the same plain static batch. A list
(--speculate 1,3,5) runs each K on the one engine (built with room for the largest): one build and one static batch
per C for all of them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from common import DRAFTERS, percentile, preset_engine  # noqa: E402
from timing import event_timed  # noqa: E402
from dsv4_model.runtime.engine import Engine  # noqa: E402
from dsv4_model.runtime.requests import Request  # noqa: E402
from dsv4_model.runtime.sampling import SamplingParams  # noqa: E402
from dsv4_model.runtime.scheduler import Scheduler  # noqa: E402
from dsv4_model.runtime.session import RunnerOptions  # noqa: E402
from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler  # noqa: E402


def build_engine(args, rows: int, max_seq_len: int, device: torch.device) -> Engine:
    if args.model != "default" and not os.path.isdir(args.model):
        return preset_engine(args.model, experts=args.experts, rows=rows, max_seq_len=max_seq_len, device=device,
                             spare_window_slots=max(args.ks), drafter=args.drafter)
    if args.drafter:
        raise SystemExit("--drafter: a preset's random drafter; a checkpoint speculates with its own")
    cuda = device.type == "cuda"
    kw = {} if args.model == "default" else {"path": args.model}
    if max(args.ks):
        kw["spare_window_slots"] = max(args.ks)
    return Engine.from_pretrained(**kw, device=str(device), max_batch_size=rows, max_seq_len=max_seq_len,
                                  runner_options=RunnerOptions(compile=cuda, cuda_graphs=cuda), progress=False)


def prefill_graphs(engine: Engine) -> int:
    """Prefill bucket graphs the engine has compiled (0 while its prefill is eager)."""
    cp = engine.compiled_prefill()
    return 0 if cp is None else cp.compiled


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_continuous(engine: Engine, C: int, args, gen: torch.Generator, k: int = 0) -> dict:
    """k: drafts per speculative step (0: plain steps)."""
    opts = dict(rows=C, max_prefill_tokens=args.max_prefill_tokens, reuse=False, tokenizer=None)
    if k:  # greedy speculative steps (the checkpoint's drafter: MTP, or DSpark where it has one)
        method = "dspark" if getattr(engine.model, "dspark", None) is not None else "mtp"
        sched = SpeculativeScheduler(engine, k, method=method, modes=("greedy",),
                                     dspark_cut=args.dspark_cut, **opts)
        sched.speculation.judged = []  # every pass kept: what a confidence cut would have given (DSpark)
    else:
        sched = Scheduler(engine, **opts)
    V = engine.vocab_size
    reqs = [Request(torch.randint(0, V, (args.prompt_len,), generator=gen).tolist(), SamplingParams(),
                    max_tokens=args.max_tokens, ignore_eos=True) for _ in range(args.requests_per_row * C)]
    # decode-only iterations: no prefill chunk in this one or the one before (an iteration waits for the previous
    # one's device work): their tokens per second is the steady state a static batch is compared with (a plain
    # step: one token per generating row; a speculative one: the tokens read back)
    steady = {"rows": 0, "s": 0.0, "steps": 0}
    full = {"s": 0.0, "steps": 0}  # the steady iterations in which every one of the C rows emitted (no drain)
    last = {"t": None, "chunks": 0, "rows": 0, "clean": False, "steps": 0}
    timer = StepTimer(sched.runner, engine.device)
    # host seconds of this iteration's planning + launch, and of reading the previous one's ids (the wait included)
    host = {"launch": 0.0, "read": 0.0, "steady_launch": 0.0, "steady_read": 0.0}
    for name in ("launch", "read"):
        setattr(sched, f"_{name}", host_timed(getattr(sched, f"_{name}"), host, name))

    def tokens() -> int:
        return sched.speculation.emitted if k else sched.stats.decode_rows

    def on_step():
        t, st, n = time.perf_counter(), sched.stats, tokens()
        clean = st.prefill_chunks == last["chunks"]
        counted = clean and last["clean"] and last["t"] is not None and n > last["rows"]
        timer.iteration(counted)
        if counted:
            steady["rows"] += n - last["rows"]
            steady["s"] += t - last["t"]
            steady["steps"] += st.decode_steps - last["steps"]
            if not k and n - last["rows"] == C and st.decode_steps - last["steps"] == 1:
                full["s"] += t - last["t"]
                full["steps"] += 1
            host["steady_launch"] += host["launch"]
            host["steady_read"] += host["read"]
        host["launch"] = host["read"] = 0.0
        last.update(t=t, chunks=st.prefill_chunks, rows=n, clean=clean, steps=st.decode_steps)

    sched.on_step = on_step
    sync(engine.device)
    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    sync(engine.device)
    wall = time.perf_counter() - t0
    timer.remove()
    bad = [r.finish_reason for r in reqs if r.finish_reason != "length" or len(r.token_ids) != args.max_tokens]
    if bad:
        raise RuntimeError(f"requests ended early: {bad[:4]}")
    ttft = [r.timings.ttft_s for r in reqs]
    tpot = [r.tpot_s for r in reqs if r.tpot_s is not None]
    return {"wall_s": wall, "tokens_per_s": len(reqs) * args.max_tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
            "steady_tokens_per_s": steady["rows"] / steady["s"] if steady["s"] else float("nan"),
            "decode_steps": sched.stats.decode_steps,
            "steady_ms_per_step": 1e3 * steady["s"] / steady["steps"] if steady["steps"] else float("nan"),
            "steady_rows_per_step": steady["rows"] / steady["steps"] if steady["steps"] else float("nan"),
            "full_tokens_per_s": C * full["steps"] / full["s"] if full["s"] else float("nan"),
            "full_steps": full["steps"],
            "steady_steps": steady["steps"], "device": timer.summary(),
            "steady_host_ms": {k: 1e3 * host[f"steady_{k}"] / steady["steps"] if steady["steps"] else float("nan")
                               for k in ("launch", "read")},
            "speculation": sched.speculation if k else None}


def host_timed(fn, acc: dict, key: str):
    """fn wrapped so that each call's host seconds add to acc[key]."""
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    return timed


class StepTimer:
    """The device time of each decode step the runner launches (CUDA events around runner.launch: the graph's
    replay and the copies it makes), read once at the end: a step slower on the device tells apart from host gaps
    between steps. None off CUDA."""

    def __init__(self, runner, device: torch.device):
        self.runner, self.pairs, self.steady, self.seen = runner, [], [], 0
        self.cuda = device.type == "cuda"
        if self.cuda:
            runner.launch = event_timed(runner.launch, self.pairs)

    def iteration(self, steady: bool) -> None:
        """An iteration ended: its launch (if it made one: a speculative run's last read launches nothing) is a
        steady one's where `steady`."""
        if steady and len(self.pairs) > self.seen:
            self.steady.append(len(self.pairs) - 1)
        self.seen = len(self.pairs)

    def remove(self) -> None:
        self.runner.__dict__.pop("launch", None)

    def summary(self) -> dict | None:
        """median ms of every launch (prefill iterations' included); over the steady iterations' launches: mean ms
        and the mean ms the stream spent from the previous launch's end to this one's start (GPU idle waiting for
        the host, or work outside the launches: a prefill chunk, row swaps, compressor states saved / restored)."""
        if not self.cuda or not self.pairs:
            return None
        times = sorted(a.elapsed_time(b) for a, b in self.pairs)
        steady = [i for i in self.steady if i > 0]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {"median_ms": times[len(times) // 2],
                "steady_mean_ms": mean([self.pairs[i][0].elapsed_time(self.pairs[i][1]) for i in steady]),
                "steady_gap_ms": mean([self.pairs[i - 1][1].elapsed_time(self.pairs[i][0]) for i in steady]),
                "steady_launches": len(steady)}


def print_speculation(spec) -> None:
    """Acceptance per draft position (and the drafter's prediction of it); with a confidence head, what cutting each
    block at its first draft predicted below a threshold would have given (tokens and drafts verified per pass: the
    verification's cost follows the drafts, docs/dspark.md)."""
    def rates(values):
        return " / ".join("-" if v != v else f"{v:.2f}" for v in values)

    print(f"    speculation: {spec.tokens_per_step:.2f} tokens per pass; accepted per position "
          f"{rates(spec.acceptance())}", flush=True)
    if spec.predicted_rows:
        print(f"    the confidence head predicted {rates(spec.predicted_acceptance())}", flush=True)
        cuts = [(t, *spec.cut(t)) for t in (0.1, 0.3, 0.5, 0.7, 0.9)]
        print("    cut at p < " + ", ".join(f"{t}: {tok:.2f} tokens / {ver:.2f} drafts" for t, tok, ver in cuts)
              + f" (no cut: {spec.tokens_per_step:.2f} / {spec.k})", flush=True)


def run_static(engine: Engine, C: int, args, gen: torch.Generator, staggered: bool = False,
               device_ms: list | None = None) -> float:
    """ms per decode step of a static batch of C rows after a prefill of C random prompts of --prompt-len (rows that
    differ: identical rows would route every row to the same experts and read a batch of one's weights). staggered:
    row r's prompt is --prompt-len + (17 r mod --max-tokens) long, so the rows sit at positions spread over the
    range the scheduler's rows decode in, as they do there (aligned rows close their compressor windows in the
    same steps: 3 of 4 steps of a CSA layer without one)."""
    runner = engine.runner()
    runner.prepare(C)
    engine.reset()
    lengths = [args.prompt_len + ((17 * r) % args.max_tokens if staggered else 0) for r in range(C)]
    prompts = torch.randint(0, engine.vocab_size, (C, max(lengths)), generator=gen)
    logits = engine.prefill(prompts, torch.tensor(lengths)) if staggered else engine.prefill(prompts)
    runner.begin(lengths, [SamplingParams() for _ in range(C)])
    runner.sample_first(logits)
    for _ in range(3):
        runner.step()
    sync(engine.device)
    cuda = engine.device.type == "cuda"
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    t0 = time.perf_counter()
    if cuda:
        start.record()
    for _ in range(args.max_tokens):
        runner.step()
    if cuda:
        end.record()
    sync(engine.device)
    wall_ms = 1e3 * (time.perf_counter() - t0) / args.max_tokens
    if device_ms is not None and cuda:
        device_ms.append(start.elapsed_time(end) / args.max_tokens)
    engine.reset()
    return wall_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default, a checkpoint dir, or a preset (flash2, flash43, ...)")
    ap.add_argument("--experts", type=int, default=None, help="a preset's routed experts (default: all)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-row", type=int, default=3)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--drafter", choices=DRAFTERS, default=None,
                    help="a preset's random drafter for --speculate (bench/common.py with_drafter): the step's cost")
    ap.add_argument("--dspark-cut", type=float, default=0.0, metavar="P",
                    help="DSpark's confidence cut with --speculate (docs/dspark.md; 0: off)")
    ap.add_argument("--speculate", default="0", metavar="K[,K...]",
                    help="the scheduler's steps speculative with K drafts (against the plain static batch); a list "
                         "runs each K on one engine")
    ap.add_argument("--draft-head", choices=("stored", "nvfp4"), default="stored",
                    help="with --speculate: the head the drafts read (Engine.set_draft_head)")
    ap.add_argument("--compiled-prefill", action="store_true",
                    help="also run the scheduler with compiled prefill chunks (eager and compiled TTFT per C)")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    try:
        args.ks = [int(k) for k in args.speculate.split(",")]
    except ValueError:
        raise SystemExit(f"--speculate: K or a comma-separated list of K, got {args.speculate!r}") from None
    if any(k < 0 for k in args.ks):
        raise SystemExit(f"--speculate: each K must be >= 0, got {args.speculate!r}")
    device = torch.device(args.device)
    t0 = time.perf_counter()
    # (room for the staggered static batch: prompts up to --max-tokens longer, then --max-tokens + 3 steps)
    engine = build_engine(args, max(levels), args.prompt_len + 2 * args.max_tokens + 8 + 2 * max(args.ks), device)
    if max(args.ks) and args.draft_head != "stored":
        engine.set_draft_head(args.draft_head)
    print(f"{args.model}: {engine.config.n_layers} layers on {device} (built in {time.perf_counter() - t0:.1f} s); "
          f"prompts {args.prompt_len} tokens, {args.max_tokens} out, {args.requests_per_row} requests per row",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    print(f"{'C':>3} {'prefill':>8} {'tok/s':>9} {'steady tok/s':>12} {'static tok/s':>12} {'steady/static':>13} "
          f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'static ms/step':>14}", flush=True)
    for C in levels:
        static_dev: list[float] = []
        ms = run_static(engine, C, args, gen, device_ms=static_dev)
        ms_st = run_static(engine, C, args, gen, staggered=True)
        static = 1e3 * C / ms
        modes = ("eager", "compiled") if args.compiled_prefill else ("eager",)
        for k, mode in [(k, m) for k in args.ks for m in modes]:
            engine.compile_prefill = mode == "compiled"
            t0 = time.perf_counter()
            run_continuous(engine, C, args, gen, k)  # warm: compile / capture, first-touch allocations
            warm, graphs = time.perf_counter() - t0, prefill_graphs(engine)
            cont = run_continuous(engine, C, args, gen, k)
            print(f"{C:3d} {mode:>8} {cont['tokens_per_s']:9.1f} {cont['steady_tokens_per_s']:12.1f} {static:12.1f} "
                  f"{cont['steady_tokens_per_s'] / static:13.3f} "
                  f"{cont['ttft_p50_ms']:7.1f}/{cont['ttft_p99_ms']:<8.1f} {cont['tpot_p50_ms']:7.2f}/"
                  f"{cont['tpot_p99_ms']:<8.2f} {ms:14.3f}", flush=True)
            if cont["speculation"] is not None:
                print(f"    steady state (K = {k}): {cont['steady_ms_per_step']:.3f} ms per speculative pass "
                      f"({cont['steady_ms_per_step'] / ms:.3f}x the static batch's plain step)", flush=True)
                print_speculation(cont["speculation"])
            else:  # where a shortfall comes from: a slower step, or rows without a token in it
                step_ms = cont["steady_ms_per_step"]
                print(f"    static batch with staggered positions: {ms_st:.3f} ms per step (steady / it: "
                      f"{cont['steady_tokens_per_s'] / (1e3 * C / ms_st):.3f})", flush=True)
                print(f"    steady state: {step_ms:.3f} ms per step ({step_ms / ms:.3f}x the static batch's), "
                      f"{cont['steady_rows_per_step']:.2f} of {C} rows emit per step; "
                      f"{cont['steady_steps']} of {cont['decode_steps']} decode steps counted", flush=True)
                print(f"    steady steps with all {C} rows emitting ({cont['full_steps']}): "
                      f"{cont['full_tokens_per_s']:.1f} tok/s = {cont['full_tokens_per_s'] / static:.3f}x the static "
                      "batch's (the rest of the steady steps: the last rows draining)", flush=True)
                dev = cont["device"]
                if dev is not None and static_dev:
                    print(f"    device time per decode step (CUDA events): median {dev['median_ms']:.3f} ms under "
                          f"the scheduler, {static_dev[0]:.3f} ms in the static batch; steady launches "
                          f"({dev['steady_launches']}): mean {dev['steady_mean_ms']:.3f} ms, stream gap before each "
                          f"{dev['steady_gap_ms']:.3f} ms", flush=True)
                hm = cont["steady_host_ms"]
                print(f"    host per steady iteration: plan + launch {hm['launch']:.3f} ms, reading the previous "
                      f"step's ids {hm['read']:.3f} ms (its wait for the device included)", flush=True)
            if mode == "compiled":  # buckets first met in the timed run would have compiled inside it
                print(f"    compiled prefill: {graphs} bucket graphs so far (warm-up run {warm:.1f} s); "
                      f"{prefill_graphs(engine) - graphs} more compiled in the timed run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

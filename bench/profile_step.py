"""Where a decode step's GPU time goes, kernel by kernel: the plain step and (--speculate K) the speculative pass of
the same model in one run, each over --steps steps of a static batch of --batch rows after a prefill of
--prompt-len random tokens (issue #31: what a speculative pass costs beyond the plain step, and in which kernels).

    python bench/profile_step.py --model flash2 --speculate 1 --drafter mtp --draft-head nvfp4
    python bench/profile_step.py --model flash43 --experts 64 --speculate 1 --drafter mtp --draft-head nvfp4
    python bench/profile_step.py --model flash43 --experts 64 --speculate 1 --drafter dspark --draft-head nvfp4
    python bench/profile_step.py --device cpu --steps 2 --speculate 1      # the built-in model: a dry run

Per step: the wall time by CUDA-graph replay (what decode runs), then torch.profiler's kernel time by name over the
same compiled step run without its graph (every kernel recorded; the graph replays the same ones): the --top
largest, kernels per step, their sum. The difference of the two tables is what the pass adds. --model: the built-in
model ("default") or a bench/common.py preset with a random drafter (--drafter mtp); random drafts are rarely
accepted, which does not change a pass's cost (it verifies K + 1 tokens either way).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from common import preset_engine  # noqa: E402
from dsv4_model.runtime.engine import Engine  # noqa: E402
from dsv4_model.runtime.sampling import SamplingParams  # noqa: E402
from dsv4_model.runtime.session import RunnerOptions  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernel_table(step, steps: int, device: torch.device) -> tuple[dict[str, float], int]:
    """{name: µs per step} of the device kernels (CPU ops on a CPU run) of `steps` calls of step(), and kernels
    per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    us, count = collections.Counter(), 0
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and not e.name.startswith(("dsv4::", "aten::")):
            continue
        t = getattr(e, "device_time", None) if cuda else e.cpu_time
        if t is None:
            t = e.cuda_time
        us[e.name] += t / steps
        count += 1
    return dict(us), count // steps


def report(label: str, wall_ms: float, table: dict[str, float], per_step: int, top: int) -> None:
    total = sum(table.values())
    print(f"\n## {label}: {wall_ms:.3f} ms per step (graph replay); {per_step} kernels per step, "
          f"{total:.1f} µs of kernel time", flush=True)
    for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:9.1f} µs  {100 * us / total:5.1f}%  {name[:110]}")


def timed(step, steps: int, device: torch.device) -> float:
    for _ in range(3):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / steps


def dspark_rows(engine, k: int, prompts: torch.Tensor, seq: int):
    """A DSpark runner whose rows decode: the scheduler admits the prompts (its prefill commits DSpark's rings and
    drafts each row's first block), steps until every row has emitted, and hands over its runner, whose step()
    continues the rows on the device (the scheduler is not used after)."""
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler

    B, S = prompts.shape
    sched = SpeculativeScheduler(engine, k, method="dspark", modes=("greedy",), rows=B, reuse=False, tokenizer=None)
    reqs = [sched.submit(Request(p.tolist(), SamplingParams(), max_tokens=seq - S, ignore_eos=True)) for p in prompts]
    while not all(len(r.token_ids) >= 2 for r in reqs):
        sched.step()
    return sched.runner


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--speculate", type=int, default=0, metavar="K")
    ap.add_argument("--drafter", choices=("mtp", "dspark"), default=None,
                    help="a preset's random MTP block or DSpark module (the built-in model: its MTP block)")
    ap.add_argument("--draft-head", choices=("stored", "nvfp4"), default="stored")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    K, B = args.speculate, args.batch
    # room for the warm-up, timed and profiled steps of both runs (a speculative step writes up to 2K ahead)
    seq = args.prompt_len + (2 * (args.steps + 3) + 4) * (K + 1) + 2 * K + 64
    if args.model == "default":
        engine = Engine.from_pretrained(device=str(device), max_batch_size=B, max_seq_len=seq, progress=False,
                                        spare_window_slots=K,
                                        runner_options=RunnerOptions(compile=cuda, cuda_graphs=cuda))
    else:
        engine = preset_engine(args.model, experts=args.experts, rows=B, max_seq_len=seq, device=device,
                               spare_window_slots=K, drafter=args.drafter)
    if K and args.draft_head != "stored":
        engine.set_draft_head(args.draft_head)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, engine.vocab_size, (B, args.prompt_len), generator=gen)
    params = [SamplingParams() for _ in range(B)]
    print(f"# {args.model}, batch {B}, prompt {args.prompt_len}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if cuda else ""), flush=True)

    runner = engine.runner()
    runner.prepare(B)
    engine.reset()
    runner.begin([args.prompt_len] * B, params)
    runner.sample_first(engine.prefill(prompts))
    wall = timed(runner.step, args.steps, device)
    plain = kernel_table(lambda: runner.step(replay=False), args.steps, device)
    report("plain step", wall, *plain, args.top)
    if not K:
        return 0
    if args.drafter == "dspark":
        spec = dspark_rows(engine, K, prompts, seq)
    else:
        spec = engine.speculative_runner(K)
        spec.prepare(B, "greedy")
        engine.reset()
        logits, last = engine.prefill(prompts, speculate=True)
        spec.begin([args.prompt_len] * B, params)
        spec.sample_first(logits)
        spec.start(last)
    wall_s = timed(spec.step, args.steps, device)
    table = kernel_table(lambda: spec.step(replay=False), args.steps, device)
    report(f"speculative pass, K = {K} ({wall_s / wall:.3f}x the plain step)", wall_s, *table, args.top)
    extra = {n: table[0].get(n, 0.0) - plain[0].get(n, 0.0) for n in set(table[0]) | set(plain[0])}
    print(f"\n## what the pass adds, by kernel (µs per step; +{sum(extra.values()):.1f} in all)")
    for name, us in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
        print(f"  {us:+9.1f} µs  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

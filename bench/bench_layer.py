"""Kernels and microseconds per decoder layer in the decode step (batch 1, or --batch B rows that differ).

Method: models that differ by exactly one layer. The base has layers [CSA, HCA] (compress ratios [4, 128]); each
variant appends one layer of a kind (CSA = ratio 4 with the lightning indexer, HCA = 128, SWA = 0). Per layer =
variant - base, so the embedding, hc_head, head and sampler cancel out. Every model: V4-Flash widths
(dim 4096, 64 heads x 512, 256 routed experts top-6, hc 4), random weights, NVFP4 W4A16 (`quantize_model_`),
the DecodeRunner step (decode_step + dsv4::sample) compiled and captured as one CUDA graph, batch 1 (or --batch), decoding
from position --prompt after a real prefill.
  us/step:  CUDA-graph replay, back to back, the best of 3 runs of --steps steps (a layer's share is a
            difference of two models: one run's noise is a visible part of it).
  kernels:  GPU kernels of one compiled step run outside the graph (the same kernels the graph holds),
            counted with torch.profiler (memcpy / memset excluded); the extra layer's kernels are listed by name.

Run: python bench/bench_layer.py [--kinds csa,hca,swa] [--prompt 256] [--experts 256] [--batch 64]
     python bench/bench_layer.py --device cpu --micro --no-compile   # dry run of the method on a CPU
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import dsv4_ops  # noqa: E402,F401
from common import flash, micro  # noqa: E402
from dsv4_model.runtime.compiled import DecodeRunner  # noqa: E402
from dsv4_model.model.decode_options import DecodeOptions  # noqa: E402
from dsv4_ops.overrides import parse as parse_overrides  # noqa: E402
from dsv4_ops.overrides import set_overrides  # noqa: E402
from dsv4_model.quant.random_model import bf16_released_values_, init_random_weights, randomize_floats_  # noqa: E402
from dsv4_model.model.config import ModelConfig  # noqa: E402
from dsv4_model.model.transformer import Transformer  # noqa: E402
from dsv4_model.quant.quantize_model import quantize_model_  # noqa: E402
from dsv4_model.runtime.sampling import SamplingParams  # noqa: E402

RATIO = {"csa": 4, "hca": 128, "swa": 0}
BASE = [4, 128]
GOAL_KERNELS, GOAL_US = 12, 45.0


def config(ratios: list[int], tiny: bool, experts: int) -> ModelConfig:
    return micro(ratios) if tiny else flash(ratios, experts=experts)


def build(cfg: ModelConfig, device: str, max_seq: int, batch: int = 1) -> Transformer:
    model = Transformer(cfg, max_batch_size=batch, max_seq_len=max_seq, dtype=torch.bfloat16, device="meta")
    model.to_empty(device=device)
    if device == "cuda":
        randomize_floats_(model, 0, cfg.n_routed_experts)  # on the GPU: GBs of weights, no host round trip
        bf16_released_values_(model)
        model.narrow_weights_()  # as the loader does
    else:
        init_random_weights(model, 0)
    quantize_model_(model)
    model.setup_runtime(torch.device(device))
    return model.eval()


@torch.no_grad()
def start(runner: DecodeRunner, model: Transformer, prompt: torch.Tensor) -> None:
    B = prompt.shape[0]
    runner.prepare(B)
    lengths = torch.full((B,), prompt.shape[1], dtype=torch.long, device=prompt.device)
    logits = model.prefill(prompt, lengths)
    runner.begin(lengths, [SamplingParams() for _ in range(B)])
    runner.sample_first(logits)
    for _ in range(3):
        runner.step(runner.cuda_graphs)


@torch.no_grad()
def us_per_step(runner: DecodeRunner, steps: int) -> float:
    on_cuda = runner.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        runner.step(runner.cuda_graphs)
    if on_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e6


def kernel_key(name: str) -> str:
    """An Inductor kernel's name without its trailing index: the index is the kernel's position in its graph, so
    the same fused kernel gets another one in the base model and in the model with a layer added."""
    return re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name


@torch.no_grad()
def kernels_per_step(runner: DecodeRunner, steps: int = 3) -> collections.Counter:
    """Kernel names of one step (outside the graph), as a multiset."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = runner.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            runner.step(False)
        if on_cuda:
            torch.cuda.synchronize()
    names: collections.Counter = collections.Counter()
    for e in prof.events():
        if on_cuda:
            if e.device_type != DeviceType.CUDA or e.name.startswith(("Memcpy", "Memset")):
                continue
        elif not e.name.startswith(("aten::", "dsv4::")) or e.cpu_parent is not None:
            continue  # CPU dry run: top-level ops stand in for kernels
        name = kernel_key(e.name)
        names[name] += 1
        KERNEL_US[name] += e.time_range.elapsed_us() / steps if on_cuda else 0.0
    return collections.Counter({k: v // steps for k, v in names.items() if v // steps})


REPEATS = 3  # timed runs of --steps steps each (the positions move on by steps each run)

# Per kernel name: GPU time per step summed over the runs measured (kernels run outside the graph, so each
# duration is the kernel's own time, without launch gaps); main() reports the extra layer's share.
KERNEL_US: collections.Counter = collections.Counter()


CATEGORIES = (  # (label, substrings of a kernel name), first match wins (Inductor names quote the ops they fuse)
    ("Inductor pointwise", ("triton_poi",)),
    ("Inductor reduction", ("triton_per", "triton_red")),
    ("dsv4 NVFP4", ("nvfp4_",)),
    ("dsv4 other", ("indexer_", "sample_", "amax", "quantize", "per_row", "attn_", "hc_", "rms_norm_rope",
                    "compressor_", "hadamard_", "store_keys", "fp32_linear", "router_topk")),
    ("cuBLAS / CUTLASS", ("gemv", "gemm", "dot_kernel", "reduce_1Block", "splitKreduce", "cutlass", "nvjet", "xmma")),
    ("ATen / other", ("",)),
)


def category(name: str) -> str:
    return next(label for label, keys in CATEGORIES if any(k in name for k in keys))


def categorize(kernels: collections.Counter) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for name, count in kernels.items():
        out[category(name)] += count
    return out


def measure(ratios, args, device):
    KERNEL_US.clear()
    cfg = config(ratios, args.micro, args.experts)
    model = build(cfg, device, args.prompt + REPEATS * args.steps + 64, args.batch)  # room for every position
    runner = DecodeRunner(model, compile=args.compile, cuda_graphs=device == "cuda", graph_mode="manual",
                          step_options=DecodeOptions.parse(args.decode_options))
    g = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(2, cfg.vocab_size, (args.batch, args.prompt), device=device, generator=g)
    start(runner, model, prompt)
    us = min(us_per_step(runner, args.steps) for _ in range(REPEATS))  # best of: run-to-run noise
    kernels = kernels_per_step(runner)
    busy = collections.Counter(KERNEL_US)
    del runner, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return us, kernels, busy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="csa,hca,swa")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1, help="decode rows (random prompts: they route apart)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--micro", action="store_true", help="tiny widths (a dry run of the method)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--decode-options", default="", help='debug overrides, e.g. "hc_pre=0,attention=torch"')
    ap.add_argument("--kernel-overrides", default="", help='dsv4_ops.overrides, e.g. "attn_kernel=simt,pdl=0"')
    args = ap.parse_args(argv)
    set_overrides(parse_overrides(args.kernel_overrides))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_layer: needs a CUDA GPU (skipped; --device cpu --micro dry-runs the method)")
        return 0
    t0 = time.perf_counter()
    base_us, base_k, base_busy = measure(BASE, args, args.device)
    print(f"base {BASE}: {base_us:.1f} us/step, {sum(base_k.values())} kernels/step", flush=True)
    rows = []
    for kind in [k for k in args.kinds.split(",") if k]:
        us, k, busy = measure(BASE + [RATIO[kind]], args, args.device)
        extra = k - base_k
        n = sum(k.values()) - sum(base_k.values())
        extra_busy = collections.Counter({name: busy[name] - base_busy[name] for name in busy})
        rows.append((kind, us - base_us, n, extra, extra_busy))
        print(f"+{kind}: {us:.1f} us/step, {sum(k.values())} kernels/step", flush=True)
    unit = "kernels" if args.device == "cuda" else "top-level ops (CPU dry run)"
    print(f"\nPer decoder layer, batch {args.batch}, NVFP4 W4A16, {'micro' if args.micro else 'V4-Flash'} widths, "
          f"{'compiled' if args.compile else 'eager'} + {'CUDA graph' if args.device == 'cuda' else 'no graph'}, "
          f"position {args.prompt}")
    print(f"{'layer':6} {'us/layer':>9} {unit:>12}   goal: <= {GOAL_KERNELS} kernels, <= {GOAL_US:.0f} us")
    for kind, us, n, extra, _ in rows:
        print(f"{kind:6} {us:9.1f} {n:12d}")
    for kind, _, _, extra, busy in rows:
        cats = categorize(extra)
        us = collections.Counter()  # the layer's GPU time per kind (same-count shifts included)
        for name, v in busy.items():
            us[category(name)] += v
        timed = args.device == "cuda"
        print(f"\n{kind} layer by kind: " + ", ".join(
            f"{label} {cats[label]}" + (f" ({us[label]:.1f} us)" if timed else "")
            for label, _ in CATEGORIES if cats[label] or (timed and abs(us[label]) >= 0.5)))
    for kind, _, _, extra, busy in rows:
        print(f"\n{kind} layer's {unit} (count x name; GPU us per step of the layer's share, kernels run outside "
              f"the graph):")
        for name, c in extra.most_common():
            print(f"  {c:3d} x {busy[name]:7.2f} us  {name[:100]}")
        if args.device == "cuda":
            # kernels the base model has as often, but which run longer (or shorter) with this layer added
            shifted = [(v, name) for name, v in busy.items() if name not in extra and abs(v) >= 1.0]
            for v, name in sorted(shifted, reverse=True):
                print(f"   same count, {v:+7.2f} us  {name[:100]}")
            print(f"  busy: {sum(v for v in busy.values()):.1f} us of GPU time in the layer's kernels (sum over names)")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

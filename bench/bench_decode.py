"""Decode speed on the H200: eager vs compiled vs compiled + CUDA graph (manual capture) vs torch.compile
"reduce-overhead", against HF transformers `generate` on the same weights, in one run.

Models (random weights, bf16): "micro" (3 layers: SWA, CSA, HCA; dim 64) and "flash2" (V4-Flash widths,
2 layers: CSA + HCA, 256 experts). Batches 1, 8, 64; prompt 256 tokens, greedy, the same loop as
`generate` (step, async copy of the ids to pinned memory, wait for the previous step's ids).

Byte floor = weight bytes one step must read / 4.26 TB/s: every non-expert weight (embedding: B rows),
plus the expected number of distinct routed experts touched by B tokens x 6 (uniform routing:
E * (1 - (1 - 6/E)^B)). Weights are stored as bf16 (fp32 head) by the pure-PyTorch model; the NVFP4
kernels shrink the floor ~3.5x. KV-cache reads (256 tokens) are negligible next to weights.

Prefill: the first batch size's prompt through `Transformer.prefill` (ours, eager) and one HF forward, timed
after one warm-up call each.
--quant nvfp4 converts our model's weights to NVFP4 (W4A16, dsv4_model/quant/quantize_model.py) after copying HF's
weights, so HF runs bf16 and we run NVFP4 on the same underlying weights; the floor then counts NVFP4 bytes.

Run: python bench/bench_decode.py [--budget SECONDS] [--models flash2,micro] [--batches 1,8,64] [--prompt 256]
       [--quant none|nvfp4] [--head-quant none|nvfp4] [--kernel-overrides "attn_kernel=wgmma"]
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

import dsv4_ops  # noqa: E402,F401
from dsv4_ops.overrides import parse as parse_overrides, set_overrides  # noqa: E402
from common import build_models, cuda_missing, floor_seconds, preset, print_header  # noqa: E402
from dsv4_model.runtime.compiled import DecodeRunner  # noqa: E402
from dsv4_model.model.transformer import Transformer  # noqa: E402
from dsv4_model.runtime.sampling import SamplingParams  # noqa: E402

PROMPT = 256
WARM, STEPS, HF_STEPS = 3, 24, 12


# ------------------------------------------------------------------------------------------ timing
@torch.no_grad()
def time_prefill(fn, reps: int = 2) -> float:
    """Seconds of one call of fn(), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


@torch.no_grad()
def time_ours(runner: DecodeRunner, model: Transformer, ids: torch.Tensor, replay: bool = True) -> float:
    B = ids.shape[0]
    runner.prepare(B)  # compile / capture: not timed
    lengths = torch.full((B,), ids.shape[1], dtype=torch.long, device="cuda")
    logits = model.prefill(ids, lengths)
    runner.begin(lengths, [SamplingParams() for _ in range(B)])
    runner.sample_first(logits)
    for _ in range(WARM):
        runner.step(replay)
    pinned = [torch.empty(B, dtype=torch.long, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event(), torch.cuda.Event()]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(STEPS):
        _, nxt = runner.step(replay)
        pinned[i % 2].copy_(nxt, non_blocking=True)
        events[i % 2].record()
        if i:
            events[(i - 1) % 2].synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS


@torch.no_grad()
def time_hf(hf, ids: torch.Tensor) -> float:
    mask = torch.ones_like(ids)

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)
    t1 = run(1)
    tn = run(1 + HF_STEPS)
    return (tn - t1) / HF_STEPS


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=225.0, help="seconds; later compile-heavy cells are skipped")
    ap.add_argument("--models", default="flash2,micro")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per row")
    ap.add_argument("--quant", choices=("none", "nvfp4"), default="none", help="our weights (HF stays bf16)")
    ap.add_argument("--head-quant", choices=("none", "nvfp4"), default="none",
                    help="our head: as built (bf16) or NVFP4 (Engine's head_quant; the floor counts its bytes)")
    ap.add_argument("--kernel-overrides", default="", help='dsv4_ops.overrides for the run, e.g. "attn_kernel=wgmma"')
    args = ap.parse_args(argv)
    set_overrides(parse_overrides(args.kernel_overrides))
    prompt_len = args.prompt
    if cuda_missing("bench_decode"):
        return 0
    start = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    rows, prefills = [], []

    def over_budget(frac=1.0):
        return time.perf_counter() - start > frac * args.budget

    for name in args.models.split(","):
        cfg = preset(name)
        t_build = time.perf_counter()
        ours, hf, note = build_models(cfg, max(batches), prompt_len + 64)
        if args.quant == "nvfp4":
            from dsv4_model.quant.quantize_model import quantize_model_

            quantize_model_(ours)
            torch.cuda.empty_cache()
        if args.head_quant == "nvfp4":
            from dsv4_model.quant.nvfp4_modules import quantize_head_

            quantize_head_(ours.head)
            torch.cuda.empty_cache()
        print(f"[{name}] built in {time.perf_counter() - t_build:.1f} s; {note}; our weights {args.quant}", flush=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        prompts = {B: torch.randint(2, cfg.vocab_size, (B, prompt_len), device="cuda", generator=g) for B in batches}
        res: dict[tuple[int, str], float | str] = {}
        B0 = batches[0]
        ids0 = prompts[B0]
        lengths0 = torch.full((B0,), prompt_len, dtype=torch.long, device="cuda")
        pre = {"ours": time_prefill(lambda: ours.prefill(ids0, lengths0))}
        if hf is not None:
            try:
                pre["hf"] = time_prefill(lambda: hf(input_ids=ids0, use_cache=False, logits_to_keep=1))
            except Exception as e:
                pre["hf"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
        prefills.append((name, B0, pre))
        if hf is not None:
            for B in batches:
                try:
                    res[(B, "hf generate")] = time_hf(hf, prompts[B])
                except Exception as e:
                    res[(B, "hf generate")] = f"failed: {type(e).__name__}: {str(e)[:80]}"
            del hf
            gc.collect()
            torch.cuda.empty_cache()
        eager = DecodeRunner(ours, compile=False, cuda_graphs=False)
        manual = DecodeRunner(ours, compile=True, cuda_graphs=True, graph_mode="manual")
        ro = DecodeRunner(ours, compile=True, cuda_graphs=True, graph_mode="reduce-overhead")
        for B in batches:
            res[(B, "eager")] = time_ours(eager, ours, prompts[B])
            if over_budget(0.8):
                res[(B, "compiled")] = res[(B, "compiled+graph")] = "skipped (time budget)"
            else:
                t = time.perf_counter()
                res[(B, "compiled+graph")] = time_ours(manual, ours, prompts[B], replay=True)
                res[(B, "compiled")] = time_ours(manual, ours, prompts[B], replay=False)
                print(f"[{name}] B={B}: compile + capture + timing {time.perf_counter() - t:.1f} s", flush=True)
            # reduce-overhead costs one more compile per bucket: batch 1 always (where launch overhead
            # matters most), larger batches while the budget lasts.
            if B == batches[0] or not over_budget(0.6):
                res[(B, "reduce-overhead")] = time_ours(ro, ours, prompts[B])
            else:
                res[(B, "reduce-overhead")] = "skipped (time budget)"
        for B in batches:
            fl = floor_seconds(ours.state_dict().items(), cfg, B)
            hf_t = res.get((B, "hf generate"))
            for mode in ("eager", "compiled", "compiled+graph", "reduce-overhead", "hf generate"):
                v = res.get((B, mode), "n/a (no HF model)")
                rows.append((name, B, mode, v, fl, hf_t))
        del eager, manual, ro, ours
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()

    for name, B, pre in prefills:
        ms = {k: (f"{1e3 * v:.1f} ms" if isinstance(v, float) else v) for k, v in pre.items()}
        ratio = (f" ({pre['hf'] / pre['ours']:.2f}x HF)" if isinstance(pre.get("hf"), float) else "")
        print(f"prefill [{name} B={B} x {prompt_len} tokens]: ours {ms['ours']}, HF forward {ms.get('hf', 'n/a')}{ratio}")
    print(f"\nDecode step timings (greedy, prompt {prompt_len}, {STEPS} steps, our weights {args.quant}; "
          f"HF: (t(1+{HF_STEPS}) - t(1)) / {HF_STEPS})")
    hdr = f"{'model':7} {'batch':>5} {'mode':16} {'ms/step':>9} {'tokens/s':>10} {'floor us':>9} {'% of HBM floor':>15} {'vs HF':>7}"
    print_header(hdr)
    for name, B, mode, v, fl, hf_t in rows:
        if isinstance(v, str):
            print(f"{name:7} {B:5d} {mode:16} {v}")
            continue
        vs = f"{hf_t / v:6.2f}x" if isinstance(hf_t, float) else "   n/a"
        print(f"{name:7} {B:5d} {mode:16} {1e3 * v:9.3f} {B / v:10.1f} {1e6 * fl:9.1f} {100 * fl / v:14.2f}% {vs}")
    best = {}
    for name, B, mode, v, _, _ in rows:
        if mode in ("compiled+graph", "reduce-overhead") and isinstance(v, float):
            best.setdefault((name, B), {})[mode] = v
    for (name, B), d in best.items():
        if len(d) == 2:
            w = min(d, key=d.get)
            print(f"graph mode [{name} B={B}]: {w} faster ({1e3 * d['compiled+graph']:.3f} vs "
                  f"{1e3 * d['reduce-overhead']:.3f} ms)")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

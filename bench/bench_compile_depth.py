"""Compile + capture time of the decode step against depth: whole-step vs regional (layer by layer) compilation.

Models (random NVFP4 W4A16 weights built on the device by dsv4_model.quant.random_model, bf16, batch 1): "flash43" (V4-Flash:
43 layers, its compress ratios and hash layers, `--experts` routed experts per layer: the full 256 do not fit
one GPU) and "flash2" (2 layers, ratios [4, 128]); "micro43" / "micro2" are the same depths at tiny widths (a dry run
on a CPU). Every (model, mode) runs twice, each in a fresh process: "cold" with an empty Inductor cache directory,
"warm" on the cache the cold run left. Reported: compile + capture of the batch-1 bucket (`DecodeRunner.prepare`),
ms/step by CUDA-graph replay (eager step without a GPU), regional's figures against whole-step compilation.
Peers: whole-step compilation is the reference (regional must stay within 3% per step).

Run: python bench/bench_compile_depth.py [--models flash43,flash2] [--modes whole,regional] [--experts 16]
     python bench/bench_compile_depth.py --models micro2,micro43 --device cpu   # dry run on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(name: str, experts: int):
    from common import preset  # here: the parent process never imports torch

    return preset(name, experts=experts)


def child(args) -> dict:
    """One measurement in this process: build, prepare (compile + capture), time steps."""
    import torch

    sys.path.insert(0, ROOT)
    import dsv4_ops  # noqa: F401
    from dsv4_model.runtime.compiled import DecodeRunner
    from dsv4_model.quant.random_model import random_nvfp4_model
    from dsv4_model.runtime.sampling import SamplingParams

    cfg = model_config(args.model, args.experts)
    t = time.perf_counter()
    model = random_nvfp4_model(cfg, device=args.device, max_seq_len=args.prompt + args.steps + 64)
    t_build = time.perf_counter() - t
    on_cuda = args.device == "cuda"
    runner = DecodeRunner(model, compile=True, cuda_graphs=on_cuda, regional=args.mode == "regional")
    t = time.perf_counter()
    runner.prepare(1)
    t_prepare = time.perf_counter() - t
    with torch.no_grad():
        prompt = torch.randint(2, cfg.vocab_size, (1, args.prompt), device=args.device)
        lengths = torch.full((1,), args.prompt, dtype=torch.long, device=args.device)
        logits = model.prefill(prompt, lengths)
        runner.begin(lengths.cpu(), [SamplingParams()])
        runner.sample_first(logits)
        for _ in range(3):
            runner.step()
        best = float("inf")
        for _ in range(3):
            if on_cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.steps // 3):
                runner.step()
            if on_cuda:
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / (args.steps // 3))
    return {"build_s": t_build, "prepare_s": t_prepare, "ms_per_step": 1e3 * best, "mode": runner.mode_name,
            "layers": cfg.n_layers}


def measure(model: str, mode: str, cache_dir: str, args) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONPATH=ROOT + os.pathsep + os.environ.get(
        "PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--mode", mode, "--device",
           args.device, "--experts", str(args.experts), "--steps", str(args.steps), "--prompt", str(args.prompt)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="flash43,flash2")
    ap.add_argument("--modes", default="whole,regional")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per measurement process")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--mode")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = {}
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
                for temp in ("cold", "warm"):
                    rows[(model, mode, temp)] = res = measure(model, mode, cache, args)
                    print(f"{model:8} {mode:9} {temp:5} " + (
                        f"prepare {res['prepare_s']:7.1f} s  {res['ms_per_step']:8.3f} ms/step  "
                        f"(build {res['build_s']:.1f} s, {res['layers']} layers, {res['mode']})"
                        if "error" not in res else f"error: {res['error']}"), flush=True)
    print("\nregional vs whole-step compilation (the peer: whole-step, same run):")
    for model in args.models.split(","):
        w, r = rows.get((model, "whole", "warm"), {}), rows.get((model, "regional", "warm"), {})
        wc, rc = rows.get((model, "whole", "cold"), {}), rows.get((model, "regional", "cold"), {})
        if all("prepare_s" in x for x in (w, r, wc, rc)):
            print(f"{model:8} cold prepare {rc['prepare_s']:.1f} s vs {wc['prepare_s']:.1f} s "
                  f"({rc['prepare_s'] / wc['prepare_s']:.2f}x), warm {r['prepare_s']:.1f} s vs {w['prepare_s']:.1f} s; "
                  f"ms/step {r['ms_per_step']:.3f} vs {w['ms_per_step']:.3f} "
                  f"({100 * (r['ms_per_step'] / w['ms_per_step'] - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

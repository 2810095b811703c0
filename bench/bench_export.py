"""Decode speed of the exported AOTInductor package vs the compiled + CUDA-graph engine, in one run (H200).

Both run through the same `DecodeRunner` loop (decode step + dsv4::sample + feedback, one CUDA graph per
bucket, replayed back to back): "compiled+graph" wraps `torch.compile(model.decode_step)`, "export+graph"
wraps the package's `decode_b1` entry loaded with `run_single_threaded=True` (see dsv4_export/load.py). Target: the
package within 10% of compiled+graph.

Models (random weights converted to NVFP4 W4A16 with `quantize_model_`, or bf16 with `--weights bf16`;
batch 1, max_seq_len 1024, decode from position 256 after a real prefill):
  "tiny"  3 layers (SWA, CSA, HCA), dim 64;
  "flash" V4-Flash widths (dim 4096, 64 heads x 512), 2 layers (CSA + HCA), but 8 routed experts and a
          16k vocabulary so the package's constants stay below 2 GB (skipped if the time budget is spent).
Byte floor: weights one step reads (all non-expert weights, one embedding row, top-k experts per layer)
/ 4.26 TB/s.

Run: python bench/bench_export.py [--models tiny,flash] [--weights nvfp4|bf16] [--budget 170]
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import re
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dsv4_ops  # noqa: E402,F401
from common import cuda_missing, flash, floor_seconds, micro, print_header  # noqa: E402
from dsv4_model.runtime.compiled import DecodeRunner  # noqa: E402
from dsv4_model.model.transformer import Transformer  # noqa: E402
from dsv4_model.quant.random_model import init_random_weights  # noqa: E402
from dsv4_model.quant.quantize_model import quantize_model_  # noqa: E402
from dsv4_model.runtime.sampling import SamplingParams  # noqa: E402
from dsv4_export.build import build_package  # noqa: E402
from dsv4_export.load import ExportedEngine  # noqa: E402

MAX_SEQ, START_POS, WARM, STEPS = 1024, 256, 5, 200
MODELS = {"tiny": lambda: micro([0, 4, 16], hash_layers=1, experts=8),
          "flash": lambda: flash([4, 128], experts=8, vocab=16384)}  # the package's constants below 2 GB
NVFP4_WEIGHT = re.compile(r"(weight_packed|weight_scale|weight_global_scale)$|\.ffn\.nvfp4\.")


def model_config(name: str):
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}")
    return MODELS[name]()


def weights(model: Transformer):
    """The weights a step reads: the parameters and the NVFP4 buffers (not the caches, not the hash table)."""
    return [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if NVFP4_WEIGHT.search(n))]


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


@torch.no_grad()
def time_runner(runner: DecodeRunner, restore) -> float:
    """Seconds per decode step, batch 1, graphs replayed back to back (capture not timed)."""
    runner.prepare(1)
    restore()  # capture scribbled on the caches: start from the prefilled state
    runner.begin(torch.tensor([START_POS], device="cuda"), [SamplingParams()])
    for _ in range(WARM):
        runner.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        runner.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,flash")
    ap.add_argument("--weights", default="nvfp4", choices=["nvfp4", "bf16"])
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; later models are skipped past 40%%")
    args = ap.parse_args(argv)
    if cuda_missing("bench_export"):
        return 0
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.models.split(",")):
            if i and time.perf_counter() - start > 0.4 * args.budget:
                rows.append((name, "skipped (time budget)"))
                continue
            cfg = model_config(name)
            t = time.perf_counter()
            model = Transformer(cfg, max_batch_size=1, max_seq_len=MAX_SEQ, dtype=torch.bfloat16, device="cuda")
            init_random_weights(model, 0)
            if args.weights == "nvfp4":
                quantize_model_(model)
            # A real prefilled state (the same for both runners), so no step computes on empty caches.
            g = torch.Generator(device="cuda").manual_seed(0)
            with torch.no_grad():
                model.prefill(torch.randint(2, cfg.vocab_size, (1, START_POS), device="cuda", generator=g))
            state = {n: b.clone() for n, b in model.named_buffers()}
            bufs = dict(model.named_buffers())
            ref = time_runner(DecodeRunner(model, compile=True, cuda_graphs=True, graph_mode="manual"),
                              functools.partial(copy_all, list(bufs.values()), [state[n] for n in bufs]))
            t_ref = time.perf_counter() - t
            t = time.perf_counter()
            path = os.path.join(tmp, f"{name}.pt2")
            build_package(model, cfg.to_dict(), path, max_batch_size=1, max_seq_len=MAX_SEQ, device="cuda",
                          decode_batches=[1], prefill_batches=[], save_exported_programs=False, verbose=False)
            t_build = time.perf_counter() - t
            floor = floor_seconds(weights(model), cfg)
            del model, bufs
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()
            eng = ExportedEngine(path)
            exp = time_runner(DecodeRunner(eng.model, compile=False, cuda_graphs=True, graph_mode="manual"),
                              functools.partial(copy_all, eng.caches, [state[c.name] for c in eng.cache_specs]))
            print(f"[{name}] compile+capture+time {t_ref:.0f} s, export+AOTI build {t_build:.0f} s "
                  f"({os.path.getsize(path) / 2**20:.0f} MiB)", flush=True)
            rows.append((name, exp, ref, floor))
            del eng, state
            gc.collect()
            torch.cuda.empty_cache()

    print(f"\nDecode, batch 1, {args.weights} weights, from position {START_POS}, {STEPS} graph replays "
          "(dsv4::sample included)")
    hdr = (f"{'model':6} {'export+graph ms':>16} {'compiled+graph ms':>18} {'export/compiled':>16} "
           f"{'floor ms':>9} {'% HBM (export)':>15}")
    print_header(hdr)
    for row in rows:
        if isinstance(row[1], str):
            print(f"{row[0]:6} {row[1]}")
            continue
        name, exp, ref, floor = row
        verdict = "ok" if exp <= 1.10 * ref else "SLOWER than 1.10x"
        print(f"{name:6} {1e3 * exp:16.3f} {1e3 * ref:18.3f} {exp / ref:15.2f}x {1e3 * floor:9.4f} "
              f"{100 * floor / exp:14.1f}%  {verdict}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

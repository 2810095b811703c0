"""What a prefix snapshot costs on the device: one cache row copied into another (Engine.copy_rows: the row of every
cache and compressor state buffer, dsv4_model/model/row_copy.py), at a preset's widths and several max_seq_len.

    python bench/bench_row_copy.py                                     # flash43 (V4-Flash's 43 layers), 4K / 64K
    python bench/bench_row_copy.py --model micro --max-seq-len 512 --device cpu

Only the row-state buffers are allocated (the model's weights stay on the meta device), so a 64K-context row of 43
layers fits anywhere; the moves run through the model (Transformer.copy_rows_ / swap_rows_) as the engine's do.
Printed per max_seq_len: the row's bytes, ms per copy (median of --reps, CUDA events on the GPU), the peer from the
same run (one device copy of a flat buffer of the same bytes: what the copy could cost at best), the ratio, the
fraction of the floor (the row's bytes read and written once at bench/common.py's HBM_BYTES_PER_S), what
exchanging the two rows costs (Engine.swap_rows: a prefill chunk's placement) and what protecting a row's compressor
states costs (Engine.protect_rows: saved before a decode step a prefilling row rides along in, put back after). The
scheduler weighs a copy against prefilling the prefix (bench_prefill.py).
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

from common import HBM_BYTES_PER_S, preset  # noqa: E402
from dsv4_model.model.transformer import Transformer  # noqa: E402


def row_model(name: str, experts: int | None, max_seq_len: int, device: torch.device) -> Transformer:
    """A 2-row model of preset `name` with its caches and state buffers on `device` and its weights on the meta
    device (never read here)."""
    model = Transformer(preset(name, experts=experts), max_batch_size=2, max_seq_len=max_seq_len,
                        dtype=torch.bfloat16, device="meta", simulate_quant=True, allow_beyond_max_position=True)
    model.setup_runtime(device)  # (the caches are made here)
    return model


def timed_ms(fn, reps: int, device: torch.device) -> float:
    """Median ms of fn() over reps runs (after two warm-up runs)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flash43", help="a bench/common.py preset (flash43, flash2, micro, ...)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts (no effect on the caches; fewer: faster)")
    ap.add_argument("--max-seq-len", default="4096,65536")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"{args.model}: one row copied into another (Engine.copy_rows) on {device}", flush=True)
    print(f"{'max_seq_len':>11} {'row MiB':>8} {'copy ms':>8} {'peer ms':>8} {'copy/peer':>9} {'of floor':>8} {'swap ms':>8} {'protect ms':>10}",
          flush=True)
    for S in (int(s) for s in args.max_seq_len.split(",")):
        model = row_model(args.model, args.experts, S, device)
        nbytes = sum(b[0].numel() * b.element_size() for b in model.row_state_buffers())
        copy_ms = timed_ms(lambda: model.copy_rows_([0], [1]), args.reps, device)
        swap_ms = timed_ms(lambda: model.swap_rows_([0], [1]), args.reps, device)
        # a decode step's riding row: its compressor states saved before the step and put back after (protect_rows)
        protect_ms = timed_ms(lambda: model.restore_compressor_rows([1], model.save_compressor_rows([1])), args.reps,
                              device)
        flat = torch.zeros(2, nbytes, dtype=torch.uint8, device=device)
        peer_ms = timed_ms(lambda: flat[1].copy_(flat[0]), args.reps, device)
        floor_ms = 1e3 * 2 * nbytes / HBM_BYTES_PER_S
        print(f"{S:11d} {nbytes / 2**20:8.1f} {copy_ms:8.3f} {peer_ms:8.3f} {copy_ms / peer_ms:9.2f} "
              f"{floor_ms / copy_ms:8.1%} {swap_ms:8.3f} {protect_ms:10.3f}", flush=True)
        del model, flat
    return 0


if __name__ == "__main__":
    sys.exit(main())

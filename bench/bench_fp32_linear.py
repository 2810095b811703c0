"""dsv4::fp32_linear (the fp32 projections of a decode step) vs the cuBLAS calls it replaces, same run.

Shapes (V4-Flash, one CSA layer): the attention compressor's wkv + wgate (2 x 1024 x 4096) and the indexer
compressor's (2 x 256 x 4096), fp32 weights, one launch vs four F.linear(x.float(), w); the mHC mixes (24 x 16384
fp32, twice per layer); the router (256 x 4096 bf16, F.linear of the widened operands). M = 1, 2, 4 (verification
steps) and 8 token rows.
The head (V4-Flash 129280 x 4096, held in bf16) at M = 1, 2, 4, 8, 64, 512: fp32_linear of the bf16 weight vs the
fp32 head it replaced (F.linear(x.float(), w_fp32)), a bf16-output cuBLAS matmul of the same bf16 weight, and the
GEMV kernel on the same head as 8 calls of a row block (M <= 8: what the op's cuBLAS threshold for large bf16
weights rests on).
µs per call by CUDA-graph replay with the weights rotated through > L2 worth of copies (read from HBM), weight
GB/s and fraction of 4.26 TB/s.

Run: python bench/bench_fp32_linear.py
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from timing import graph_us  # noqa: E402

HBM = 4.26e12
ROTATE_BYTES = 256 << 20
CASES = [  # name, N of each matrix, K, weight dtype
    ("compressors wkv+wgate x2", (1024, 1024, 256, 256), 4096, torch.float32),
    ("mHC mixes", (24,), 16384, torch.float32),
    ("router", (256,), 4096, torch.bfloat16),
]


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_fp32_linear: needs a CUDA GPU (skipped)")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'projection':26} {'M':>2} | {'fp32_linear us':>14} {'cuBLAS us':>10} {'speedup':>8} | "
          f"{'GB/s':>6} {'HBM':>5}")
    for name, ns, k, dt in CASES:
        wbytes = sum(ns) * k * dt.itemsize
        copies = max(1, min(256, math.ceil(ROTATE_BYTES / wbytes)))
        ws = [[torch.randn(n, k, device="cuda", generator=gen).to(dt) for n in ns] for _ in range(copies)]
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            reps = max(4, min(64, int(4e-3 / (wbytes / 2e12 + 5e-6))))
            ours = graph_us(lambda i: torch.ops.dsv4.fp32_linear(x, ws[i % copies]), reps, indexed=True)
            peer = graph_us(lambda i: [F.linear(x.float(), w.float()) for w in ws[i % copies]], reps, indexed=True)
            got, want = torch.ops.dsv4.fp32_linear(x, ws[0]), [F.linear(x.float(), w.float()) for w in ws[0]]
            err = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, want))
            gbs = wbytes / ours / 1e3
            print(f"{name:26} {m:2d} | {ours:14.2f} {peer:10.2f} {peer / ours:7.2f}x | {gbs:6.0f} "
                  f"{gbs * 1e9 / HBM:5.0%}   (max rel diff {err:.1e})")
        del ws
        torch.cuda.empty_cache()
    bench_head(gen)
    return 0


def bench_head(gen, n=129280, k=4096):
    print(f"\nhead {n} x {k}: fp32 logits | fp32_linear (bf16 weight) | fp32 weight F.linear | bf16 matmul (bf16 "
          f"out) | the GEMV kernel (8 row blocks) | fp32_linear vs fp32 head | weight GB/s, HBM")
    w = torch.randn(n, k, device="cuda", generator=gen).mul(0.02).to(torch.bfloat16)
    w32 = w.float()
    # The op sends a call of >= 2^26 bf16 weight elements at 2+ rows to cuBLAS: the same head as 8 calls of one
    # row block each (each below that) times the GEMV kernel at every M, the figure that threshold rests on.
    blocks = list(w.split((n + 7) // 8))
    assert all(b.numel() < 1 << 26 for b in blocks)
    for m in (1, 2, 4, 8, 64, 512):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        reps = 8
        ours = graph_us(lambda: torch.ops.dsv4.fp32_linear(x, [w]), reps)
        old = graph_us(lambda: F.linear(x.float(), w32), reps)
        bf = graph_us(lambda: torch.matmul(x, w.t()), reps)
        gemv = graph_us(lambda: [torch.ops.dsv4.fp32_linear(x, [b]) for b in blocks], reps) if m <= 8 \
            else float("nan")
        got, want = torch.ops.dsv4.fp32_linear(x, [w])[0], F.linear(x.float(), w32)
        err = float((got - want).abs().max() / want.abs().max())
        gbs = n * k * 2 / ours / 1e3
        print(f"head M={m:4d} | {ours:8.1f} us | {old:8.1f} us | {bf:8.1f} us | {gemv:8.1f} us | {old / ours:5.2f}x "
              f"| {gbs:6.0f} {gbs * 1e9 / HBM:5.0%}   (max rel diff {err:.1e})")
    del w, w32, blocks
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())

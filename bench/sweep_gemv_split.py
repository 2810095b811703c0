"""The gemv kernel's launch plan, swept: CTAs per SM (occ) x K-splits per row tile (kw), forced with
DSV4_GEMV_SPLIT=kw:occ, against the default rule (dsv4_ops/csrc/cuda/nvfp4_gemm.cu `plan_gemv`), on the decode
shapes of V4-Flash at batch 1 (and the MoE at T = 1, 2). µs per call, CUDA-graph replay, weights rotated through
>= 256 MB of copies (streamed from HBM, not L2). What the rule's choices are tuned from.

    python3 bench/sweep_gemv_split.py
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dsv4_ops  # noqa: E402,F401
from bench_nvfp4_gemm import env_var, graph_us, nvfp4_bytes, rand_kernel_weight  # noqa: E402
from timing import cuda_generator  # noqa: E402

ops = torch.ops.dsv4
HBM = 4.26e12
ROTATE = 256 << 20
CONFIGS = ["default"] + [f"{kw}:{occ}" for occ in (2, 3) for kw in (1, 2, 4, 8)]
E, D, INTER, TOPK = 256, 4096, 2048, 6


def dense_case(gen, n, k, groups=1):
    nbytes = groups * nvfp4_bytes(n, k)
    copies = max(1, min(64, math.ceil(ROTATE / nbytes)))
    lead = (groups,) if groups > 1 else ()
    ws = [rand_kernel_weight(lead, n, k, gen) for _ in range(copies)]
    if groups > 1:
        x = torch.randn(1, groups, k, device="cuda", generator=gen).to(torch.bfloat16)
        gs = torch.full((groups,), 0.01, device="cuda")
        return nbytes, lambda i: ops.nvfp4_linear_grouped(x, *ws[i % copies], gs)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    gs = torch.tensor(0.01, device="cuda")
    return nbytes, lambda i: ops.nvfp4_linear(x, *ws[i % copies], gs)


def moe_case(gen, t):
    w13, s13 = rand_kernel_weight((E,), 2 * INTER, D, gen)
    w2, s2 = rand_kernel_weight((E,), D, INTER, gen)
    g = torch.full((E,), 0.01, device="cuda")
    sw13, ss13 = rand_kernel_weight((), 2 * INTER, D, gen)
    sw2, ss2 = rand_kernel_weight((), D, INTER, gen)
    sg = torch.tensor(0.01, device="cuda")
    x = torch.randn(t, D, device="cuda", generator=gen).to(torch.bfloat16)
    sets = [torch.rand(t, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
            for _ in range(16)]
    wts = torch.rand(t, TOPK, device="cuda", generator=gen)
    experts = sum(int(torch.unique(ids).numel()) for ids in sets) / len(sets) + 1  # + the shared expert
    nbytes = int(experts * (nvfp4_bytes(2 * INTER, D) + nvfp4_bytes(D, INTER)))
    return nbytes, lambda i: ops.nvfp4_moe(x, sets[i % 16], wts, w13, s13, g, w2, s2, g, sw13, ss13, sg, sw2, ss2,
                                           sg, 10.0)


def main() -> int:
    gen = cuda_generator("sweep_gemv_split")
    if gen is None:
        return 0
    cases = [("wq_b 32768x1024", *dense_case(gen, 32768, 1024)), ("wo_b 4096x8192", *dense_case(gen, 4096, 8192)),
             ("wo_a 8x1024x4096", *dense_case(gen, 1024, 4096, 8)), ("w1+w3 4096x4096", *dense_case(gen, 4096, 4096)),
             ("w2 4096x2048", *dense_case(gen, 4096, 2048)), ("wq_a 1024x4096", *dense_case(gen, 1024, 4096)),
             ("moe T=1", *moe_case(gen, 1)), ("moe T=2", *moe_case(gen, 2))]
    print("µs per call (M = 1; MoE: 6 of 256 experts + the shared one per token); last line: best / default, %HBM")
    print(f"{'config':>8} | " + " | ".join(f"{c[0]:>16}" for c in cases))
    table = {}
    for cfg in CONFIGS:
        with env_var("DSV4_GEMV_SPLIT", "" if cfg == "default" else cfg):
            table[cfg] = [graph_us(fn, 32) for _, _, fn in cases]
        print(f"{cfg:>8} | " + " | ".join(f"{t:16.2f}" for t in table[cfg]), flush=True)
    best = []
    for j, (_, nbytes, _) in enumerate(cases):
        cfg = min(CONFIGS, key=lambda c: table[c][j])
        t = table[cfg][j]
        best.append(f"{cfg} {t:.2f} {table['default'][j] / t:.2f}x {nbytes / t / 1e-6 / HBM:.0%}")
    print(f"{'best':>8} | " + " | ".join(f"{b:>16}" for b in best))
    return 0


if __name__ == "__main__":
    sys.exit(main())

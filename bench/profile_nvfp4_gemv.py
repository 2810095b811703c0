"""Launches dsv4::nvfp4_linear on V4-Flash shapes at the token counts given (`--m 1,16,64`; default 1: the
batch-1 GEMV) and, at M = 1, one MoE step (T = 1, 6 experts + the shared one) for Nsight Compute.

The GEMV measures 2x the time its bytes need at HBM speed (bench/RESULTS.md, GEMM): this script gives `ncu` the
launches to explain (issue- vs memory-bound, stall reasons, occupancy). scripts/gpu_check.sh `profile` runs:

    ncu --clock-control none --kernel-name "regex:nvfp4" --section SpeedOfLight --section SchedulerStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis ... python bench/profile_nvfp4_gemv.py

(--clock-control none: ncu's default locks the SM clock at base, which makes an issue-bound kernel look slower
next to HBM than it is.) Each launch runs twice on fresh weight copies; the first launch of a kernel pays module
loading / a cold TLB.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dsv4_ops  # noqa: E402,F401
from bench_nvfp4_gemm import rand_kernel_weight  # noqa: E402

SHAPES = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("w2", 4096, 2048)]


def main() -> int:
    ms = [1]
    if "--m" in sys.argv:
        ms = [int(v) for v in sys.argv[sys.argv.index("--m") + 1].split(",")]
    if not torch.cuda.is_available():
        print("profile_nvfp4_gemv: needs a CUDA GPU (skipped)")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    gs = torch.tensor(0.01, device="cuda")
    for m in ms:
        for name, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2):
                w, s = rand_kernel_weight((), n, k, gen)
                torch.ops.dsv4.nvfp4_linear(x, w, s, gs)
            torch.cuda.synchronize()
            print(f"M={m} {name} {n}x{k}: launched 2x", flush=True)
    if 1 not in ms:
        return 0
    d, inter, experts = 4096, 2048, 16
    x = torch.randn(1, d, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.randperm(experts, device="cuda", generator=gen)[:6].view(1, 6).to(torch.int32)
    wts = torch.rand(1, 6, device="cuda", generator=gen)
    g = torch.full((experts,), 0.01, device="cuda")
    for _ in range(2):
        w13, s13 = rand_kernel_weight((experts,), 2 * inter, d, gen)
        w2, s2 = rand_kernel_weight((experts,), d, inter, gen)
        sw13, ss13 = rand_kernel_weight((), 2 * inter, d, gen)
        sw2, ss2 = rand_kernel_weight((), d, inter, gen)
        torch.ops.dsv4.nvfp4_moe(x, ids, wts, w13, s13, g, w2, s2, g, sw13, ss13, gs, sw2, ss2, gs, 10.0)
    torch.cuda.synchronize()
    print("moe T=1 (6 of 16 experts + shared): launched 2x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launches the batch-1 NVFP4 GEMV (dsv4::nvfp4_linear, M = 1) on V4-Flash shapes for Nsight Compute.

The GEMV measures 6-9 us where its bytes need 0.5-4.4 us (bench/RESULTS.md): this script gives `ncu` the
launches to explain (latency vs throughput, stall reasons, occupancy). scripts/gpu_check.sh `profile` runs:

    ncu --kernel-name "regex:nvfp4|per_row" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats --section Occupancy python bench/profile_nvfp4_gemv.py

Each shape runs twice on fresh weight copies through the skinny kernel (DSV4_NVFP4_GEMM_KERNEL=skinny), then
twice through the default gemv kernel; the first launch of a kernel pays module loading / a cold TLB.
A per-row quantization of one 4096-wide row runs too, as the cost of a kernel that does almost nothing.
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
    if not torch.cuda.is_available():
        print("profile_nvfp4_gemv: needs a CUDA GPU (skipped)")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    gs = torch.tensor(0.01, device="cuda")
    for kernel in ("skinny", "gemv"):
        os.environ["DSV4_NVFP4_GEMM_KERNEL"] = "skinny" if kernel == "skinny" else "default"  # read at each launch
        for name, n, k in SHAPES:
            x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2):
                w, s = rand_kernel_weight((), n, k, gen)
                torch.ops.dsv4.nvfp4_linear(x, w, s, gs)
            torch.cuda.synchronize()
            print(f"{kernel} {name} {n}x{k}: launched 2x", flush=True)
    os.environ.pop("DSV4_NVFP4_GEMM_KERNEL")
    row = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    for _ in range(3):
        torch.ops.dsv4.fused_amax_quantize_per_row(row)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

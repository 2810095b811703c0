"""A/B of the wgmma NVFP4 kernel's variants at prefill sizes (issue #29: the NVFP4 linear >= 1.0x bf16 cuBLAS at
M >= 128, the MoE >= 50% of the bf16 tensor-core rate at T >= 1024), each against bf16 cuBLAS in the same run.

Variants (dsv4_ops.overrides, all measured on the same weights): the 128-feature tile ("wgmma") and the 256-feature
one ("wide"), each with the K loop's two CTA barriers per chunk (the default) and one (wgmma_one_sync); the
128-feature tile with 256 tokens ("tall", wgmma_tall; M > 128) both ways; the weight dequantized to bf16 + one
cuBLAS GEMM (the default past M = 1024) with the word-per-thread dequantize and the tile-per-CTA one (dequant_tile). The MoE (256 experts, top-6, d 4096,
I 2048, routed + shared) on its wgmma kernels with two and one barrier. TF/s = 2 M N K / time, and its fraction of
the dense bf16 tensor-core peak (989 TF/s, H100 / H200 SXM). Timing as bench_nvfp4_gemm.py (CUDA-graph replay,
weights rotated past L2).

Run: python bench/bench_wgmma_variants.py   (about a minute on an H200)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_nvfp4_gemm import (D, E, INTER, SHAPES, TOPK, graph_us, linear_at, rand_kernel_weight,  # noqa: E402
                              rotated_weights)
from dsv4_ops.overrides import kernel_overrides  # noqa: E402

ops = torch.ops.dsv4
PEAK = 989e12
MS = (256, 1024, 4096)
VARIANTS = (  # (label, overrides)
    ("wgmma", dict(nvfp4_gemm_kernel="wgmma")),
    ("wgmma 1-sync", dict(nvfp4_gemm_kernel="wgmma", wgmma_one_sync=True)),
    ("wide", dict(nvfp4_gemm_kernel="wgmma_wide")),
    ("wide 1-sync", dict(nvfp4_gemm_kernel="wgmma_wide", wgmma_one_sync=True)),
    ("tall", dict(nvfp4_gemm_kernel="wgmma", wgmma_tall=True)),
    ("tall 1-sync", dict(nvfp4_gemm_kernel="wgmma", wgmma_tall=True, wgmma_one_sync=True)),
    ("deq+cuBLAS", dict(nvfp4_gemm_kernel="cublas")),
    ("deq tile+cuBLAS", dict(nvfp4_gemm_kernel="cublas", dequant_tile=True)),
)


def best_of(fn, reps, overrides, rounds=2):
    """Fastest of `rounds` timings (the variants interleave, so drift hits each alike)."""
    with kernel_overrides(**overrides):
        return min(graph_us(fn, reps) for _ in range(rounds))


def bench_linear(gen):
    print("## nvfp4_linear variants vs bf16 torch.matmul (cuBLAS): us (x cuBLAS's speed), TF/s as % of 989")
    for name, n, k in SHAPES:
        if name in ("wkv", "wq_a", "expert w1"):
            continue
        ws, wb, gs = rotated_weights(n, k, gen)
        for m in MS:
            flops, op, reps, t_peer = linear_at(m, n, k, ws, wb, gs, gen)
            cells = []
            for label, ov in VARIANTS:
                t = best_of(op, reps, ov)
                cells.append(f"{label} {t:7.1f} ({t_peer / t:4.2f}x, {flops / t * 1e-6 / PEAK * 1e12:3.0%})")
            print(f"{name:>6} {n}x{k} M={m:5} | cuBLAS {t_peer:7.1f} us ({flops / t_peer * 1e-6 / PEAK * 1e12:3.0%}) | "
                  + " | ".join(cells), flush=True)
        del ws, wb
        torch.cuda.empty_cache()


def bench_moe(gen):
    print(f"\n## nvfp4_moe on its wgmma kernels ({E} experts, top-{TOPK}, routed + shared): two vs one barrier")
    w13, s13 = rand_kernel_weight((E,), 2 * INTER, D, gen)
    w2, s2 = rand_kernel_weight((E,), D, INTER, gen)
    g = torch.full((E,), 0.01, device="cuda")
    sw13, ss13 = rand_kernel_weight((), 2 * INTER, D, gen)
    sw2, ss2 = rand_kernel_weight((), D, INTER, gen)
    sg = torch.tensor(0.01, device="cuda")
    for T in (1024, 4096, 8192):
        x = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        wts = torch.rand(T, TOPK, device="cuda", generator=gen)
        flops = 2.0 * (T * TOPK + T) * 3 * INTER * D
        cells = []
        for label, ov in (("default", {}), ("1-sync", dict(wgmma_one_sync=True)),
                          ("wide", dict(nvfp4_gemm_kernel="wgmma_wide")),
                          ("wide 1-sync", dict(nvfp4_gemm_kernel="wgmma_wide", wgmma_one_sync=True))):
            t = best_of(lambda i: ops.nvfp4_moe(x, ids, wts, w13, s13, g, w2, s2, g, sw13, ss13, sg, sw2, ss2, sg,
                                                10.0), 2, ov)
            cells.append(f"{label} {t:8.1f} us ({flops / t * 1e-6 / PEAK * 1e12:3.0%})")
        print(f"T={T:5} | " + " | ".join(cells), flush=True)


def main():
    if not torch.cuda.is_available():
        sys.exit("bench_wgmma_variants.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(0))
    bench_linear(gen)
    bench_moe(gen)


if __name__ == "__main__":
    main()

"""Benchmark of dsv4::nvfp4_linear_chain (dependent NVFP4 linears in one persistent launch) on the H200: the
attention's output projection wo_a -> wo_b at V4-Flash width (8 x (1024 x 4096) grouped, then 4096 x 8192) at
M = 1, 2, 4, 8 rows, against the per-op path of the same run (nvfp4_linear_grouped + nvfp4_linear, two gemv
launches chained by programmatic dependent launch) and against bf16 cuBLAS (torch.bmm + torch.matmul).

Every figure is a CUDA-graph replay of REPS back-to-back calls divided by REPS (best of 3). Calls cycle through
copies of the weights totalling >= 256 MB, so every call streams its weights from HBM. "floor" is the NVFP4 weight
bytes (codes + block scales) over 4.26 TB/s; "HBM" is that floor over the measured time.

Run: python bench/bench_chain.py   (under a minute)
"""
import math
import os as _os
import sys as _sys

import torch

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import ops as dops  # noqa: E402
from dsv4_ops.overrides import kernel_overrides  # noqa: E402
from bench_nvfp4_gemm import nvfp4_bytes, rand_kernel_weight  # noqa: E402
from timing import cuda_generator, graph_us  # noqa: E402

ops = torch.ops.dsv4
HBM = 4.26e12
ROTATE_BYTES = 256 << 20
REPS = 200
G, N_A, K_A, N_B = 8, 1024, 4096, 4096  # wo_a: 8 x (1024 x 4096); wo_b: 4096 x 8192


def main():
    gen = cuda_generator("bench_chain")
    if gen is None:
        return
    wbytes = G * nvfp4_bytes(N_A, K_A) + nvfp4_bytes(N_B, G * N_A)
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / wbytes)))
    was = [rand_kernel_weight((G,), N_A, K_A, gen) for _ in range(copies)]
    wbs = [rand_kernel_weight((), N_B, G * N_A, gen) for _ in range(copies)]
    gsa = torch.full((G,), 0.01, device="cuda")
    gsb = torch.tensor(0.01, device="cuda")
    sync = torch.zeros(dops.nvfp4_linear_chain_sync_numel([G * N_A]), dtype=torch.int32, device="cuda")
    bcopies = max(1, min(16, math.ceil(ROTATE_BYTES / ((G * N_A * K_A + N_B * G * N_A) * 2))))
    bfa = [torch.randn(G, N_A, K_A, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(bcopies)]
    bfb = [torch.randn(N_B, G * N_A, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(bcopies)]
    floor_us = wbytes / HBM * 1e6
    print(f"\n## wo_a -> wo_b ({G} x ({N_A}x{K_A}) grouped, then {N_B}x{G * N_A}): {wbytes / 1e6:.1f} MB of NVFP4 "
          f"weights, floor {floor_us:.2f} us at 4.26 TB/s; CUDA-graph replay, weights streamed from HBM")
    print("| M | chain us | per-op us | bf16 cuBLAS us | chain / per-op | chain HBM | per-op HBM |")
    print("|---|---|---|---|---|---|---|")
    for m in (1, 2, 4, 8):
        x = torch.randn(m, G, K_A, device="cuda", generator=gen).to(torch.bfloat16)
        xt = x.transpose(0, 1).contiguous()

        def chain(i):
            wa, wb = was[i % copies], wbs[i % copies]
            return dops.nvfp4_linear_chain(x, w_packed=[wa[0], wb[0]], w_scale=[wa[1], wb[1]],
                                           w_global_scale=[gsa, gsb], sync=sync)

        def per_op(i):
            wa, wb = was[i % copies], wbs[i % copies]
            z = ops.nvfp4_linear_grouped(x, wa[0], wa[1], gsa)
            return ops.nvfp4_linear(z.flatten(-2), wb[0], wb[1], gsb)

        def peer(i):
            z = torch.bmm(xt, bfa[i % bcopies].transpose(1, 2))  # [G, M, N_A]
            return torch.matmul(z.transpose(0, 1).reshape(m, -1), bfb[i % bcopies].t())

        assert torch.equal(chain(0), per_op(0)), f"M = {m}: the chain's bits differ from the per-op path's"
        t_chain, t_op, t_peer = (graph_us(f, REPS, indexed=True) for f in (chain, per_op, peer))
        print(f"| {m} | {t_chain:.2f} | {t_op:.2f} | {t_peer:.2f} | {t_chain / t_op:.3f} | "
              f"{floor_us / t_chain:.0%} | {floor_us / t_op:.0%} |")
    by_part(was, wbs, gsa, gsb, copies, gen)


def by_part(was, wbs, gsa, gsb, copies, gen):
    """M = 1: each matrix alone as a one-stage chain against its per-op call, and both chains without PDL: what the
    persistent kernel costs without a dependency, and what programmatic dependent launch gives each form."""
    x = torch.randn(1, G, K_A, device="cuda", generator=gen).to(torch.bfloat16)
    z = torch.randn(1, G * N_A, device="cuda", generator=gen).to(torch.bfloat16)
    one = torch.zeros(dops.nvfp4_linear_chain_sync_numel([]), dtype=torch.int32, device="cuda")
    sync = torch.zeros(dops.nvfp4_linear_chain_sync_numel([G * N_A]), dtype=torch.int32, device="cuda")

    def chain_a(i):
        w = was[i % copies]
        return dops.nvfp4_linear_chain(x, w_packed=[w[0]], w_scale=[w[1]], w_global_scale=[gsa], sync=one)

    def chain_b(i):
        w = wbs[i % copies]
        return dops.nvfp4_linear_chain(z, w_packed=[w[0]], w_scale=[w[1]], w_global_scale=[gsb], sync=one)

    def chain_ab(i):
        wa, wb = was[i % copies], wbs[i % copies]
        return dops.nvfp4_linear_chain(x, w_packed=[wa[0], wb[0]], w_scale=[wa[1], wb[1]],
                                       w_global_scale=[gsa, gsb], sync=sync)

    def per_op_ab(i):
        wa, wb = was[i % copies], wbs[i % copies]
        return ops.nvfp4_linear(ops.nvfp4_linear_grouped(x, wa[0], wa[1], gsa).flatten(-2), wb[0], wb[1], gsb)

    rows = [("wo_a alone", chain_a, lambda i: ops.nvfp4_linear_grouped(x, was[i % copies][0], was[i % copies][1], gsa)),
            ("wo_b alone", chain_b, lambda i: ops.nvfp4_linear(z, wbs[i % copies][0], wbs[i % copies][1], gsb)),
            ("wo_a -> wo_b", chain_ab, per_op_ab)]
    print("\n## M = 1 by part: one-stage chains against the per-op call; with and without PDL")
    print("| part | chain us | per-op us | chain / per-op | chain no-PDL us | per-op no-PDL us |")
    print("|---|---|---|---|---|---|")
    for name, ch, op in rows:
        t_ch, t_op = graph_us(ch, REPS, indexed=True), graph_us(op, REPS, indexed=True)
        with kernel_overrides(pdl=False):
            n_ch, n_op = graph_us(ch, REPS, indexed=True), graph_us(op, REPS, indexed=True)
        print(f"| {name} | {t_ch:.2f} | {t_op:.2f} | {t_ch / t_op:.3f} | {n_ch:.2f} | {n_op:.2f} |")


if __name__ == "__main__":
    main()

"""dsv4::hc_pre vs the steps it replaces (dsv4_model.model.layers.hc_pre + the sublayer's RMSNorm, compiled with
torch.compile as in the decode step), same run, V4-Flash (hc 4 x d 4096) and V4-Pro (d 7168) widths, batch 1
and 8, bf16 streams, fp32 fn. µs per call by CUDA-graph replay; bytes = fn + x read once, fraction of 4.26 TB/s.

Run: python bench/bench_hc_pre.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from dsv4_model.model.layers import hc_pre  # noqa: E402
from timing import cuda_generator, graph_us, vs_peer  # noqa: E402

HC, ITERS, EPS = 4, 20, 1e-6


def unfused(x, fn, scale, base, w):
    y, post, comb = hc_pre(x, fn, scale, base, HC, ITERS, EPS, EPS)
    yf = y.float()
    return (w * (yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + EPS))).to(y.dtype), post, comb


def main() -> int:
    gen = cuda_generator("bench_hc_pre")
    if gen is None:
        return 0
    peer_fn = torch.compile(unfused, dynamic=False)
    print(f"{'d':>5} {'B':>2} | {'op us':>7} {'unfused us':>10} {'speedup':>8} | {'GB/s':>6} {'HBM':>5} | max |diff| y")
    for d in (4096, 7168):
        mix = (2 + HC) * HC
        fn = torch.randn(mix, HC * d, device="cuda", generator=gen) * (HC * d) ** -0.5
        scale = torch.rand(3, device="cuda", generator=gen) + 0.5
        base = torch.randn(mix, device="cuda", generator=gen) * 0.5
        w = torch.rand(d, device="cuda", generator=gen) + 0.5
        for B in (1, 8):
            x = torch.randn(B, HC, d, device="cuda", generator=gen).to(torch.bfloat16)
            with torch.no_grad():
                ours = graph_us(lambda: torch.ops.dsv4.hc_pre(x, fn, scale, base, w, ITERS, EPS, EPS, EPS), 64)
                peer = graph_us(lambda: peer_fn(x, fn, scale, base, w), 64)
                err = float((torch.ops.dsv4.hc_pre(x, fn, scale, base, w, ITERS, EPS, EPS, EPS)[0].float()
                             - unfused(x, fn, scale, base, w)[0].float()).abs().max())
            print(f"{d:5d} {B:2d} | {vs_peer(ours, peer, fn.numel() * 4 + x.numel() * 2)} | {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

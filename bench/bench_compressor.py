"""dsv4::compressor_decode vs the tensor ops it replaces (dsv4_ops.reference.compressor_decode_ref: the steps of
Compressor.decode, compiled with torch.compile as in the decode step), same run, V4-Flash decode shapes: the CSA
compressor (ratio 4, overlapping windows, 512 wide) and its indexer's (128 wide), HCA's (ratio 128, 512 wide);
batch 1 and 8. µs per call by CUDA-graph replay; bytes = the state rows of the window read + the slot written,
fraction of 4.26 TB/s.

Run: python bench/bench_compressor.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from dsv4_ops.reference import compressor_decode_ref  # noqa: E402
from timing import cuda_generator, graph_us, vs_peer  # noqa: E402

CASES = [("CSA kv", 4, 512, True), ("CSA indexer", 4, 128, True), ("HCA kv", 128, 512, False)]


def main() -> int:
    gen = cuda_generator("bench_compressor")
    if gen is None:
        return 0
    torch._dynamo.config.recompile_limit = 64  # one compiled graph per shape
    peer_fn = torch.compile(compressor_decode_ref, dynamic=False)
    print(f"{'case':12} {'B':>2} | {'op us':>7} {'peer us':>10} {'speedup':>8} | {'GB/s':>6} {'HBM':>5} | max |diff|")
    for name, m, hd, overlap in CASES:
        C, R = (2 * hd, 2 * m) if overlap else (hd, m)
        ape = torch.randn(m, C, device="cuda", generator=gen)
        for B in (1, 8):
            kv = torch.randn(B, C, device="cuda", generator=gen)
            score = torch.randn(B, C, device="cuda", generator=gen)
            pos = torch.randint(0, 1 << 16, (B,), device="cuda", generator=gen)
            states = [torch.randn(B, R, C, device="cuda", generator=gen) for _ in range(4)]
            pooled = torch.empty(B, hd, device="cuda")
            with torch.no_grad():
                ours = graph_us(lambda: torch.ops.dsv4.compressor_decode(kv, score, ape, pos, states[0], states[1],
                                                                         pooled), 64)
                peer = graph_us(lambda: peer_fn(kv, score, ape, pos, states[2], states[3]), 64)
                a, b = [s.clone() for s in states[:2]], [s.clone() for s in states[:2]]
                torch.ops.dsv4.compressor_decode(kv, score, ape, pos, a[0], a[1], pooled)
                err = float((pooled - compressor_decode_ref(kv, score, ape, pos, b[0], b[1])).abs().max())
            nbytes = 2 * (B * R * hd * 4 + B * C * 4)
            print(f"{name:12} {B:2d} | {vs_peer(ours, peer, nbytes)} | {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

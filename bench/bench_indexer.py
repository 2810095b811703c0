"""Benchmark of dsv4::indexer_score_topk (DeepSeek-V4 lightning indexer at decode) on the H200.

64 heads x 128 dims, FP4 keys (64 B codes + 4 B UE8M0 scales per key), top-512, all keys valid (N = 64 / 400: fewer
keys than the top-k, a decode early in a sequence). Every figure is
a CUDA-graph replay of REPS back-to-back calls divided by REPS (best of a few replays). The peer is plain
PyTorch in the same run: dequantize the keys to bf16, einsum, relu, weighted head sum, torch.topk; eager and
torch.compile'd (dynamic shapes, compiled once per batch-size class). GB/s counts key bytes only; at small N the
keys stay in L2 across replays, so those rows can exceed HBM bandwidth.

Run: python bench/bench_indexer.py   (must finish in < 90 s)
"""
import time

import torch

import os as _os
import sys as _sys

# runnable as `python3 bench/<file>.py` from a checkout: the repository root holds dsv4_ops
_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from timing import graph_us as _graph_us  # noqa: E402
from dsv4_ops import reference as ref  # noqa: E402

HBM_BYTES_PER_S = 4.26e12
H, D, TOPK = 64, 128, 512
REPS = 20
SHAPES = [(1, 64), (1, 400), (1, 4096), (1, 65536), (1, 262144), (8, 4096), (8, 65536), (8, 262144)]
BUDGET_S = 60.0  # skip the compiled peer (a possible recompile) past this point: the run must stay < 90 s

_E2M1_SIGNED = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_LUT = None  # bf16 LUT on the GPU, built before any capture (a host->device copy cannot be captured)


def graph_us(fn, reps=None):
    return _graph_us(fn, REPS if reps is None else reps)


def make_inputs(B, N):
    g = torch.Generator(device="cuda").manual_seed(B * 1000003 + N)
    codes = torch.empty(B, N, D // 2, dtype=torch.uint8, device="cuda")
    scales = torch.empty(B, N, D // 32, dtype=torch.uint8, device="cuda")
    for b in range(B):  # quantize a row at a time: keeps the fp32 temporaries small
        k = torch.randn(N, D, device="cuda", generator=g)
        codes[b], scales[b] = ref.indexer_fp4_quantize_keys(k)
    q = torch.randn(B, H, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(B, H, device="cuda", generator=g) * (D**-0.5 * H**-0.5)
    n_valid = torch.full((B,), N, dtype=torch.int32, device="cuda")
    return q, w, codes, scales, n_valid


def peer(q, w, codes, scales, n_valid):
    B, N, _ = codes.shape
    lut = _LUT
    nib = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).to(torch.int32)
    s = torch.exp2(scales.float() - 127.0).to(torch.bfloat16)
    k = (lut[nib].unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)
    logits = torch.einsum("bhd,bnd->bhn", q, k)
    scores = (logits.float().relu() * w.unsqueeze(-1)).sum(1)
    valid = torch.arange(N, device=codes.device)[None, :] < n_valid[:, None]
    scores = torch.where(valid, scores, float("-inf"))
    return torch.topk(scores, TOPK, dim=1).indices




def main():
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    global _LUT
    _LUT = torch.tensor(_E2M1_SIGNED, dtype=torch.bfloat16, device="cuda")
    compiled_peer = torch.compile(peer, dynamic=True)
    print(f"dsv4::indexer_score_topk  H={H} D={D} topk={TOPK}  FP4 keys (68 B/key)  "
          f"{torch.cuda.get_device_name(0)}  torch {torch.__version__}")
    header = (f"{'B':>3} {'N':>7} | {'op us':>8} {'GB/s':>7} {'%HBM':>6} | {'eager us':>9} {'x faster':>8} | "
              f"{'compiled us':>11} {'x faster':>8}")
    print(header)
    print("-" * len(header))
    for B, N in SHAPES:
        q, w, codes, scales, n_valid = make_inputs(B, N)
        out = torch.ops.dsv4.indexer_score_topk(q, w, codes, scales, n_valid, TOPK)
        # Sanity: the op's picks must carry the peer's best scores (bf16 logits: a loose check).
        ref_scores = ref.indexer_scores_ref(q, w, codes, scales)
        got = ref_scores.gather(1, out.long()).sort(1, descending=True).values
        best = ref_scores.topk(TOPK, dim=1).values
        assert ((got - best).abs() <= 1e-4 * best.abs().amax(1, keepdim=True)).all(), "op disagrees with reference"
        del ref_scores
        op_us = graph_us(lambda: torch.ops.dsv4.indexer_score_topk(q, w, codes, scales, n_valid, TOPK))
        key_bytes = B * N * (D // 2 + D // 32)
        gbs = key_bytes / (op_us * 1e-6) / 1e9
        eager_us = graph_us(lambda: peer(q, w, codes, scales, n_valid))
        if time.time() - t0 < BUDGET_S:
            compiled_peer(q, w, codes, scales, n_valid)  # compile outside the capture
            comp_us = graph_us(lambda: compiled_peer(q, w, codes, scales, n_valid))
            comp = f"{comp_us:11.1f} {comp_us / op_us:8.2f}"
        else:
            comp = f"{'skipped':>11} {'-':>8}"
        print(f"{B:>3} {N:>7} | {op_us:8.1f} {gbs:7.0f} {100 * gbs * 1e9 / HBM_BYTES_PER_S:5.1f}% | "
              f"{eager_us:9.1f} {eager_us / op_us:8.2f} | {comp}", flush=True)
        del q, w, codes, scales, n_valid, out
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

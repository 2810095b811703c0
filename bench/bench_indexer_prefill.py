"""Benchmark of dsv4::indexer_prefill_scores (the lightning indexer's scores over a prefill chunk) on the H200.

V4's indexer: 64 heads x 128 dims, bf16 queries / keys (FP4 values), one row. A chunk of S queries starting at
position P scores the (P + s + 1) // 4 compressed entries each has seen (T = (P + S) // 4 in all: the CSA ratio 4).
The peer is the model's torch form in the same run (what prefill ran before the op): an fp32 einsum to
[S, 64, T], relu, the head weights, the head sum, the visibility mask; skipped where its products would not fit
PEER_BYTES. Times: CUDA events around REPS calls after a warm-up. TFLOP/s counts the visible products only
(2 x 64 x 128 per visible (query, entry) pair); the limit is bf16 dense tensor-core math at 790 TFLOP/s
(measured, bench/bench_prefill.py). Then dsv4::indexer_topk (the top-512 of such scores) against the model's torch
form (topk_indices), both on causal chunks of 8192 queries.

Run: python bench/bench_indexer_prefill.py   (about a minute)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from common import cuda_missing  # noqa: E402
from dsv4_ops import ops, reference as ref  # noqa: E402

H, D, RATIO, TOPK = 64, 128, 4, 512
DENSE_FLOPS = 790e12
PEER_BYTES = 12 << 30
REPS = 5
SHAPES = [(1024, 0), (1024, 7168), (4096, 0), (4096, 28672), (8192, 0), (8192, 122880)]  # (S, P)


def inputs(S, P):
    g = torch.Generator(device="cuda").manual_seed(S + P)
    T = (P + S) // RATIO
    q = torch.randn(1, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, T, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(1, S, H, device="cuda", generator=g) * (D**-0.5 * H**-0.5)
    nv = ((P + torch.arange(S, device="cuda") + 1) // RATIO).view(1, S)
    return q, w, k, nv


def ms(fn) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPS


def main() -> int:
    if cuda_missing("bench_indexer_prefill"):
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # the model's fp32 einsum
    print(f"dsv4::indexer_prefill_scores  H={H} D={D} ratio {RATIO}  {torch.cuda.get_device_name(0)}  "
          f"torch {torch.__version__}")
    hdr = (f"{'S':>5} {'from':>7} {'T':>6} | {'op ms':>8} {'TFLOP/s':>8} {'of limit':>8} | {'torch ms':>9} "
           f"{'x faster':>8}")
    print(hdr + "\n" + "-" * len(hdr))
    for S, P in SHAPES:
        q, w, k, nv = inputs(S, P)
        T = k.shape[1]
        got = ops.indexer_prefill_scores(q, w, keys=k, n_visible=nv)
        flops = 2.0 * H * D * float(nv.clamp(max=T).sum())
        op_ms = ms(lambda: ops.indexer_prefill_scores(q, w, keys=k, n_visible=nv))
        tflops = flops / (op_ms * 1e-3) / 1e12
        if S * H * T * 4 <= PEER_BYTES:
            want = ref.indexer_prefill_scores_ref(q, w, k, nv)
            fin = torch.isfinite(want)
            err = float((got - want).abs()[fin].max() / want.abs()[fin].max().clamp(min=1e-30)) if fin.any() else 0.0
            assert torch.equal(fin, torch.isfinite(got)) and err < 1e-4, f"op disagrees with the torch form ({err})"
            del want
            peer_ms = ms(lambda: ref.indexer_prefill_scores_ref(q, w, k, nv))
            peer = f"{peer_ms:9.2f} {peer_ms / op_ms:8.2f}"
        else:
            peer = f"{'skipped':>9} {'-':>8}"  # its [S, 64, T] fp32 products do not fit PEER_BYTES
        print(f"{S:5d} {P:7d} {T:6d} | {op_ms:8.3f} {tflops:8.1f} {tflops * 1e12 / DENSE_FLOPS:7.1%} | {peer}",
              flush=True)
        del q, w, k, nv, got
        torch.cuda.empty_cache()
    bench_topk()
    return 0


def bench_topk() -> None:
    """dsv4::indexer_topk (its default, and each kernel forced) against the model's torch form (topk_indices:
    torch.topk of the int64 composite) on one chunk's scores: the same indices, and the time of each."""
    from dsv4_model.model.indexer import topk_indices
    from dsv4_ops.overrides import TOPK_KERNELS, kernel_overrides

    print(f"\ndsv4::indexer_topk, top-{TOPK} of fp32 scores [S, T] ({torch.cuda.get_device_name(0)}); "
          "op ms by kernel (auto = the default)")
    hdr = (f"{'S':>5} {'T':>6} | " + " ".join(f"{n:>8}" for n in TOPK_KERNELS)
           + f" {'GB/s':>7} | {'torch ms':>9} {'x faster':>8}")
    print(hdr + "\n" + "-" * len(hdr))
    g = torch.Generator(device="cuda").manual_seed(1)
    for S, T in ((64, 8192), (256, 8192), (1024, 8192), (256, 32768), (1024, 32768), (8192, 2048), (8192, 8192),
                 (8192, 32768)):
        sc = torch.randn(1, S, T, device="cuda", generator=g)
        vis = (torch.arange(S, device="cuda") * T // S + 1).view(1, S, 1)  # causal: row s sees (s + 1) T / S
        sc = sc.masked_fill(torch.arange(T, device="cuda") >= vis, float("-inf"))
        k = min(TOPK, T)
        want = topk_indices(sc, k)
        times = []
        for name in TOPK_KERNELS:
            with kernel_overrides(topk_kernel=name):
                assert torch.equal(ops.indexer_topk(sc, k), want), f"the {name} kernel disagrees with topk_indices"
                times.append(ms(lambda: ops.indexer_topk(sc, k)))
        peer_ms = ms(lambda: topk_indices(sc, k))
        best = min(times)
        print(f"{S:5d} {T:6d} | " + " ".join(f"{t:8.3f}" for t in times)
              + f" {sc.numel() * 4 / (best * 1e-3) / 1e9:7.0f} | {peer_ms:9.3f} {peer_ms / times[0]:8.2f}", flush=True)
        del sc, want
        torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())

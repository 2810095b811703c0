"""dsv4::sparse_attn_decode vs the tensor-op form it replaces (the model's Attention._attend: gather, fp32
einsums, masks, softmax with the sink), same run, batch 1 to 128, V4-Flash decode shapes:
  CSA: window 128 + top-512 of the compressed entries; HCA at 64K context: window 128 + 512 entries; SWA: the
  window only. H = 64 heads x D = 512, bf16 cache.
µs per call by CUDA-graph replay (the tensor-op form compiled with torch.compile, as in the decode step; one
compiled graph per shape), bytes = the cache rows read once, fraction of 4.26 TB/s. The op runs its tensor-core
partial kernel here (bf16, D % 64 == 0; 16 heads per CTA below the SM count); then each partial kernel forced on the
same inputs (the attn_kernel override): 'simt' the CUDA-core one, 'mma_all_heads' the 64-head mma CTA, 'wgmma' the
warpgroup-MMA one (a decode batch's rows read once for all 64 heads instead of once per 16).
Prefill form (Attention._prefill_attend_op): T query rows of one sequence, each listing its 128-token window and
512 compressed entries of one shared key buffer (kv a stride-0 view), the CTA holding 16 heads (decode's form) vs 64
heads (a row's keys staged once; the default at T >= the SM count) vs the warpgroup-MMA kernel (attn_kernel="wgmma");
TF/s counts QK and PV (P as bf16 hi + lo: 3 products of 2 H J D).

Run: python bench/bench_attn_decode.py [--parts decode,prefill]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from dsv4_ops.reference import sparse_attn_decode_ref  # noqa: E402
from dsv4_ops.overrides import kernel_overrides  # noqa: E402
from timing import cuda_generator, graph_us, vs_peer  # noqa: E402

H, D, W = 64, 512, 128
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CASES = [("CSA top-512", 1024, 512), ("HCA 64K ctx", 512, 512), ("SWA", 0, 0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="decode,prefill", help="decode (with the compiled peer), prefill")
    parts = set(ap.parse_args().parts.split(","))
    gen = cuda_generator("bench_attn_decode")
    if gen is None:
        return 0
    if "decode" in parts:
        decode(gen)
    if "prefill" in parts:
        prefill(gen)
    return 0


def decode(gen) -> None:
    # every (case, batch) shape keeps its own compiled graph (past the default limit dynamo falls back to eager)
    torch._dynamo.config.recompile_limit = 64
    torch_form = torch.compile(sparse_attn_decode_ref, dynamic=False)
    print(f"{'case':12} {'B':>3} {'J':>5} | {'op us':>7} {'peer us':>10} {'speedup':>8} | {'GB/s':>6} {'HBM':>5} | "
          "forced kernels")
    for name, n_entries, listed in CASES:
        for B in BATCHES:
            N = W + n_entries
            q = torch.randn(B, H, D, device="cuda", generator=gen).to(torch.bfloat16)
            kv = torch.randn(B, N, D, device="cuda", generator=gen).to(torch.bfloat16)
            win = torch.arange(W, device="cuda").expand(B, W)
            sel = W + torch.randint(0, max(n_entries, 1), (B, listed), device="cuda", generator=gen)
            idx = torch.cat([win, sel], 1).int() if listed else win.int().contiguous()
            sink = torch.randn(H, device="cuda", generator=gen)
            scale = D ** -0.5
            ours = graph_us(lambda: torch.ops.dsv4.sparse_attn_decode(q, kv, idx, sink, scale), 64)
            peer = graph_us(lambda: torch_form(q, kv, idx, sink, scale), 64)
            err = float((torch.ops.dsv4.sparse_attn_decode(q, kv, idx, sink, scale).float()
                         - sparse_attn_decode_ref(q, kv, idx, sink, scale).float()).abs().max())
            forced = {}  # the other partial kernels on the same inputs: us, max |diff| against the reference
            for kernel in ("simt", "mma_all_heads", "wgmma"):
                with kernel_overrides(attn_kernel=kernel):
                    us = graph_us(lambda: torch.ops.dsv4.sparse_attn_decode(q, kv, idx, sink, scale), 64)
                    e = float((torch.ops.dsv4.sparse_attn_decode(q, kv, idx, sink, scale).float()
                               - sparse_attn_decode_ref(q, kv, idx, sink, scale).float()).abs().max())
                forced[kernel] = (us, e)
            others = " ".join(f"{k} {us:7.2f}" for k, (us, _) in forced.items())
            errs = ", ".join(f"{k} {e:.1e}" for k, (_, e) in forced.items())
            print(f"{name:12} {B:3d} {idx.shape[1]:5d} | {vs_peer(ours, peer, B * idx.shape[1] * D * 2)} | "
                  f"{others} us   (max |diff| {err:.1e}; {errs})", flush=True)


def prefill(gen) -> None:
    print(f"\n{'prefill rows':12} {'J':>5} | {'16 heads us':>11} {'64 heads us':>11} {'wgmma us':>9} | "
          f"{'TF/s 64 heads':>13} {'wgmma':>6} | max |diff| 64 heads, wgmma vs 16 heads")
    n_entries, listed = 2048, 512
    for T in (1024, 4096):
        L = W - 1 + T + n_entries
        q = torch.randn(T, H, D, device="cuda", generator=gen).to(torch.bfloat16)
        buf = torch.randn(1, L, D, device="cuda", generator=gen).to(torch.bfloat16)
        t = torch.arange(T, device="cuda").view(T, 1)
        win = (t + torch.arange(W, device="cuda").view(1, W)).int()
        sel = (W - 1 + T + torch.randint(0, n_entries, (T, listed), device="cuda", generator=gen)).int()
        sink = torch.randn(H, device="cuda", generator=gen)
        kv = buf.expand(T, -1, -1)

        def call():
            return torch.ops.dsv4.sparse_attn_decode(q, kv, win, sink, D ** -0.5, None, 0, sel - (W - 1 + T),
                                                     W - 1 + T)
        outs, times = [], []
        for kernel in ("mma_16_heads", "mma_all_heads", "wgmma"):
            with kernel_overrides(attn_kernel=kernel):
                times.append(graph_us(call, 4))
                outs.append(call())
        J = W + listed
        flops = 3 * 2.0 * T * H * J * D
        diff = [float((o.float() - outs[0].float()).abs().max()) for o in outs[1:]]
        print(f"{T:12d} {J:5d} | {times[0]:11.1f} {times[1]:11.1f} {times[2]:9.1f} | "
              f"{flops / times[1] * 1e-6:13.1f} {flops / times[2] * 1e-6:6.1f} | {diff[0]:.1e}, {diff[1]:.1e}")


if __name__ == "__main__":
    sys.exit(main())

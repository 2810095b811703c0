"""dsv4::sparse_attn_decode vs the tensor-op form it replaces (the model's Attention._attend: gather, fp32
einsums, masks, softmax with the sink), same run, batch 1 to 32, V4-Flash decode shapes:
  CSA: window 128 + top-512 of the compressed entries; HCA at 64K context: window 128 + 512 entries; SWA: the
  window only. H = 64 heads x D = 512, bf16 cache.
µs per call by CUDA-graph replay (the tensor-op form compiled with torch.compile, as in the decode step; one
compiled graph per shape), bytes = the cache rows read once, fraction of 4.26 TB/s. The op runs its tensor-core
partial kernel here (bf16, D % 64 == 0); 'simt' = the CUDA-core partial kernel (the attn_kernel="simt" override) on the
same inputs.

Run: python bench/bench_attn_decode.py
"""
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
BATCHES = (1, 2, 4, 8, 16, 32)
CASES = [("CSA top-512", 1024, 512), ("HCA 64K ctx", 512, 512), ("SWA", 0, 0)]


def main() -> int:
    gen = cuda_generator("bench_attn_decode")
    if gen is None:
        return 0
    # every (case, batch) shape keeps its own compiled graph (past the default limit dynamo falls back to eager)
    torch._dynamo.config.recompile_limit = 64
    torch_form = torch.compile(sparse_attn_decode_ref, dynamic=False)
    print(f"{'case':12} {'B':>2} {'J':>5} | {'op us':>7} {'peer us':>10} {'speedup':>8} | {'GB/s':>6} {'HBM':>5}")
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
            with kernel_overrides(attn_kernel="simt"):  # the CUDA-core partial kernel, same inputs
                simt = graph_us(lambda: torch.ops.dsv4.sparse_attn_decode(q, kv, idx, sink, scale), 64)
                err_simt = float((torch.ops.dsv4.sparse_attn_decode(q, kv, idx, sink, scale).float()
                                  - sparse_attn_decode_ref(q, kv, idx, sink, scale).float()).abs().max())
            print(f"{name:12} {B:2d} {idx.shape[1]:5d} | {vs_peer(ours, peer, B * idx.shape[1] * D * 2)} | "
                  f"simt {simt:7.2f} us ({peer / simt:5.2f}x)   (max |diff| {err:.1e}, simt {err_simt:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fused decode steps vs what the decode step runs without them (the model's tensor
ops, compiled with torch.compile as in the decode step; for hc_post_pre: hc_post compiled + dsv4::hc_pre), same
run, V4-Flash decode shapes at batch 1 and 8: dsv4::rms_norm_rope (q: 64 heads x 512, no weight; kv: 512, weight,
FP8), dsv4::hadamard_fp4 (indexer queries 64 x 128 with RoPE 64), dsv4::indexer_store_keys (a closing window, D
128), dsv4::hc_post_pre (hc 4 x 4096) and sparse_attn_decode's out_rope (640 rows). µs per call by CUDA-graph
replay; bytes = inputs + outputs once, fraction of 4.26 TB/s.

Run: python bench/bench_decode_glue.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from dsv4_ops import reference as ref  # noqa: E402
from dsv4_model.model.layers import apply_rope, hc_post  # noqa: E402
from dsv4_model.model.quant_sim import indexer_fake_quant  # noqa: E402
from timing import cuda_generator, graph_us, vs_peer  # noqa: E402

EPS, ITERS = 1e-6, 20
ops = torch.ops.dsv4


def rope_table(rows, rope, gen):
    ang = torch.rand(rows, rope // 2, device="cuda", generator=gen) * 6.3
    return torch.stack([ang.cos(), ang.sin()], -1)


def store_tensor_ops(keys, pos, ratio, kv, codes, scales):
    """Attention.decode's indexer key writes without the op: the FP4 packing, then three conditional writes."""
    B, n = keys.shape[0], kv.shape[1]
    rows, done = torch.arange(B, device=keys.device), ((pos + 1) % ratio == 0).unsqueeze(1)
    slot = (pos // ratio).clamp(max=n - 1)
    packed, exps = ref.indexer_fp4_quantize_keys(keys)
    for cache, value in ((kv, keys), (codes, packed), (scales, exps)):
        cache.index_put_((rows, slot), torch.where(done, value.to(cache.dtype), cache[rows, slot]))


def post_then_pre(out, res, post, comb, *args):
    h = hc_post(out, res, post, comb)
    return (h, *ops.hc_pre(h, *args))


def row(name, B, ours, peer, nbytes):
    print(f"{name:22} {B:2d} | {vs_peer(ours, peer, nbytes)}")


def main() -> int:
    gen = cuda_generator("bench_decode_glue")
    if gen is None:
        return 0
    torch._dynamo.config.recompile_limit = 64  # one compiled graph per shape
    bf = torch.bfloat16
    norm_rope_peer = torch.compile(ref.rms_norm_rope_ref, dynamic=False)
    hadamard_peer = torch.compile(lambda x, cs: indexer_fake_quant(apply_rope(x, cs.unsqueeze(1), 64)), dynamic=False)
    store_peer = torch.compile(store_tensor_ops, dynamic=False)
    post_pre_peer = torch.compile(post_then_pre, dynamic=False)
    out_rope_peer = torch.compile(lambda o, cs: apply_rope(o, cs.unsqueeze(-3), 64, inverse=True), dynamic=False)
    print(f"{'step':22} {'B':>2} | {'op us':>7} {'peer us':>10} {'speedup':>8} | {'GB/s':>6} {'HBM':>5}")
    with torch.no_grad():
        for B in (1, 8):
            cs = rope_table(B, 64, gen)
            q = torch.randn(B, 64, 512, device="cuda", generator=gen).to(bf)
            row("rms_norm_rope q", B, graph_us(lambda: ops.rms_norm_rope(q, None, cs, EPS, 64, False), 64),
                graph_us(lambda: norm_rope_peer(q, None, cs, EPS, 64, False), 64), 2 * q.numel() * 2)
            kv, w = torch.randn(B, 1, 512, device="cuda", generator=gen).to(bf), torch.rand(512, device="cuda") + 0.5
            row("rms_norm_rope kv fp8", B, graph_us(lambda: ops.rms_norm_rope(kv, w, cs, EPS, 64, True), 64),
                graph_us(lambda: norm_rope_peer(kv, w, cs, EPS, 64, True), 64), 2 * kv.numel() * 2 + 2048)
            iq = torch.randn(B, 64, 128, device="cuda", generator=gen).to(bf)
            row("hadamard_fp4 queries", B, graph_us(lambda: ops.hadamard_fp4(iq, cs, 64), 64),
                graph_us(lambda: hadamard_peer(iq, cs), 64), 2 * iq.numel() * 2)
            keys = torch.randn(B, 128, device="cuda", generator=gen).to(bf)
            caches = (torch.zeros(B, 64, 128, dtype=bf, device="cuda"),
                      torch.zeros(B, 64, 64, dtype=torch.uint8, device="cuda"),
                      torch.zeros(B, 64, 4, dtype=torch.uint8, device="cuda"))
            pos = torch.full((B,), 4 * 9 + 3, device="cuda")  # a window closes
            row("indexer_store_keys", B, graph_us(lambda: ops.indexer_store_keys(keys, pos, 4, *caches), 64),
                graph_us(lambda: store_peer(keys, pos, 4, *caches), 64), keys.numel() * 2 * 2 + B * 68)
            out = torch.randn(B, 4096, device="cuda", generator=gen).to(bf)
            res = torch.randn(B, 4, 4096, device="cuda", generator=gen).to(bf)
            post = torch.rand(B, 4, device="cuda", generator=gen) * 2
            comb = torch.rand(B, 4, 4, device="cuda", generator=gen) / 4
            fn = torch.randn(24, 4 * 4096, device="cuda", generator=gen) / 128
            scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") / 2
            nw = torch.rand(4096, device="cuda") + 0.5
            args = (fn, scale, base, nw, ITERS, EPS, EPS, EPS)
            row("hc_post_pre", B, graph_us(lambda: ops.hc_post_pre(out, res, post, comb, *args), 64),
                graph_us(lambda: post_pre_peer(out, res, post, comb, *args), 64),
                fn.numel() * 4 + 3 * res.numel() * 2)
            o = torch.randn(B, 64, 512, device="cuda", generator=gen).to(bf)
            ctx = torch.randn(B, 640, 512, device="cuda", generator=gen).to(bf)
            idx = torch.arange(640, device="cuda", dtype=torch.int32).expand(B, 640).contiguous()
            sink = torch.randn(64, device="cuda", generator=gen)
            plain = graph_us(lambda: out_rope_peer(ops.sparse_attn_decode(o, ctx, idx, sink, 0.044), cs), 64)
            fused = graph_us(lambda: ops.sparse_attn_decode(o, ctx, idx, sink, 0.044, cs, 64), 64)
            row("attn + out_rope", B, fused, plain, ctx.numel() * 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

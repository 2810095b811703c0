"""Prefill's sliding-window attention: `Attention._attend_window` (sub-blocks of W queries, each against the
2W - 1 keys it can see through a band mask) against one softmax over the block's dense [T, T + W - 1] window mask
(`Attention._attend`, the form prefill ran before) in the same run, fp32 math as the model's.

Shapes: one row, T queries of one block, W = 128 (V4), H heads of D = 512 (V4-Flash: 64 x 512; --heads picks
fewer for the CPU). The floor: the band's products (T x H x W x D x 4 FLOPs: scores and weighted sum) at
--flops (default 790e12, bf16 dense tensor cores, bench/bench_prefill.py; the kernels here run fp32, so this is
a bound no fp32 form reaches; printed on CUDA only).

Run: python bench/bench_prefill_window.py [--tokens 512,2048,8192] [--heads 64] [--device cuda|cpu]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402,F401
from dsv4_model.checkpoint.writer import make_config  # noqa: E402
from dsv4_model.model.attention import Attention  # noqa: E402

W, D = 128, 512


def seconds(fn, device) -> float:
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    sync()
    return (time.perf_counter() - t) / 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--flops", type=float, default=790e12)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    a = Attention(make_config("tiny", window_size=W, n_heads=args.heads, head_dim=D), layer_id=0,
                  dtype=torch.float32, max_batch=1, max_seq_len=max(int(s) for s in args.tokens.split(",")) + W).to(dev)
    a.attn_sink.data.zero_()
    print(f"prefill window attention, W={W} H={args.heads} D={D}, fp32, {dev} "
          f"({torch.cuda.get_device_name(0) if dev.type == 'cuda' else f'{torch.get_num_threads()} threads'})")
    print(f"{'T':>6} | {'sub-blocks ms':>13} | {'dense mask ms':>13} {'x faster':>8} | {'floor ms':>8} {'of floor':>8}")
    P = W - 1
    for T in (int(s) for s in args.tokens.split(",")):
        g = torch.Generator(device=dev).manual_seed(T)
        kv = torch.randn(1, P + T, D, device=dev, generator=g)
        q = torch.randn(1, T, args.heads, D, device=dev, generator=g)
        first_ok = torch.full((1, 1), P, device=dev)  # a chunk from position 0

        def dense():
            tq = torch.arange(T, device=dev).view(1, -1, 1)
            tj = torch.arange(T + P, device=dev).view(1, 1, -1)
            return a._attend(q, kv, (tj >= tq) & (tj <= tq + P) & (tj >= first_ok.unsqueeze(-1)))

        ours = seconds(lambda: a._attend_window(q, kv, 0, first_ok), dev)
        try:
            torch.testing.assert_close(a._attend_window(q, kv, 0, first_ok), dense(), atol=1e-5, rtol=1e-5)
            peer = seconds(dense, dev)
            peer_txt = f"{peer * 1e3:13.1f} {peer / ours:8.2f}"
        except torch.OutOfMemoryError:
            peer_txt = f"{'out of memory':>13} {'-':>8}"
        floor = T * args.heads * W * D * 4 / args.flops
        floor_txt = f"{floor * 1e3:8.3f} {floor / ours:7.1%}" if dev.type == "cuda" else f"{'-':>8} {'-':>8}"
        print(f"{T:6d} | {ours * 1e3:13.1f} | {peer_txt} | {floor_txt}", flush=True)
        del kv, q
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

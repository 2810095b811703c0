"""Fake for dsv4::sparse_attn_decode: the shape and dtype of q (with or without the output's inverse RoPE, with or
without a second row list)."""
import torch


def _sparse_attn_decode_fake(q, kv, idx, sink, scale, out_rope=None, rope_dim=0, idx2=None, idx2_offset=0,
                             kv_batch=0):
    op = "dsv4::sparse_attn_decode"
    torch._check(q.dim() == 3, lambda: f"{op}: q must be [B, H, D], got {tuple(q.shape)}")
    torch._check(q.dtype in (torch.bfloat16, torch.float16, torch.float32),
                 lambda: f"{op}: q must be bfloat16, float16 or float32, got {q.dtype}")
    torch._check(kv_batch == 0 or (kv_batch > 0 and q.shape[0] % kv_batch == 0),
                 lambda: f"{op}: kv_batch must be 0 or divide B = {q.shape[0]}, got {kv_batch}")
    rows = kv_batch or q.shape[0]
    torch._check(kv.dim() == 3 and kv.shape[2] == q.shape[2] and kv.shape[0] >= rows,
                 lambda: f"{op}: kv must be [B' >= {rows}, N, D], got {tuple(kv.shape)}")
    torch._check(kv.dtype == q.dtype, lambda: f"{op}: kv must have q's dtype")
    torch._check(idx.dim() == 2 and idx.shape[0] == q.shape[0] and idx.dtype in (torch.int32, torch.int64),
                 lambda: f"{op}: idx must be int32 / int64 [B, J]")
    torch._check(sink.dtype == torch.float32 and sink.dim() == 1 and sink.shape[0] == q.shape[1],
                 lambda: f"{op}: sink must be float32 [H]")
    if out_rope is None:
        torch._check(rope_dim == 0, lambda: f"{op}: rope_dim must be 0 without out_rope")
    else:
        torch._check(0 < rope_dim <= q.shape[2] and rope_dim % 4 == 0,
                     lambda: f"{op}: rope_dim must be a multiple of 4 in (0, D] with out_rope")
        torch._check(out_rope.dtype == torch.float32 and out_rope.shape == (q.shape[0], rope_dim // 2, 2),
                     lambda: f"{op}: out_rope must be float32 [B, rope_dim / 2, 2]")
    torch._check(0 <= idx2_offset < 2**31, lambda: f"{op}: idx2_offset must be in [0, 2^31), got {idx2_offset}")
    if idx2 is not None:
        torch._check(idx2.dim() == 2 and idx2.shape[0] == q.shape[0] and idx2.dtype in (torch.int32, torch.int64),
                     lambda: f"{op}: idx2 must be int32 / int64 [B, J2]")
    return q.new_empty(q.shape)


torch.library.register_fake("dsv4::sparse_attn_decode")(_sparse_attn_decode_fake)

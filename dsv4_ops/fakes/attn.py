"""Fake for dsv4::sparse_attn_decode: the shape and dtype of q."""
import torch


def _sparse_attn_decode_fake(q, kv, idx, sink, scale):
    op = "dsv4::sparse_attn_decode"
    torch._check(q.dim() == 3, lambda: f"{op}: q must be [B, H, D], got {tuple(q.shape)}")
    torch._check(q.dtype in (torch.bfloat16, torch.float16, torch.float32),
                 lambda: f"{op}: q must be bfloat16, float16 or float32, got {q.dtype}")
    torch._check(kv.dim() == 3 and kv.shape[2] == q.shape[2] and kv.shape[0] >= q.shape[0],
                 lambda: f"{op}: kv must be [B' >= B, N, D], got {tuple(kv.shape)}")
    torch._check(kv.dtype == q.dtype, lambda: f"{op}: kv must have q's dtype")
    torch._check(idx.dim() == 2 and idx.shape[0] == q.shape[0] and idx.dtype in (torch.int32, torch.int64),
                 lambda: f"{op}: idx must be int32 / int64 [B, J]")
    torch._check(sink.dtype == torch.float32 and sink.dim() == 1 and sink.shape[0] == q.shape[1],
                 lambda: f"{op}: sink must be float32 [H]")
    return q.new_empty(q.shape)


# A library built before this op existed must still import (other ops keep working).
if hasattr(torch.ops.dsv4, "sparse_attn_decode"):
    torch.library.register_fake("dsv4::sparse_attn_decode")(_sparse_attn_decode_fake)

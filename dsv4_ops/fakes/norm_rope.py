"""Fakes for dsv4::rms_norm_rope (a tensor like x) and dsv4::rms_norm_rope_store (writes cache in place)."""
import torch


def _rms_norm_rope_fake(x, weight, cs, eps, rope_dim, fp8_nope):
    op = "dsv4::rms_norm_rope"
    torch._check(x.dtype in (torch.bfloat16, torch.float32), lambda: f"{op}: x must be bfloat16 or float32")
    torch._check(x.dim() == 3, lambda: f"{op}: x must be [rows, heads, d], got {tuple(x.shape)}")
    rows, _, d = x.shape
    torch._check(0 <= rope_dim <= d and rope_dim % 4 == 0 and d % 4 == 0,
                 lambda: f"{op}: rope_dim must be a multiple of 4 in [0, d], d a multiple of 4")
    torch._check(cs.dtype == torch.float32 and cs.shape == (rows, rope_dim // 2, 2),
                 lambda: f"{op}: cs must be float32 [rows, rope_dim / 2, 2]")
    if weight is not None:
        torch._check(weight.dtype == torch.float32 and weight.shape == (d,), lambda: f"{op}: weight must be [d]")
    torch._check(not fp8_nope or (d - rope_dim) % 64 == 0, lambda: f"{op}: fp8_nope needs d - rope_dim % 64 == 0")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


torch.library.register_fake("dsv4::rms_norm_rope")(_rms_norm_rope_fake)


def _rms_norm_rope_store_fake(x, weight, cs, eps, rope_dim, fp8_nope, positions, ratio, offset, slots, cache,
                              kv_batch=0):
    op = "dsv4::rms_norm_rope_store"
    torch._check(x.dim() == 2, lambda: f"{op}: x must be [rows, d], got {tuple(x.shape)}")
    _rms_norm_rope_fake(x.unsqueeze(1), weight, cs, eps, rope_dim, fp8_nope)
    rows, d = x.shape
    torch._check(positions.dtype in (torch.int64, torch.int32) and positions.shape == (rows,),
                 lambda: f"{op}: positions must be int64 / int32 [rows]")
    torch._check(ratio >= 0 and offset >= 0 and slots >= 1, lambda: f"{op}: need ratio >= 0, offset >= 0, slots >= 1")
    torch._check(kv_batch == 0 or (kv_batch > 0 and rows % kv_batch == 0),
                 lambda: f"{op}: kv_batch must be 0 or divide rows = {rows}, got {kv_batch}")
    torch._check(cache.dtype == x.dtype and cache.dim() == 3 and cache.shape[0] >= (kv_batch or rows)
                 and cache.shape[1] >= offset + slots and cache.shape[2] == d,
                 lambda: f"{op}: cache must be [>= rows (kv_batch), >= offset + slots, d] in x's dtype")


torch.library.register_fake("dsv4::rms_norm_rope_store")(_rms_norm_rope_store_fake)

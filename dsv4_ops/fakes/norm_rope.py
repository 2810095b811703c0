"""Fake for dsv4::rms_norm_rope: a tensor like x."""
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


# A library built before this op existed must still import (other ops keep working).
if hasattr(torch.ops.dsv4, "rms_norm_rope"):
    torch.library.register_fake("dsv4::rms_norm_rope")(_rms_norm_rope_fake)

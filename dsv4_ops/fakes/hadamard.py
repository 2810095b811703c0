"""Fake for dsv4::hadamard_fp4: a tensor like x."""
import torch


def _hadamard_fp4_fake(x, cs, rope_dim):
    op = "dsv4::hadamard_fp4"
    torch._check(x.dtype in (torch.bfloat16, torch.float32), lambda: f"{op}: x must be bfloat16 or float32")
    torch._check(x.dim() == 3, lambda: f"{op}: x must be [rows, heads, d], got {tuple(x.shape)}")
    rows, _, d = x.shape
    torch._check(32 <= d <= 4096 and d & (d - 1) == 0, lambda: f"{op}: d must be a power of two in [32, 4096]")
    torch._check((cs is not None) == (rope_dim > 0), lambda: f"{op}: cs must be given exactly when rope_dim > 0")
    torch._check(0 <= rope_dim <= d and rope_dim % 2 == 0, lambda: f"{op}: rope_dim must be even and in [0, d]")
    if cs is not None:
        torch._check(cs.dtype == torch.float32 and cs.shape == (rows, rope_dim // 2, 2),
                     lambda: f"{op}: cs must be float32 [rows, rope_dim / 2, 2]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


torch.library.register_fake("dsv4::hadamard_fp4")(_hadamard_fp4_fake)

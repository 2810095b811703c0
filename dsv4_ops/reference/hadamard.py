"""Indexer Hadamard + FP4 reference (dsv4::hadamard_fp4)."""
import torch

from ._helpers import _f32_recip, _rope_rows


def hadamard_fp4_ref(x: torch.Tensor, cs, rope_dim: int) -> torch.Tensor:
    """x [rows, heads, d]: RoPE of the trailing rope_dim dims by cs [rows, rope_dim / 2, 2] (rounded to x's dtype),
    the rotation as x @ H_d d^-0.5 in float64 (the exact product, rounded once to fp32: the op's butterfly sums
    in its own order, so compare within fp32 rounding), rounded to x's dtype, then FP4 e2m1 with a power-of-two
    scale per 32 (amax floored at 6 * 2^-126, times the fp32 1/6, rounded up), dequantized, rounded."""
    d = x.shape[-1]
    y = (_rope_rows(x, cs, rope_dim) if rope_dim else x).float()
    i = torch.arange(d)
    both = i[:, None] & i[None, :]  # Sylvester order: H[i, j] = (-1)^popcount(i & j)
    parity = sum((both >> k) & 1 for k in range(max(d.bit_length() - 1, 1))) % 2
    h = (1.0 - 2.0 * parity.double()) * d ** -0.5
    y = (y.double() @ h).float().to(x.dtype).float()
    b = y.unflatten(-1, (d // 32, 32))
    t = (b.abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0 ** -126) * _f32_recip(6.0)).view(torch.int32)
    s = ((((t >> 23) & 0xFF) + ((t & 0x7FFFFF) != 0).int()) << 23).view(torch.float32)
    v = (b / s).clamp(-6.0, 6.0)
    a = v.abs()
    q = torch.where(a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    q = torch.where(v < 0, -q, q) * s
    return q.flatten(-2).to(x.dtype)

"""Simulated (quantize -> dequantize) FP8 / FP4 rounding of the official QAT numerics.

The official model (inference/kernel.py `act_quant(..., inplace=True)` and `fp4_act_quant(..., inplace=True)`)
rounds some activations in place so that they are exactly representable in a low-precision format:
  * FP8 e4m3, one power-of-two (ue8m0) scale per block of 64 along the last dim: the 448 non-RoPE dims of every
    window / compressed KV vector.
  * Walsh-Hadamard rotation (orthonormal, scale n^-0.5) then FP4 e2m1 with one power-of-two scale per block of 32:
    indexer queries and indexer compressed keys.
Scales follow the kernel exactly: amax is floored (1e-4 for FP8, 6*2^-126 for FP4), multiplied by the fp32
reciprocal of the format max, and rounded UP to a power of two with the IEEE exponent trick. Everything here is
plain tensor code (no .item(), static shapes) so it traces under torch.compile.
"""

from __future__ import annotations

import functools
import struct

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


# the kernel multiplies by the fp32-rounded reciprocal of the format max (not a division)
_INV = {FP8_MAX: _f32(1.0 / FP8_MAX), FP4_MAX: _f32(1.0 / FP4_MAX)}


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(x)) for positive normal fp32 x, via the exponent/mantissa bits (as the TileLang kernel)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def _block_scale(xb: torch.Tensor, floor: float, fmt_max: float) -> torch.Tensor:
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(floor)
    return pow2_ceil(amax * _INV[fmt_max])


def fp8_e4m3_block_fake_quant(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Round `x` (any float dtype, last dim a multiple of `block`) to FP8 e4m3 with per-block pow2 scales."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"fp8 fake-quant: last dim {n} is not a multiple of block {block}")
    xb = x.float().unflatten(-1, (n // block, block))
    s = _block_scale(xb, FP8_AMAX_FLOOR, FP8_MAX)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    return q.flatten(-2).to(x.dtype)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the nearest FP4 e2m1 value (ties to even code), as cvt.rn does.

    e2m1 magnitudes: 0, .5, 1, 1.5 (step .5 below 2), 2, 3 (step 1 below 4), 4, 6 (step 2). Within each binade the
    even code is the even multiple of the step, so round-half-even of v/step gives ties-to-even."""
    a = v.abs()
    q = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5,
                    torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0))
    return torch.where(v < 0, -q, q)


def fp4_e2m1_block_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round `x` to FP4 e2m1 with per-block power-of-two scales (amax/6 rounded up)."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"fp4 fake-quant: last dim {n} is not a multiple of block {block}")
    xb = x.float().unflatten(-1, (n // block, block))
    s = _block_scale(xb, FP4_AMAX_FLOOR, FP4_MAX)
    q = round_to_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX)) * s
    return q.flatten(-2).to(x.dtype)


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n**-0.5).to(torch.float32)


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Orthonormal Sylvester-ordered Walsh-Hadamard matrix (symmetric), fp32."""
    return _hadamard_cpu(n).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x H_n n^-0.5 over the last dim (n a power of two), as fast_hadamard_transform(x, scale=n**-0.5) computes it:
    a butterfly in fp32 (stride 1, 2, 4, ...: (a, b) -> (a + b, a - b) for the pair (i, i + stride) with i's
    stride bit clear), then one multiply by the fp32 n^-0.5, rounded to x's dtype. Fixed order, so the
    dsv4::hadamard_fp4 kernels reproduce it bit for bit; x @ hadamard_matrix(n) equals it to fp32 rounding."""
    n = x.shape[-1]
    if n & (n - 1) or n < 1:
        raise ValueError(f"Hadamard size {n} is not a power of two")
    y = x.float()
    lead = y.shape[:-1]
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
        h *= 2
    return (y.reshape(*lead, n) * n**-0.5).to(x.dtype)


def kv_fake_quant(kv: torch.Tensor, rope_dim: int, block: int = 64) -> torch.Tensor:
    """FP8-round the non-RoPE (leading) dims of KV vectors; the trailing `rope_dim` dims stay as they are."""
    nope = kv[..., : kv.shape[-1] - rope_dim]
    return torch.cat([fp8_e4m3_block_fake_quant(nope, block), kv[..., kv.shape[-1] - rope_dim:]], dim=-1)


def indexer_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Hadamard-rotate then FP4-round indexer queries / keys (whole vector)."""
    return fp4_e2m1_block_fake_quant(hadamard_rotate(x), block)


def fp4_pack_indexer_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP4 indexer cache form of keys k [..., D] (D % 32 == 0, finite): E2M1 codes of
    fp4_e2m1_block_fake_quant's values (uint8 [..., D/2], element 2j in the low nibble; +0 for zero) and each
    32-block's power-of-two scale as its biased fp32 exponent (uint8 [..., D/32], UE8M0). Exact: the packed keys
    decode to the fake-quantized ones."""
    n = k.shape[-1]
    if n % 32:
        raise ValueError(f"fp4 indexer keys: last dim {n} is not a multiple of 32")
    xb = k.float().unflatten(-1, (n // 32, 32))
    s = _block_scale(xb, FP4_AMAX_FLOOR, FP4_MAX)
    q = round_to_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX))
    a = q.abs()
    mag = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(torch.int32)
    code = (mag | ((q < 0).to(torch.int32) << 3)).flatten(-2)
    exponent = (s.squeeze(-1).contiguous().view(torch.int32) >> 23) & 0xFF
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), exponent.to(torch.uint8)

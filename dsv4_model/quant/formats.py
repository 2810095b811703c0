"""Encode/decode the weight formats of the official DeepSeek-V4 checkpoint.

- FP8: e4m3 codes with one multiplicative scale per 128x128 block (w = q * s), scale shape
  [ceil(out/128), ceil(in/128)], stored as E8M0 (a bare power-of-two exponent byte) or, in some
  derived checkpoints, as float32.
- MXFP4 (routed experts): e2m1 codes packed two per int8 byte along the input dim (low nibble = even
  element), one E8M0 scale per 1x32 block along the input dim.

Decoding is exact: every e4m3 / e2m1 value times a power of two is representable in bf16, so
"dequantize to bf16" loses nothing. Encoding is only used to build test checkpoints.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

# e2m1 magnitude for the 3 low bits of a nibble; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(out_features: int, in_features: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    return (_ceil_div(out_features, block), _ceil_div(in_features, block))


def mxfp4_shapes(out_features: int, in_features: int, block: int = FP4_BLOCK) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed weight shape, scale shape) of an [out, in] MXFP4 matrix."""
    return (out_features, in_features // 2), (out_features, _ceil_div(in_features, block))


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode scales to float32. E8M0 bytes become 2**(byte-127) built from the float32 bit pattern
    (exact, including byte 0 = 2**-127 as a subnormal and 255 = NaN); float scales pass through."""
    if scale.dtype == torch.float8_e8m0fnu or scale.dtype == torch.uint8:
        e = scale.view(torch.uint8).to(torch.int32)
        bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
        bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
        return bits.view(torch.float32)
    if scale.is_floating_point():
        return scale.to(torch.float32)
    raise TypeError(f"unsupported scale dtype {scale.dtype}")


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode positive power-of-two float32 scales as E8M0 (exponent byte in float8_e8m0fnu)."""
    bits = scale.to(torch.float32).view(torch.int32)
    e = (bits >> 23) & 0xFF
    return e.to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block_rows: int, block_cols: int) -> torch.Tensor:
    s = scale.repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)
    return s[: shape[0], : shape[1]]


def dequant_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                       block: int = FP8_BLOCK) -> torch.Tensor:
    """[out, in] e4m3 codes x [ceil(out/b), ceil(in/b)] scales -> [out, in] `dtype`."""
    out_f, in_f = weight.shape
    expected = fp8_scale_shape(out_f, in_f, block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} != expected {expected} for weight {tuple(weight.shape)}")
    s = _expand_blocks(e8m0_to_float(scale), (out_f, in_f), block, block)
    return (weight.to(torch.float32) * s).to(dtype)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] int8 (two codes per byte, low nibble first) -> [..., n] float32 values."""
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return _e2m1_table(packed.device)[codes]


_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    # cached: loading a real checkpoint decodes ~34k expert tensors, one host->device copy each otherwise
    t = _E2M1_TABLES.get(device)
    if t is None:
        t = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=device)
        _E2M1_TABLES[device] = t
    return t


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                  block: int = FP4_BLOCK) -> torch.Tensor:
    """[out, in/2] packed e2m1 x [out, ceil(in/32)] scales -> [out, in] `dtype`."""
    out_f, half = packed.shape
    in_f = 2 * half
    _, expected = mxfp4_shapes(out_f, in_f, block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} != expected {expected} for packed weight {tuple(packed.shape)}")
    s = _expand_blocks(e8m0_to_float(scale), (out_f, in_f), 1, block)
    return (unpack_e2m1(packed) * s).to(dtype)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), computed exactly from the float32 bits."""
    bits = x.to(torch.float32).view(torch.int32)
    exp_bits = bits & 0x7F800000
    exact = (bits & 0x007FFFFF) == 0
    up = torch.where(exact, exp_bits, exp_bits + (1 << 23))
    return up.view(torch.float32)


def _block_amax(w: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    out_f, in_f = w.shape
    rows, cols = _ceil_div(out_f, block_rows), _ceil_div(in_f, block_cols)
    padded = torch.zeros(rows * block_rows, cols * block_cols, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.abs().float()
    return padded.view(rows, block_rows, cols, block_cols).amax(dim=(1, 3))


def quant_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [out, in] to (e4m3 codes, E8M0 scales) with power-of-two scales amax/448 rounded up."""
    amax = _block_amax(w, block, block).clamp_min(2.0 ** -100)
    scale = _pow2_ceil(amax / FP8_E4M3_MAX)
    s = _expand_blocks(scale, tuple(w.shape), block, block)
    q = (w.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(scale)


def quant_mxfp4(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [out, in] (in % 32 == 0) to (packed int8 e2m1 codes, E8M0 scales): scale = amax/6
    rounded up to a power of two, codes = nearest e2m1 value."""
    out_f, in_f = w.shape
    if in_f % block:
        raise ValueError(f"MXFP4 needs in_features % {block} == 0, got {in_f}")
    amax = _block_amax(w, 1, block).clamp_min(2.0 ** -100)
    scale = _pow2_ceil(amax / FP4_E2M1_MAX)
    x = w.float() / _expand_blocks(scale, (out_f, in_f), 1, block)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1).to(torch.int32)
    codes = idx | ((x < 0) & (idx > 0)).to(torch.int32) << 3
    pairs = codes.view(out_f, in_f // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, float_to_e8m0(scale)

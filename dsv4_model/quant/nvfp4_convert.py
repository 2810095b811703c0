"""Checkpoint weight formats -> canonical NVFP4 (pure functions; load time only, host syncs allowed).

Canonical NVFP4 = ModelOpt's storage (see dsv4_model/quant/nvfp4.py): codes uint8 [..., N, K/2] (element 2i in the
low nibble), block scales float8_e4m3fn [..., N, K/16], one fp32 global scale per matrix (dequant direction),
value = e2m1 * (float(block_scale) * global_scale).

Sources and how they become NVFP4:
- MXFP4 (official routed experts; e2m1 codes + one E8M0 power-of-two scale per 32 along K): LOSSLESS when the
  exponents of the tensor's non-zero blocks span <= 18 consecutive values. With emax the largest one the global
  scale is 2^(emax - 8), so every block scale 2^(e - emax + 8) lands in E4M3's exact powers of two 2^-9..2^8
  and the E2M1 codes are kept. Blocks below that window are re-quantized from their dequantized values (with
  the same global scale; in practice they flush to ~0, being < 2^-17 of the tensor's largest block) and a
  warning names the tensor and the count. The other blocks stay exact.
- FP8 128x128 blocks: dequantized exactly by the loader (`quant.formats.dequant_fp8_blocks`), then quantized as a
  float.
- Float (bf16 / fp32): post-training quantization, per-tensor amax (`dsv4_model.quant.nvfp4.quantize_weight`).
- NVFP4 (ModelOpt): kept as is. w1 and w3 of an expert share one global scale in the MoE kernel; when their
  `weight_scale_2` differ, `unify_global_scale` re-encodes the block scales of the one with the smaller global
  scale to the larger (exact when the ratio is a power of two and no block scale underflows E4M3, otherwise
  one E4M3 rounding per block, <= 2^-4 relative, and a warning).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from dsv4_model.quant.nvfp4 import BLOCK, E4M3_MAX, e2m1_values, pack_codes, quantize_weight, unpack_codes
from dsv4_model.quant.formats import FP4_BLOCK, e8m0_to_float

# E4M3 holds every power of two 2^-9 (smallest subnormal) .. 2^8 exactly: 18 values.
E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8
LOSSLESS_EXPONENT_SPAN = E4M3_POW2_MAX - E4M3_POW2_MIN + 1


@dataclass
class Nvfp4Tensor:
    """Canonical NVFP4 weight: packed uint8 [..., N, K/2], scale float8_e4m3fn [..., N, K/16], global_scale
    fp32 of shape [...] (0-d for one matrix)."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequant_nvfp4(self.packed, self.scale, self.global_scale, dtype)

    def to(self, device) -> "Nvfp4Tensor":
        return Nvfp4Tensor(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))


@dataclass
class Mxfp4Tensor:
    """Official MXFP4 storage: packed e2m1 int8/uint8 [..., N, K/2], E8M0 (or float power-of-two) scales
    [..., N, ceil(K/32)]."""

    packed: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = unpack_codes(self.packed.view(torch.uint8))
        k = codes.shape[-1]
        s = e8m0_to_float(self.scale).repeat_interleave(FP4_BLOCK, dim=-1)[..., :k]
        return (e2m1_values(codes) * s).to(dtype)


def _scale_times_gs(scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    s = scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale
    g = gs.float()
    return s.float() * g.reshape(g.shape + (1,) * (s.dim() - g.dim()))


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Canonical NVFP4 -> `dtype`, computed as e2m1 * (float(scale) * global_scale) in fp32 (the order of
    dsv4::nvfp4_dequantize), rounded once to `dtype`. `scale` may be float8_e4m3fn or its bytes as uint8."""
    v = e2m1_values(unpack_codes(packed.view(torch.uint8)))
    s = _scale_times_gs(scale, global_scale)
    return (v.unflatten(-1, (-1, BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


def float_to_nvfp4(w: torch.Tensor) -> Nvfp4Tensor:
    """Post-training NVFP4 of a float [..., N, K] (one amax / 2688 global scale per matrix)."""
    return Nvfp4Tensor(*quantize_weight(w))


def mxfp4_to_nvfp4(packed: torch.Tensor, scale: torch.Tensor, *, name: str = "tensor") -> Nvfp4Tensor:
    """MXFP4 [..., N, K/2] + [..., N, ceil(K/32)] -> NVFP4 with ONE global scale for the whole input; lossless
    when the non-zero blocks' exponents span <= 18 values (see the module docstring; warns otherwise)."""
    packed = packed.view(torch.uint8)
    codes = unpack_codes(packed)
    k = codes.shape[-1]
    if k % BLOCK:
        raise ValueError(f"{name}: MXFP4 -> NVFP4 needs K % 16 == 0, got K = {k}")
    s32 = e8m0_to_float(scale)
    if not bool(torch.isfinite(s32).all()):
        raise ValueError(f"{name}: MXFP4 scales hold NaN / inf (E8M0 byte 255)")
    s16 = s32.repeat_interleave(FP4_BLOCK // BLOCK, dim=-1)[..., : k // BLOCK]
    mant, exp = torch.frexp(s16)
    nonzero = ((codes & 7) != 0).unflatten(-1, (-1, BLOCK)).any(-1) & (s16 != 0)
    if not bool((mant[nonzero] == 0.5).all()):
        warnings.warn(f"{name}: MXFP4 scales are not all powers of two; re-quantizing the whole tensor "
                      "from its dequantized values (per-tensor amax)", stacklevel=2)
        return float_to_nvfp4(Mxfp4Tensor(packed, scale).dequantize(torch.float32))
    dev = codes.device
    if not bool(nonzero.any()):
        return Nvfp4Tensor(packed.clone(), torch.zeros(s16.shape, dtype=torch.float8_e4m3fn, device=dev),
                           torch.ones((), dtype=torch.float32, device=dev))
    e = exp.to(torch.int32) - 1  # s16 = 2^e
    emax = int(e[nonzero].max())
    rel = e - (emax - E4M3_POW2_MAX)
    exact = nonzero & (rel >= E4M3_POW2_MIN)
    gs = torch.tensor(math.ldexp(1.0, emax - E4M3_POW2_MAX), dtype=torch.float32, device=dev)
    pow2 = ((rel.clamp(E4M3_POW2_MIN, E4M3_POW2_MAX) + 127) << 23).view(torch.float32)  # exact 2^rel
    bs = torch.where(exact, pow2, torch.zeros_like(s16))
    bs8 = bs.to(torch.float8_e4m3fn)
    low = nonzero & ~exact
    n_low = int(low.sum())
    if n_low == 0:
        return Nvfp4Tensor(packed.clone(), bs8, gs)
    # Blocks more than 17 binades below the largest: re-quantize them from their values with the same
    # (power-of-two) global scale; everything else keeps its exact codes and scales.
    values = Mxfp4Tensor(packed, scale).dequantize(torch.float32)
    rq_packed, rq_scale, _ = quantize_weight(values, gs)
    rq_codes = unpack_codes(rq_packed)
    low_el = low.repeat_interleave(BLOCK, dim=-1)
    out_codes = torch.where(low_el, rq_codes, codes)
    out_scale = torch.where(low, rq_scale.float(), bs).to(torch.float8_e4m3fn)
    warnings.warn(f"{name}: MXFP4 -> NVFP4 is not lossless: block exponents span {emax - int(e[nonzero].min()) + 1} "
                  f"values (> {LOSSLESS_EXPONENT_SPAN}); {n_low} of {int(nonzero.sum())} non-zero 16-blocks lie "
                  f"below 2^{emax - 17} and were re-quantized from their dequantized values", stacklevel=2)
    return Nvfp4Tensor(pack_codes(out_codes), out_scale, gs)


def unify_global_scale(a: Nvfp4Tensor, b: Nvfp4Tensor, *, name: str = "tensor") -> tuple[Nvfp4Tensor, Nvfp4Tensor]:
    """Give two matrices (e.g. an expert's w1 and w3) the larger of their two 0-d global scales by re-encoding
    the block scales of the other one. Exact when the ratio is a power of two (and no scale underflows);
    otherwise warns with the largest relative change of a block scale."""
    ga, gb = float(a.global_scale), float(b.global_scale)
    if ga == gb:
        return a, b
    swap = ga > gb
    lo, hi = (b, a) if swap else (a, b)
    g_lo, g_hi = (gb, ga) if swap else (ga, gb)
    old = lo.scale.view(torch.float8_e4m3fn).double() if lo.scale.dtype == torch.uint8 else lo.scale.double()
    new = (old * (g_lo / g_hi)).float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    # both products hold <= 28 significant bits: exact in float64
    want, got = old * g_lo, new.double() * g_hi
    used = ((unpack_codes(lo.packed.view(torch.uint8)) & 7) != 0).unflatten(-1, (-1, BLOCK)).any(-1)
    bad = used & (want != got)
    if bool(bad.any()):
        rel = float(((got - want).abs() / want.abs())[bad].max())
        warnings.warn(f"{name}: w1/w3 global scales differ ({ga:.6g} vs {gb:.6g}, ratio not a power of two or "
                      f"underflowing); {int(bad.sum())} block scales re-rounded to E4M3 (max relative change "
                      f"{rel:.3g})", stacklevel=2)
    lo = Nvfp4Tensor(lo.packed, new, hi.global_scale.clone())
    return (hi, lo) if swap else (lo, hi)


def cat_rows(a: Nvfp4Tensor, b: Nvfp4Tensor) -> Nvfp4Tensor:
    """Stack two matrices with equal global scales along N (e.g. [w1; w3])."""
    if not torch.equal(a.global_scale, b.global_scale):
        raise ValueError("cat_rows: global scales differ (call unify_global_scale first)")
    return Nvfp4Tensor(torch.cat((a.packed.view(torch.uint8), b.packed.view(torch.uint8)), dim=-2),
                       torch.cat((a.scale.view(torch.float8_e4m3fn) if a.scale.dtype == torch.uint8 else a.scale,
                                  b.scale.view(torch.float8_e4m3fn) if b.scale.dtype == torch.uint8 else b.scale),
                                 dim=-2),
                       a.global_scale)


def to_float(src) -> torch.Tensor:
    """fp32 values of any source (exact for MXFP4 / FP8; NVFP4 in fp32 arithmetic)."""
    if isinstance(src, (Mxfp4Tensor, Nvfp4Tensor)):
        return src.dequantize(torch.float32)
    return src.float()


def to_nvfp4(src, *, name: str = "tensor") -> Nvfp4Tensor:
    """Any source -> NVFP4: NVFP4 kept, MXFP4 converted (lossless when possible), floats quantized."""
    if isinstance(src, Nvfp4Tensor):
        return src
    if isinstance(src, Mxfp4Tensor):
        return mxfp4_to_nvfp4(src.packed, src.scale, name=name)
    return float_to_nvfp4(src)


def gate_up_to_nvfp4(w1, w3, *, name: str = "expert") -> Nvfp4Tensor:
    """[w1; w3] (gate rows first) as one NVFP4 matrix with one global scale (what the MoE kernel takes)."""
    if isinstance(w1, Mxfp4Tensor) and isinstance(w3, Mxfp4Tensor):
        return mxfp4_to_nvfp4(torch.cat((w1.packed.view(torch.uint8), w3.packed.view(torch.uint8)), dim=-2),
                              torch.cat((w1.scale, w3.scale), dim=-2), name=name)
    if isinstance(w1, Nvfp4Tensor) and isinstance(w3, Nvfp4Tensor):
        return cat_rows(*unify_global_scale(w1, w3, name=name))
    return float_to_nvfp4(torch.cat((to_float(w1), to_float(w3)), dim=-2))

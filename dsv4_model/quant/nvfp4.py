"""NVFP4 weights for the dsv4 GEMM/MoE ops: canonical <-> kernel layout, bf16 -> NVFP4, and the modules.

Canonical NVFP4 (ModelOpt checkpoints): codes uint8 [..., N, K/2] (element 2i in the low nibble of byte i,
E2M1 code -> |value| 0, .5, 1, 1.5, 2, 3, 4, 6, bit 3 = sign), block scales float8_e4m3fn [..., N, K/16],
one fp32 global scale per matrix in the dequant direction (ModelOpt `weight_scale_2` = amax / 2688);
value = e2m1 * float(e4m3) * global_scale.

The ops (`torch.ops.dsv4.nvfp4_linear`, `nvfp4_linear_w4a4`, `nvfp4_moe`) take weights in the KERNEL layout
produced here once at load time by `repack_weight` (lossless, see docs/ops.md "## NVFP4 GEMM / MoE"):
- K is zero-padded to Kp = ceil(K / 128) * 128 (padded codes and scales are 0).
- Codes: each row's 128-element chunk (64 bytes) is reordered so that mma lane t (0..3) finds its whole
  m16n8k16 A fragment for the 8 k-steps of the chunk in 16 contiguous bytes, and the 8 codes of every 32-bit
  word are bit-shuffled so that one AND (+ one shift) yields two bf16 values (times 2^-126) per register.
- Block scales: uint8 [..., N, Kp/16], same block order as canonical, re-encoded as (e + 10) << 3 | m for
  scale = 2^e * (1 + m/8) (every finite E4M3 value, subnormals included, has this form with e in [-9, 8]);
  0 encodes 0. A negative scale flips the sign of its 16 codes, a zero scale zeroes them, so the
  represented values are unchanged.
- Tiles (layout version 2): within each full tile of 16 rows the bytes are ordered [chunk][row][64 B] (scales
  [chunk][row][8 B]) instead of row by row, so the 16 rows x 64 B one mma tile reads per chunk are one
  contiguous 1 KB (`dsv4_ops/csrc/nvfp4_layout.h`); a last partial tile (N % 16 rows) stays row-major. The
  buffers keep their shapes [..., N, Kp/2] / [..., N, Kp/16]; a row of them is no longer a weight row.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_ops import ops  # the modules below call the dsv4 ops: a stored NVFP4 model needs no converter

from dsv4_model.model.layers import Projection, W4A16Weight

CHUNK = 128  # K granularity of the kernel layout
BLOCK = 16  # NVFP4 block size along K
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
E4M3_MAX = 448.0
SCALE_EXP_BIAS = 10  # scale byte = (e + 10) << 3 | m


def padded_k(k: int) -> int:
    return (k + CHUNK - 1) // CHUNK * CHUNK


# ------------------------------------------------------------------------------------------- codes
def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Canonical packed uint8 [..., K/2] -> int32 codes [..., K] (element order)."""
    p = packed.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int codes [..., K] (0..15) -> canonical packed uint8 [..., K/2]."""
    c = codes.to(torch.int32)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def _codes_to_words(codes: torch.Tensor) -> torch.Tensor:
    """codes int32 [..., N, Kp] -> kernel-layout bytes uint8 [..., N, Kp/2].

    k = 128c + 16s + 8h + 2t + e (k-step s, half h, lane t, e = even/odd) lives in word (c, t, j = s // 2)
    as pair q = 2 * (s % 2) + h; pair q's two codes (e = 0 low half, e = 1 high half) sit at bits
      q=0: mag 6-8 / sign 15 and mag 22-24 / sign 31   (decode: w & 0x81C081C0)
      q=1: the q=0 positions minus 3                      (decode: (w << 3) & 0x81C081C0)
      q=2: the q=0 positions minus 6                      (decode: (w << 6) & 0x81C081C0)
      q=3: mag bits 0,1 at 10,11 / 26,27, mag bit 2 at 13 / 29, sign at 14 / 30
    so each decoded 16-bit half is the bf16 of (+-e2m1) * 2^-126.
    """
    *lead, n, kp = codes.shape
    c = codes.to(torch.int64).reshape(*lead, n, kp // CHUNK, 4, 2, 2, 4, 2)  # (c, j, s%2, h, t, e)
    c = c.movedim(-2, -5)  # (c, t, j, s%2, h, e)
    c = c.reshape(*lead, n, kp // CHUNK, 4, 4, 4, 2)  # (c, t, j, q, e)
    mag, sgn = c & 7, c >> 3
    lo_m, hi_m = mag[..., 0], mag[..., 1]
    lo_s, hi_s = sgn[..., 0], sgn[..., 1]

    def std(q: int, shift: int) -> torch.Tensor:
        w = (lo_m[..., q] << 6) | (lo_s[..., q] << 15) | (hi_m[..., q] << 22) | (hi_s[..., q] << 31)
        return w >> shift

    w3 = (((lo_m[..., 3] & 3) << 10) | ((lo_m[..., 3] >> 2) << 13) | (lo_s[..., 3] << 14)
          | ((hi_m[..., 3] & 3) << 26) | ((hi_m[..., 3] >> 2) << 29) | (hi_s[..., 3] << 30))
    word = std(0, 0) | std(1, 3) | std(2, 6) | w3  # [..., N, C, t, j]
    byte = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1)  # little endian
    return byte.to(torch.uint8).reshape(*lead, n, kp // 2)


def _words_to_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `_codes_to_words`: kernel-layout uint8 [..., N, Kp/2] -> int32 codes [..., N, Kp]."""
    *lead, n, kp2 = packed.shape
    kp = kp2 * 2
    b = packed.to(torch.int64).reshape(*lead, n, kp // CHUNK, 4, 4, 4)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [..., N, C, t, j]

    def code(mag, sgn):
        return mag | (sgn << 3)

    pairs = []
    for shift in (0, 3, 6):
        x = w << shift
        pairs.append((code((x >> 6) & 7, (x >> 15) & 1), code((x >> 22) & 7, (x >> 31) & 1)))
    lo3 = code(((w >> 10) & 3) | (((w >> 13) & 1) << 2), (w >> 14) & 1)
    hi3 = code(((w >> 26) & 3) | (((w >> 29) & 1) << 2), (w >> 30) & 1)
    pairs.append((lo3, hi3))
    c = torch.stack([torch.stack(p, dim=-1) for p in pairs], dim=-2)  # (c, t, j, q, e)
    c = c.reshape(*lead, n, kp // CHUNK, 4, 4, 2, 2, 2)  # (c, t, j, s%2, h, e)
    c = c.movedim(-5, -2)  # (c, j, s%2, h, t, e)
    return c.reshape(*lead, n, kp).to(torch.int32)


# ------------------------------------------------------------------------------------------- tiles
TILE = 16  # rows of one mma tile: the unit of the tile-major interleave


def tile_major(x: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """Row-major kernel bytes [..., N, W] -> layout version 2: each full 16-row tile as [chunk][row][chunk_bytes]
    (chunk_bytes = 64 for codes, 8 for scale bytes); a last partial tile stays row-major."""
    *lead, n, w = x.shape
    nf = n // TILE * TILE
    full = x[..., :nf, :].reshape(*lead, nf // TILE, TILE, w // chunk_bytes, chunk_bytes).transpose(-3, -2)
    return torch.cat((full.reshape(*lead, nf, w), x[..., nf:, :]), dim=-2)


def row_major(x: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """Inverse of `tile_major`."""
    *lead, n, w = x.shape
    nf = n // TILE * TILE
    full = x[..., :nf, :].reshape(*lead, nf // TILE, w // chunk_bytes, TILE, chunk_bytes).transpose(-3, -2)
    return torch.cat((full.reshape(*lead, nf, w), x[..., nf:, :]), dim=-2)


CODE_CHUNK_BYTES, SCALE_CHUNK_BYTES = CHUNK // 2, CHUNK // BLOCK


# ------------------------------------------------------------------------------------------- scales
def encode_scale(s: torch.Tensor) -> torch.Tensor:
    """Non-negative E4M3-representable fp32 values -> kernel scale bytes ((e + 10) << 3 | m; 0 -> 0)."""
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    e = exp.to(torch.int32) - 1
    m = ((mant * 2 - 1) * 8).round().to(torch.int32)
    byte = ((e + SCALE_EXP_BIAS) << 3) | m
    return torch.where(s > 0, byte, torch.zeros_like(byte)).to(torch.uint8)


def decode_scale(b: torch.Tensor) -> torch.Tensor:
    """Kernel scale bytes -> fp32 scale values."""
    b = b.to(torch.int32)
    v = torch.ldexp(1.0 + (b & 7).float() / 8.0, ((b >> 3) - SCALE_EXP_BIAS).float())
    return torch.where(b == 0, torch.zeros_like(v), v)


# ------------------------------------------------------------------------------------------- repack
def repack_weight(packed: torch.Tensor, block_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical NVFP4 (packed uint8 [..., N, K/2], e4m3 scales [..., N, K/16]) -> kernel layout
    (packed uint8 [..., N, Kp/2], scale bytes uint8 [..., N, Kp/16]). Lossless; load time only (host syncs
    on the validity check)."""
    k = packed.shape[-1] * 2
    if k % BLOCK != 0 or block_scale.shape[-1] * BLOCK != k or block_scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"nvfp4 repack: packed {tuple(packed.shape)} / scale {tuple(block_scale.shape)} mismatch")
    if packed.dtype != torch.uint8:
        raise ValueError(f"nvfp4 repack: packed must be uint8, got {packed.dtype}")
    s = block_scale.float()
    if not bool(torch.isfinite(s).all()) or bool((s.abs() > E4M3_MAX).any()):
        raise ValueError("nvfp4 repack: block scales must be finite E4M3 values")
    codes = unpack_codes(packed).unflatten(-1, (-1, BLOCK))
    neg = (s < 0).unsqueeze(-1)
    codes = torch.where(neg, codes ^ 8, codes)
    codes = torch.where((s == 0).unsqueeze(-1), torch.zeros_like(codes), codes).flatten(-2)
    s = s.abs()
    kp = padded_k(k)
    if kp != k:
        codes = torch.nn.functional.pad(codes, (0, kp - k))
        s = torch.nn.functional.pad(s, (0, (kp - k) // BLOCK))
    return tile_major(_codes_to_words(codes), CODE_CHUNK_BYTES), tile_major(encode_scale(s), SCALE_CHUNK_BYTES)


def unrepack_weight(packed_k: torch.Tensor, scale_k: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel layout -> canonical (packed uint8 [..., N, K/2], e4m3 scales [..., N, K/16]) for the first k
    elements (negative/zero scales come back normalized: |scale| with flipped/zeroed codes)."""
    codes = _words_to_codes(row_major(packed_k, CODE_CHUNK_BYTES))[..., :k]
    s = decode_scale(row_major(scale_k, SCALE_CHUNK_BYTES))[..., : k // BLOCK]
    return pack_codes(codes), s.to(torch.float8_e4m3fn)


def dequantize_kernel_layout(packed_k: torch.Tensor, scale_k: torch.Tensor, global_scale: torch.Tensor,
                             k: int) -> torch.Tensor:
    """fp32 [..., N, k] weights of a kernel-layout NVFP4 tensor (value = e2m1 * scale * global_scale)."""
    codes = _words_to_codes(row_major(packed_k, CODE_CHUNK_BYTES))[..., :k]
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    v = lut[codes & 7]
    v = torch.where(codes >= 8, -v, v)
    gs = global_scale.float()
    s = decode_scale(row_major(scale_k, SCALE_CHUNK_BYTES))[..., : k // BLOCK]
    s = s * gs.reshape(gs.shape + (1,) * (v.dim() - gs.dim()))
    return (v.unflatten(-1, (-1, BLOCK)) * s.unsqueeze(-1)).flatten(-2)  # e2m1 * (scale * gs)


# ------------------------------------------------------------------------------------------- MoE rows
def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I, X] with gate rows 0..I-1 then up rows I..2I-1 -> the kernel's row order: groups of 16 rows
    = 8 gate rows then the 8 matching up rows (so one mma tile holds both halves of 8 SwiGLU outputs)."""
    two_i = t.shape[-2]
    if two_i % 16 != 0:
        raise ValueError(f"gate/up interleave needs the intermediate size to be a multiple of 8, got {two_i // 2}")
    g, u = t.unflatten(-2, (2, two_i // 16, 8)).unbind(-4)
    return torch.stack((g, u), dim=-3).flatten(-4, -2)


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave_gate_up`."""
    two_i = t.shape[-2]
    x = t.unflatten(-2, (two_i // 16, 2, 8))
    return torch.cat((x.select(-3, 0).flatten(-3, -2), x.select(-3, 1).flatten(-3, -2)), dim=-2)


# ------------------------------------------------------------------------------------------- bf16 -> NVFP4
def quantize_weight(w: torch.Tensor, global_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-training NVFP4 quantization of w [..., N, K] (K % 16 == 0) with NVIDIA ModelOpt's bytes
    (`NVFP4QTensor.quantize`): global scale amax / 2688 per matrix unless given (fp32 [...]), block scale
    e4m3(max(blk_amax / (6 * gs), 2^-9)) (an all-zero block: 1), codes = E2M1 round-to-nearest-even of
    w / (block scale * gs), a DIVISION (the activation quantizer dsv4::nvfp4_quantize multiplies by the rounded
    reciprocal, as TensorRT-LLM does; the two differ on values that scale onto an E2M1 midpoint), sign bit from
    w < 0. An all-zero matrix gets zero codes, scales and global scale.

    Returns CANONICAL (packed uint8 [..., N, K/2], block scales e4m3 [..., N, K/16], global scale fp32
    [...] in the dequant direction)."""
    if w.dim() < 2 or w.shape[-1] % BLOCK != 0:
        raise ValueError(f"quantize_weight: need [..., N, K] with K % 16 == 0, got {tuple(w.shape)}")
    x = w.float()
    gs = x.abs().amax(dim=(-2, -1)) / (FP4_MAX * E4M3_MAX) if global_scale is None else global_scale.float()
    gs_b = gs[..., None, None]
    blocks = x.unflatten(-1, (-1, BLOCK))
    scale = blocks.abs().amax(dim=-1) / (FP4_MAX * gs_b)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).clamp(min=2.0**-9).to(torch.float8_e4m3fn)
    live = gs_b > 0
    scale = torch.where(live, scale.float(), torch.zeros_like(gs_b)).to(torch.float8_e4m3fn)
    y = torch.where(live[..., None], blocks / (scale.float() * gs_b)[..., None], torch.zeros_like(blocks))
    a = y.abs()
    # E2M1 magnitude code, ties to even: the midpoints 0.75, 1.75, 3.5 round up, 0.25, 1.25, 2.5, 5 down
    mag = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
           + (a >= 3.5).int() + (a > 5.0).int())
    codes = (mag | ((y < 0).int() << 3)).flatten(-2)
    return pack_codes(codes), scale, gs


# ------------------------------------------------------------------------------------------- modules
ACT_QUANT_MODES = ("none", "nvfp4")


def _check_act_quant(act_quant: str) -> bool:
    """act_quant -> whether activations are quantized (W4A4)."""
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")
    return act_quant == "nvfp4"


def w4a4_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """fp32 x @ W^T with x quantized to NVFP4 per row (each token's own global scale, so a row's result does not
    depend on the other rows of its batch), the row's global scale applied after the fp32 GEMM."""
    xp, xs, xg = ops.fused_amax_quantize_per_row(x)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = ops.nvfp4_linear_w4a4(xp, xs, one, w_packed=packed, w_scale=scale, w_global_scale=gs, out_dtype=torch.float32)
    return y * xg.unsqueeze(-1)


class Nvfp4Linear(Projection):
    """y = x @ W^T with an NVFP4 weight (kernel layout buffers), returned in `out_dtype`. act_quant "none": bf16
    activations (W4A16, the fast Hopper path); "nvfp4": activations quantized to NVFP4 per row (W4A4, the
    numerics of a Blackwell NVFP4 GEMM)."""

    def __init__(self, in_features: int, out_features: int, out_dtype: torch.dtype = torch.bfloat16,
                 act_quant: str = "none", device=None):
        super().__init__()
        if in_features % BLOCK != 0:
            raise ValueError(f"Nvfp4Linear: in_features must be a multiple of 16, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype, self.w4a4 = out_dtype, _check_act_quant(act_quant)
        kp = padded_k(in_features)
        self.register_buffer("weight_packed", torch.zeros(out_features, kp // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, kp // BLOCK, dtype=torch.uint8, device=device))
        self.register_buffer("weight_global_scale", torch.zeros((), dtype=torch.float32, device=device))

    @classmethod
    def from_nvfp4(cls, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                   act_quant: str = "none", out_dtype: torch.dtype = torch.bfloat16) -> "Nvfp4Linear":
        """From a canonical (ModelOpt) NVFP4 weight [N, K/2] / [N, K/16] / 0-d."""
        mod = cls(packed.shape[-1] * 2, packed.shape[-2], out_dtype, act_quant, device=packed.device)
        mod.weight_packed, mod.weight_scale = repack_weight(packed, block_scale)
        mod.weight_global_scale = global_scale.detach().to(torch.float32).reshape(())
        return mod

    @classmethod
    def from_float(cls, weight: torch.Tensor, act_quant: str = "none",
                   out_dtype: torch.dtype = torch.bfloat16) -> "Nvfp4Linear":
        """Quantize a float weight [N, K] (post-training, per-tensor amax)."""
        return cls.from_nvfp4(*quantize_weight(weight), act_quant=act_quant, out_dtype=out_dtype)

    def load_nvfp4_(self, t) -> None:
        """Fill from a canonical NVFP4 tensor t (.packed [N, K/2], .scale [N, K/16], .global_scale 0-d)."""
        dev = self.weight_packed.device
        p, s = repack_weight(t.packed.to(dev), t.scale.to(dev))
        self.weight_packed.copy_(p)
        self.weight_scale.copy_(s)
        self.weight_global_scale.copy_(t.global_scale.reshape(()))

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_kernel_layout(self.weight_packed, self.weight_scale, self.weight_global_scale,
                                        self.in_features)

    def w4a16(self) -> W4A16Weight | None:
        if self.w4a4:
            return None
        return W4A16Weight(self.weight_packed, self.weight_scale, self.weight_global_scale, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w4a4:
            y = w4a4_rows(x, self.weight_packed, self.weight_scale, self.weight_global_scale)
        else:
            y = ops.nvfp4_linear(x.to(torch.bfloat16), w_packed=self.weight_packed, w_scale=self.weight_scale,
                                 w_global_scale=self.weight_global_scale)
        return y.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, w4a4={self.w4a4}"


class Nvfp4MoE(nn.Module):
    """Routed SwiGLU experts (+ optional shared expert) with NVFP4 weights, one dsv4::nvfp4_moe call.

    forward(x [T, d], topk_ids [T, k], topk_weights fp32 [T, k]) -> out_dtype [T, d]
      = sum_j w_j * expert_{id_j}(x) (+ shared(x)), DeepSeek-V4 clamped SwiGLU (gate <= limit, |up| <= limit),
    routing weight applied to h before w2 (see docs/ops.md). Buffers in the kernel layout; w13 rows gate/up
    interleaved by 8 (`interleave_gate_up`); one global scale per expert shared by w1 and w3 (ModelOpt).
    act_quant "nvfp4" (W4A4): the expert input is quantized to NVFP4 per row (and dequantized to bf16)."""

    def __init__(self, n_experts: int, dim: int, inter: int, shared_inter: int = 0, swiglu_limit: float = 10.0,
                 out_dtype: torch.dtype = torch.bfloat16, act_quant: str = "none", device=None):
        super().__init__()
        if dim % BLOCK or inter % 8 or inter % BLOCK or shared_inter % BLOCK:
            raise ValueError(f"Nvfp4MoE: dim/inter must be multiples of 16, got {dim}, {inter}, {shared_inter}")
        self.n_experts, self.dim, self.inter, self.shared_inter = n_experts, dim, inter, shared_inter
        self.swiglu_limit = float(swiglu_limit)
        self.out_dtype, self.w4a4 = out_dtype, _check_act_quant(act_quant)
        kd, ki = padded_k(dim), padded_k(inter)
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("w13_packed", torch.zeros(n_experts, 2 * inter, kd // 2, **u8))
        self.register_buffer("w13_scale", torch.zeros(n_experts, 2 * inter, kd // BLOCK, **u8))
        self.register_buffer("w13_global_scale", torch.zeros(n_experts, dtype=torch.float32, device=device))
        self.register_buffer("w2_packed", torch.zeros(n_experts, dim, ki // 2, **u8))
        self.register_buffer("w2_scale", torch.zeros(n_experts, dim, ki // BLOCK, **u8))
        self.register_buffer("w2_global_scale", torch.zeros(n_experts, dtype=torch.float32, device=device))
        if shared_inter:
            ks = padded_k(shared_inter)
            self.register_buffer("shared_w13_packed", torch.zeros(2 * shared_inter, kd // 2, **u8))
            self.register_buffer("shared_w13_scale", torch.zeros(2 * shared_inter, kd // BLOCK, **u8))
            self.register_buffer("shared_w13_global_scale", torch.zeros((), dtype=torch.float32, device=device))
            self.register_buffer("shared_w2_packed", torch.zeros(dim, ks // 2, **u8))
            self.register_buffer("shared_w2_scale", torch.zeros(dim, ks // BLOCK, **u8))
            self.register_buffer("shared_w2_global_scale", torch.zeros((), dtype=torch.float32, device=device))

    @staticmethod
    def _kernel_w13(packed, scale):
        return repack_weight(interleave_gate_up(packed), interleave_gate_up(scale))

    @classmethod
    def from_nvfp4(cls, w13: tuple, w2: tuple, shared: tuple | None = None, swiglu_limit: float = 10.0) -> "Nvfp4MoE":
        """From canonical NVFP4 tensors: w13 = (packed [E, 2I, d/2] gate rows first, e4m3 [E, 2I, d/16], gs [E]),
        w2 = (packed [E, d, I/2], e4m3 [E, d, I/16], gs [E]); shared = (w13 triple, w2 triple) without the E
        dim (0-d global scales) or None."""
        E, two_i, d2 = w13[0].shape
        s_inter = shared[0][0].shape[0] // 2 if shared is not None else 0
        mod = cls(E, d2 * 2, two_i // 2, s_inter, swiglu_limit, device=w13[0].device)
        mod.w13_packed, mod.w13_scale = cls._kernel_w13(w13[0], w13[1])
        mod.w13_global_scale = w13[2].detach().float().reshape(E)
        mod.w2_packed, mod.w2_scale = repack_weight(w2[0], w2[1])
        mod.w2_global_scale = w2[2].detach().float().reshape(E)
        if shared is not None:
            (sp13, ss13, sg13), (sp2, ss2, sg2) = shared
            mod.shared_w13_packed, mod.shared_w13_scale = cls._kernel_w13(sp13, ss13)
            mod.shared_w13_global_scale = sg13.detach().float().reshape(())
            mod.shared_w2_packed, mod.shared_w2_scale = repack_weight(sp2, ss2)
            mod.shared_w2_global_scale = sg2.detach().float().reshape(())
        return mod

    @classmethod
    def from_float(cls, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, shared: tuple | None = None,
                   swiglu_limit: float = 10.0) -> "Nvfp4MoE":
        """Quantize stacked float experts w1/w3 [E, I, d], w2 [E, d, I] (+ shared (w1 [Is, d], w2 [d, Is],
        w3 [Is, d])): per-expert amax global scale, shared by w1 and w3."""
        q13 = quantize_weight(torch.cat((w1, w3), dim=-2))
        q2 = quantize_weight(w2)
        qs = None
        if shared is not None:
            s1, s2, s3 = shared
            qs = (quantize_weight(torch.cat((s1, s3), dim=-2)), quantize_weight(s2))
        return cls.from_nvfp4(q13, q2, qs, swiglu_limit)

    def _weights(self) -> dict:
        shared = self.shared_inter > 0
        return dict(w13=(self.w13_packed, self.w13_scale, self.w13_global_scale),
                    w2=(self.w2_packed, self.w2_scale, self.w2_global_scale),
                    shared_w13=(self.shared_w13_packed, self.shared_w13_scale, self.shared_w13_global_scale)
                    if shared else None,
                    shared_w2=(self.shared_w2_packed, self.shared_w2_scale, self.shared_w2_global_scale)
                    if shared else None,
                    swiglu_limit=self.swiglu_limit)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.w4a4:
            xp, xs, xg = ops.fused_amax_quantize_per_row(x)
            x = ops.nvfp4_dequantize(xp, xs, xg, dtype=torch.bfloat16)
        return x.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        y = ops.nvfp4_moe(self._act(x), topk_ids, topk_weights.float(), **self._weights())
        return y.to(self.out_dtype)

    def rows(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """forward's expert rows before the combine (dsv4::nvfp4_moe_rows): bf16 [T*k (+ T), d]."""
        return ops.nvfp4_moe_rows(self._act(x), topk_ids, topk_weights.float(), **self._weights())

    def narrow_experts_(self, start: int, count: int) -> None:
        """Keep routed experts [start, start + count) only (expert parallelism); the shared expert stays."""
        for name in ("w13_packed", "w13_scale", "w13_global_scale", "w2_packed", "w2_scale", "w2_global_scale"):
            setattr(self, name, getattr(self, name)[start:start + count].clone())
        self.n_experts = count

    def load_expert_(self, e: int, w13, w2) -> None:
        """Expert e from canonical NVFP4 tensors w13 = [gate; up] [2I, d/2] (one global scale) and w2 [d, I/2]
        (each with .packed, .scale, .global_scale)."""
        dev = self.w13_packed.device
        p, s = self._kernel_w13(w13.packed.to(dev), w13.scale.to(dev))
        self.w13_packed[e].copy_(p)
        self.w13_scale[e].copy_(s)
        self.w13_global_scale[e].copy_(w13.global_scale.reshape(()))
        p, s = repack_weight(w2.packed.to(dev), w2.scale.to(dev))
        self.w2_packed[e].copy_(p)
        self.w2_scale[e].copy_(s)
        self.w2_global_scale[e].copy_(w2.global_scale.reshape(()))

    def load_shared_(self, w13, w2) -> None:
        dev = self.w13_packed.device
        p, s = self._kernel_w13(w13.packed.to(dev), w13.scale.to(dev))
        self.shared_w13_packed.copy_(p)
        self.shared_w13_scale.copy_(s)
        self.shared_w13_global_scale.copy_(w13.global_scale.reshape(()))
        p, s = repack_weight(w2.packed.to(dev), w2.scale.to(dev))
        self.shared_w2_packed.copy_(p)
        self.shared_w2_scale.copy_(s)
        self.shared_w2_global_scale.copy_(w2.global_scale.reshape(()))

    def dequantized_experts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 stacked (w1 [E, I, d], w2 [E, d, I], w3 [E, I, d])."""
        w13 = deinterleave_gate_up(dequantize_kernel_layout(self.w13_packed, self.w13_scale, self.w13_global_scale,
                                                            self.dim))
        w2 = dequantize_kernel_layout(self.w2_packed, self.w2_scale, self.w2_global_scale, self.inter)
        return w13[:, : self.inter], w2, w13[:, self.inter:]

    def dequantized_shared(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w13 = deinterleave_gate_up(dequantize_kernel_layout(self.shared_w13_packed, self.shared_w13_scale,
                                                            self.shared_w13_global_scale, self.dim))
        w2 = dequantize_kernel_layout(self.shared_w2_packed, self.shared_w2_scale, self.shared_w2_global_scale,
                                      self.shared_inter)
        return w13[: self.shared_inter], w2, w13[self.shared_inter:]

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, dim={self.dim}, inter={self.inter}, shared_inter={self.shared_inter}, "
                f"swiglu_limit={self.swiglu_limit}")

"""NVFP4 weights for the dsv4 GEMM/MoE ops: canonical <-> kernel layout, bf16 -> NVFP4 (the modules holding them:
dsv4_model.quant.nvfp4_modules).

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


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """int E2M1 codes (sign bit 3) -> their fp32 values."""
    v = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes & 7]
    return torch.where(codes >= 8, -v, v)


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
    v = e2m1_values(_words_to_codes(row_major(packed_k, CODE_CHUNK_BYTES))[..., :k])
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
    return pack_codes(_e2m1_round(y).flatten(-2)), scale, gs


MSE_SCALE_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 1.05)  # of amax / 6: the block scales quantize_weight_mse tries


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (sign bit 3) of y, magnitudes round-to-nearest-even and clipped at 6: the midpoints 0.75, 1.75,
    3.5 round up, 0.25, 1.25, 2.5, 5 down."""
    a = y.abs()
    mag = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
           + (a >= 3.5).int() + (a > 5.0).int())
    return mag | ((y < 0).int() << 3)


def quantize_weight_mse(w: torch.Tensor, rows_per_pass: int = 2048
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_weight with each block's scale chosen for the least squared error: ModelOpt's global scale
    (amax / 2688), then per 16-value block the e4m3 scale among MSE_SCALE_FACTORS x blk_amax / (6 gs) whose codes
    dequantize closest to the block (a smaller scale clips the block's largest values to 6 x scale and resolves
    the rest finer). The factor 1 is ModelOpt's scale, so no block's error exceeds quantize_weight's. For weights
    converted here from float (the NVFP4 head, head_quant); checkpoints' NVFP4 bytes are taken as they are.
    w [N, K] (K % 16 == 0), in passes of rows_per_pass rows; returns quantize_weight's canonical triple."""
    if w.dim() != 2 or w.shape[-1] % BLOCK != 0:
        raise ValueError(f"quantize_weight_mse: need [N, K] with K % 16 == 0, got {tuple(w.shape)}")
    gs = w.float().abs().amax() / (FP4_MAX * E4M3_MAX)
    if not bool(gs > 0):
        return quantize_weight(w)
    packed, scales = [], []
    for r0 in range(0, w.shape[0], rows_per_pass):
        blocks = w[r0:r0 + rows_per_pass].float().unflatten(-1, (-1, BLOCK))
        base = blocks.abs().amax(dim=-1) / (FP4_MAX * gs)
        best_err = best_scale = best_codes = None
        for f in MSE_SCALE_FACTORS:
            s = (base * f)
            s = torch.where(s == 0, torch.ones_like(s), s).clamp(min=2.0**-9).to(torch.float8_e4m3fn).float()
            codes = _e2m1_round(blocks / (s * gs)[..., None])
            deq = e2m1_values(codes) * (s * gs)[..., None]
            err = (deq - blocks).square().sum(-1)
            if best_err is None:
                best_err, best_scale, best_codes = err, s, codes
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_scale = torch.where(better, s, best_scale)
                best_codes = torch.where(better[..., None], codes, best_codes)
        packed.append(pack_codes(best_codes.flatten(-2)))
        scales.append(best_scale.to(torch.float8_e4m3fn))
    return torch.cat(packed), torch.cat(scales), gs

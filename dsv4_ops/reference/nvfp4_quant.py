"""NVFP4 quantization references (and the exp / SwiGLU every implementation rounds the same way)."""
import torch


# ======================================================================================================
# NVFP4 quantization: nvfp4_quantize, nvfp4_dequantize, fused_amax_quantize(_per_row),
# fused_deinterleave_amax_quantize. Conventions: docs/ops.md "## NVFP4 quantization".
# Every step is one IEEE fp32 operation (no fused multiply-add), so the C++ and CUDA kernels reproduce
# these tensors bit for bit.
# ======================================================================================================

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_SCALE_DIV = 2688.0  # 448 * 6: global_scale = amax / 2688 (ModelOpt weight_scale_2 / input_scale direction)
_FLT_MAX = float(torch.finfo(torch.float32).max)
# Upper e2m1 magnitude thresholds: code = #(a > t) over the strict ones + #(a >= t) over the others, which is
# round-to-nearest-even onto {0, .5, 1, 1.5, 2, 3, 4, 6} with saturation (ties 0.25 .. 5 go to the even code).
_E2M1_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_INCLUSIVE = (0.75, 1.75, 3.5)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), v, dtype=torch.float32, device=like.device)  # a fill, so CUDA-graph capturable


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    """Sign bit of every element, read from the raw bits (so -0 and NaNs keep theirs): bool."""
    if x.dtype == torch.float32:
        return x.view(torch.int32) < 0
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.view(torch.int16) < 0
    raise TypeError(f"nvfp4: unsupported dtype {x.dtype}")


def e2m1_encode(y: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) of fp32 y, sign bit 0x8 taken from `negative`; NaN magnitudes encode as 6 (7)."""
    a = torch.fmin(y.abs(), _f32(E2M1_MAX, y))  # fmin: NaN -> 6
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _E2M1_STRICT:
        code += (a > t).to(torch.uint8)
    for t in _E2M1_INCLUSIVE:
        code += (a >= t).to(torch.uint8)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of 4-bit codes (uint8); code 0x8 is -0."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def nvfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def nvfp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _nanless_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN read as 0: the kernels' max is fmaxf, which skips NaN."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Dequant-direction global scale amax / 2688 (fp32)."""
    return amax.to(torch.float32) / _f32(NVFP4_SCALE_DIV, amax)


def _quantize_f32(xf: torch.Tensor, negative: torch.Tensor, gs_rows: torch.Tensor):
    """xf fp32 [R, K], gs_rows fp32 [R] (dequant direction) -> packed uint8 [R, K/2], e4m3 [R, K/16]."""
    R, K = xf.shape
    blocks = xf.reshape(R, K // NVFP4_BLOCK, NVFP4_BLOCK)
    vmax = _nanless_abs(blocks).amax(dim=-1)  # [R, K/16]
    gs = gs_rows.to(torch.float32)[:, None]
    # gs_enc = 1/gs, saturated to FLT_MAX; 0 when gs is not > 0 (amax == 0 gives all-zero scales and codes).
    gs_enc = torch.where(gs > 0, torch.fmin(1.0 / gs, _f32(_FLT_MAX, gs)), torch.zeros_like(gs))
    sf = (gs_enc * vmax) / _f32(E2M1_MAX, gs)
    sf = torch.fmin(sf, _f32(E4M3_MAX, gs))  # satfinite; fmin: NaN (0 * inf) -> 448
    sf8 = sf.to(torch.float8_e4m3fn)
    sff = sf8.to(torch.float32)
    inv = torch.fmin(1.0 / (sff * gs), _f32(_FLT_MAX, gs))
    out_scale = torch.where(sff == 0, torch.zeros_like(inv), inv)
    y = blocks * out_scale[..., None]
    codes = e2m1_encode(y.reshape(R, K), negative)
    return nvfp4_pack(codes), sf8


def _rows_of(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, x.shape[-1]), lead


def _gs_per_row(global_scale: torch.Tensor, lead: tuple, R: int) -> torch.Tensor:
    if global_scale.dim() == 0:
        return global_scale.to(torch.float32).expand(R)
    assert tuple(global_scale.shape) == lead, (tuple(global_scale.shape), lead)
    return global_scale.to(torch.float32).reshape(R)


def nvfp4_quantize_ref(x: torch.Tensor, global_scale: torch.Tensor):
    """x [..., K] (bf16/fp16/fp32, K % 16 == 0), global_scale fp32 0-d or x.shape[:-1] (dequant direction)
    -> (packed uint8 [..., K/2], block_scale float8_e4m3fn [..., K/16])."""
    x2, lead = _rows_of(x)
    R, K = x2.shape
    packed, sf8 = _quantize_f32(x2.to(torch.float32), _sign_bits(x2), _gs_per_row(global_scale, lead, R))
    return packed.reshape(*lead, K // 2), sf8.reshape(*lead, K // NVFP4_BLOCK)


def nvfp4_dequantize_ref(packed, block_scale, global_scale, dtype):
    """value = e2m1(code) * (float(block_scale) * global_scale), rounded once to dtype. block_scale may be
    float8_e4m3fn or uint8 holding the same bits."""
    if block_scale.dtype == torch.uint8:
        block_scale = block_scale.view(torch.float8_e4m3fn)
    p2, lead = _rows_of(packed)
    R = p2.shape[0]
    codes = nvfp4_unpack(p2)
    d = block_scale.reshape(R, -1).to(torch.float32) * _gs_per_row(global_scale, lead, R)[:, None]
    vals = e2m1_decode(codes).reshape(R, -1, NVFP4_BLOCK) * d[..., None]
    return vals.reshape(*lead, -1).to(dtype)


def fused_amax_quantize_ref(x: torch.Tensor):
    """Per-tensor dynamic quantization: global_scale = max|x| / 2688 (NaN skipped), then nvfp4_quantize."""
    gs = nvfp4_global_scale(_nanless_abs(x.to(torch.float32)).amax()) if x.numel() else \
        torch.zeros((), dtype=torch.float32, device=x.device)
    packed, sf8 = nvfp4_quantize_ref(x, gs)
    return packed, sf8, gs


def fused_amax_quantize_per_row_ref(x: torch.Tensor):
    """Per-row dynamic quantization: global_scale[r] = max|x[r]| / 2688, shape x.shape[:-1]."""
    x2, lead = _rows_of(x)
    gs = nvfp4_global_scale(_nanless_abs(x2.to(torch.float32)).amax(dim=-1)) if x2.shape[-1] else \
        torch.zeros(x2.shape[0], dtype=torch.float32, device=x.device)
    gs = gs.reshape(lead)
    packed, sf8 = nvfp4_quantize_ref(x, gs)
    return packed, sf8, gs


# exp(t) from IEEE fp32 mul/add only (Cody-Waite reduction + degree-7 Taylor), so every implementation of
# swiglu rounds identically (libm/CUDA/SLEEF exps differ by an ulp). Within ~2 ulp of exp.
_EXP_LOG2E = float.fromhex("0x1.715476p+0")
_EXP_LN2_HI = float.fromhex("0x1.63p-1")  # 9 significant bits: k * LN2_HI is exact
_EXP_LN2_LO = float.fromhex("-0x1.bd0106p-13")
_EXP_ROUND = 12582912.0  # 1.5 * 2^23: (v + R) - R rounds v to an integer, ties to even
_EXP_POLY = tuple(float.fromhex(h) for h in (
    "0x1.a01a02p-13", "0x1.6c16c2p-10", "0x1.111112p-7", "0x1.555556p-5", "0x1.555556p-3", "0x1p-1", "0x1p+0",
    "0x1p+0"))  # 1/7!, 1/6!, ..., 1/2!, 1, 1 (Horner, highest first)
EXP_T_MIN, EXP_T_MAX = -104.0, 89.0


def _pow2(k: torch.Tensor) -> torch.Tensor:
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def exp_portable(t: torch.Tensor) -> torch.Tensor:
    """e^t of fp32 t; t is first clamped to [-104, 89] with fmin/fmax (NaN -> -104 -> 0)."""
    f = lambda v: _f32(v, t)  # noqa: E731
    t = torch.fmin(torch.fmax(t.to(torch.float32), f(EXP_T_MIN)), f(EXP_T_MAX))
    kf = (t * f(_EXP_LOG2E) + f(_EXP_ROUND)) - f(_EXP_ROUND)
    r = (t - kf * f(_EXP_LN2_HI)) - kf * f(_EXP_LN2_LO)
    p = torch.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = p * r + f(c)
    k = kf.to(torch.int32)
    k1 = k >> 1
    return (p * _pow2(k - k1)) * _pow2(k1)


def swiglu_limited_ref(gate_up: torch.Tensor, row_weight, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] with gate_j = gate_up[..., 2j], up_j = gate_up[..., 2j+1] (element-wise pairs)
    -> h fp32 [..., I] = silu(min(gate, limit)) * clamp(up, -limit, limit) [* row_weight[..., None]], with
    silu(g) = g / (1 + exp_portable(-g)). NaN h is made +NaN (its sign would be platform-dependent)."""
    gu = gate_up.to(torch.float32)
    lim = _f32(limit, gu)
    g = torch.clamp(gu[..., 0::2], max=lim)  # clamp keeps NaN
    u = torch.clamp(gu[..., 1::2], min=-lim, max=lim)
    h = (g / (1.0 + exp_portable(-g))) * u
    if row_weight is not None:
        h = h * row_weight.to(torch.float32).reshape(h.shape[:-1])[..., None]
    return torch.where(torch.isnan(h), torch.full_like(h, float("nan")), h)  # +NaN: 0x7FC00000


def fused_deinterleave_amax_quantize_ref(gate_up, row_weight, limit: float, per_row: bool):
    """h = swiglu_limited_ref(...), then fused_amax_quantize(_per_row) of h (fp32)."""
    h = swiglu_limited_ref(gate_up, row_weight, limit)
    return fused_amax_quantize_per_row_ref(h) if per_row else fused_amax_quantize_ref(h)

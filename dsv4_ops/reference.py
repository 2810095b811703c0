"""Pure-PyTorch references of the dsv4 ops, the ground truth of the numerics tests.

One commented section per op family; each is written from the op's documented definition (docs/ops.md),
independently of the C++/CUDA kernels.
"""
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


# ======================================================================================================
# Sampler: dsv4::sample
# ======================================================================================================

_U32 = 0xFFFFFFFF


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * m for uint32 values held in int64 (16-bit limbs avoid int64 overflow)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    m_hi, m_lo = m >> 16, m & 0xFFFF
    mid = (a_hi * m_lo + a_lo * m_hi) * 65536 + a_lo * m_lo  # < 2^50
    return a_hi * m_hi + (mid >> 32), mid & _U32


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 (Salmon et al. 2011). counter [..., 4], key [..., 2]: uint32 values in int64 tensors."""
    c = [counter[..., i].to(torch.int64) for i in range(4)]
    k0, k1 = key[..., 0].to(torch.int64), key[..., 1].to(torch.int64)
    for _ in range(10):
        hi0, lo0 = _mulhilo32(c[0], 0xD2511F53)
        hi1, lo1 = _mulhilo32(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + 0x9E3779B9) & _U32
        k1 = (k1 + 0xBB67AE85) & _U32
    return torch.stack(c, dim=-1)


def sample_uniform_words(seed: torch.Tensor, offset: torch.Tensor, V: int) -> torch.Tensor:
    """The random word of every (row, element): int64 [B, V] in [0, 2^32).

    Element i of a row uses word i % 4 of Philox(counter = (i // 4 as 64 bit, offset as 64 bit), key = seed).
    """
    B = seed.shape[0]
    groups = torch.arange((V + 3) // 4, dtype=torch.int64, device=seed.device)
    s = seed.to(torch.int64)[:, None].expand(B, groups.numel())
    o = offset.to(torch.int64)[:, None].expand(B, groups.numel())
    g = groups[None, :].expand(B, -1)
    counter = torch.stack([g & _U32, (g >> 32) & _U32, o & _U32, (o >> 32) & _U32], dim=-1)
    key = torch.stack([s & _U32, (s >> 32) & _U32], dim=-1)
    return philox4x32_10(counter, key).reshape(B, -1)[:, :V]


def gumbel_from_words(words: torch.Tensor) -> torch.Tensor:
    """Gumbel(0,1) in fp32: v = ((w >> 9) + 0.5) * 2^-23, g = -log(-log1p(-v))."""
    v = ((words >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log1p(-v))


def sample_probs_reference(logits, temperature, top_k, top_p) -> torch.Tensor:
    """The exact distribution dsv4::sample draws from, float64 [B, V] (rows sum to 1).

    temperature <= 0: one-hot at the first argmax. Otherwise softmax(logits / T) restricted to
    - top-k (k > 0 and k < V): tokens whose logit >= the k-th largest logit (ties at the boundary kept);
    - then top-p (p < 1): among those, token i is kept iff the renormalized mass of tokens with a strictly
      larger logit is < p (so the most likely token always stays; ties at the boundary kept),
    renormalized. (The kernels evaluate the top-p mass in 2^-40 fixed point, so tokens within ~2^-40 of the
    boundary may be decided differently.)
    """
    lg = torch.nan_to_num(logits.double(), nan=float("-inf"))
    B, V = lg.shape
    out = torch.zeros_like(lg)
    for b in range(B):
        row = lg[b]
        t = float(temperature[b])
        if not t > 0:
            out[b, int(torch.argmax(row))] = 1.0
            continue
        keep = torch.ones(V, dtype=torch.bool, device=lg.device)
        k = int(top_k[b])
        if 0 < k < V:
            kth = torch.topk(row, k).values[-1]
            keep &= row >= kth
        p = torch.softmax(torch.where(keep, row / t, float("-inf")), dim=0)
        tp = float(top_p[b])
        if tp < 1.0:
            above = (p[None, :] * (row[None, :] > row[:, None])).sum(dim=1)  # O(V^2): small V only
            top_mask = (above < tp) | (row == row.max())
            keep &= top_mask
            p = torch.where(keep, p, 0.0)
            p = p / p.sum()
        out[b] = p
    return out


def sample_reference(logits, temperature, top_k, top_p, seed, offset) -> torch.Tensor:
    """dsv4::sample in plain torch: Gumbel-max over the kept set of `sample_probs_reference`, int64 [B]."""
    lg = torch.nan_to_num(logits.float(), nan=float("-inf"))
    probs = sample_probs_reference(logits, temperature, top_k, top_p)
    keys = lg / temperature.float().clamp_min(1e-30)[:, None] + gumbel_from_words(
        sample_uniform_words(seed, offset, lg.shape[1])
    )
    keys = torch.where(probs > 0, keys, float("-inf"))
    greedy = ~(temperature > 0)
    return torch.where(greedy, torch.argmax(lg, dim=1), torch.argmax(keys, dim=1))


# ======================================================================================================
# Lightning indexer: dsv4::indexer_score_topk and the FP4 storage of indexer keys
# ======================================================================================================
# Key storage (DeepSeek-V4 indexer cache, "use_fp4_indexer_cache"): a key of D elements is D/2 bytes of E2M1
# codes (element 2j in the low nibble of byte j, 2j+1 in the high nibble; bit 3 = sign, bits 0-2 index
# _INDEXER_E2M1) plus D/32 uint8 UE8M0 exponents e: block j of 32 elements is scaled by 2^(e-127).

_INDEXER_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_INDEXER_BLOCK = 32


def _indexer_pow2_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """2^(e-127) as float32 for uint8-valued e, built from the bit pattern (e=0 is the subnormal 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def indexer_fp4_quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 (E2M1) keys with power-of-two block-32 scales, as DeepSeek's fp4_act_quant(scale_dtype=e8m0) computes them.

    Per block of 32: amax = max|x| (fp32) clamped below at 6*2^-126; scale = 2^ceil(log2(amax * fp32(1/6))), the
    ceil taken from the fp32 bits (exponent, +1 if any mantissa bit is set), exactly like the official
    fast_round_scale; value = clamp(x / scale, -6, 6) rounded to E2M1 with round-half-to-even. Zero is always
    encoded as +0 (code 0). Inputs must be finite.

    k: [..., D] float (D % 32 == 0). Returns (codes uint8 [..., D/2], exponents uint8 [..., D/32]).
    """
    D = k.shape[-1]
    assert D % _INDEXER_BLOCK == 0, f"indexer keys need D % 32 == 0, got {D}"
    x = k.float().unflatten(-1, (D // _INDEXER_BLOCK, _INDEXER_BLOCK))
    amax = x.abs().amax(-1).clamp_min(6 * 2.0**-126)
    r = amax * (1.0 / 6.0)  # fp32 product (no host->device tensor: usable inside CUDA-graph capture)
    bits = r.view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # biased exponent of the scale
    scale = _indexer_pow2_from_exponent(e)
    y = (x / scale.unsqueeze(-1)).clamp(-6.0, 6.0)
    a = y.abs()
    # E2M1 round-half-to-even: a tie goes to the even code, hence '>' / '>=' alternating with the code parity.
    mag = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
           + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    code = mag | (((y < 0) & (mag > 0)).int() << 3)
    code = code.flatten(-2)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, e.to(torch.uint8)


def indexer_fp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of the key storage: codes uint8 [..., D/2], exponents uint8 [..., D/32] -> [..., D] of `dtype`."""
    c = codes.to(torch.int32)
    nib = torch.stack((c & 0xF, c >> 4), dim=-1).flatten(-2)  # [..., D], element order 0, 1, 2, ...
    m = nib & 7  # E2M1 magnitude from its bits (no host->device LUT: usable inside CUDA-graph capture)
    val = torch.where(m < 2, m.float() * 0.5, torch.exp2((m >> 1).float() - 1.0) * (1.0 + 0.5 * (m & 1).float()))
    val = torch.where((nib & 8) != 0, -val, val)
    s = _indexer_pow2_from_exponent(scales)
    val = (val.unflatten(-1, (-1, _INDEXER_BLOCK)) * s.unsqueeze(-1)).flatten(-2)
    return val.to(dtype)


def indexer_scores_reference(q, weights, k_codes, k_scales) -> torch.Tensor:
    """fp32 [B, N]: sum_h weights[b,h] * relu(q[b,h,:] . k[b,i,:]) for every key (no n_valid mask)."""
    k = indexer_fp4_dequantize(k_codes, k_scales)
    logits = torch.einsum("bhd,bnd->bhn", q.float(), k)
    scores = (logits.clamp_min(0.0) * weights.float().unsqueeze(-1)).sum(1)
    return scores + 0.0  # -0.0 -> +0.0: the sign of a zero never breaks a tie


def indexer_topk_from_scores(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [B, topk]: indices i < n_valid[b] by (score desc, index asc), then -1 padding."""
    B, N = scores.shape
    nv = n_valid.to(device=scores.device, dtype=torch.int64).clamp(0, N)
    idx = torch.arange(N, device=scores.device)
    masked = torch.where(idx[None, :] < nv[:, None], scores.float(), float("-inf"))
    # Stable descending sort keeps equal scores in index order; masked entries come last, also in index order.
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :topk]
    out = torch.full((B, topk), -1, dtype=torch.int64, device=scores.device)
    out[:, : order.shape[1]] = order
    rank = torch.arange(topk, device=scores.device)
    out = torch.where(rank[None, :] < nv[:, None], out, -1)
    return out.to(torch.int32)


def indexer_score_topk_reference(q, weights, k_codes, k_scales, n_valid, topk: int, weights_scale: float = 1.0,
                                 weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference of dsv4::indexer_score_topk (see docs/ops.md "## Indexer"). The head weights used are
    float(weights.to(weights_dtype)) * weights_scale, one fp32 multiply (the scalar rounded to fp32 first)."""
    assert weights_dtype in (None, torch.bfloat16, torch.float16), weights_dtype
    w = weights.float() if weights_dtype is None else weights.float().to(weights_dtype).float()
    w = w * weights_scale
    return indexer_topk_from_scores(indexer_scores_reference(q, w, k_codes, k_scales), n_valid, topk)


# ======================================================================================================
# NVFP4 GEMM / MoE: dsv4::nvfp4_linear, nvfp4_linear_w4a4, nvfp4_moe, nvfp4_moe_rows
# ======================================================================================================
# These take the CANONICAL NVFP4 layout (ModelOpt): codes uint8 [..., N, K/2] (element 2i in the low nibble),
# float8_e4m3fn block scales [..., N, K/16], fp32 dequant-direction global scale; value = e2m1 * scale * gs.
# The ops take the kernel layout of dsv4_model.nvfp4.repack_weight; tests feed both from the same tensors.

def nvfp4_gemm_dequant_ref(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] weights via nvfp4_dequantize_ref; global_scale 0-d, or one per matrix (e.g. [E] for
    stacked [E, N, K/2])."""
    gs = global_scale.to(torch.float32)
    if gs.dim() > 0:
        gs = gs.reshape(gs.shape + (1,) * (packed.dim() - 1 - gs.dim())).expand(packed.shape[:-1])
    return nvfp4_dequantize_ref(packed, block_scale, gs, torch.float32)


def nvfp4_linear_ref(x, w_packed, w_scale, w_global_scale) -> torch.Tensor:
    """W4A16: bf16(x.float() @ W^T), fp32 accumulation."""
    w = nvfp4_gemm_dequant_ref(w_packed, w_scale, w_global_scale)
    return (x.float() @ w.t()).to(torch.bfloat16)


def nvfp4_linear_grouped_ref(x, w_packed, w_scale, w_global_scale) -> torch.Tensor:
    """x [..., G, K], G stacked matrices, global scales [G]: out[..., g, :] = nvfp4_linear_ref(x[..., g, :], W_g)."""
    return torch.stack([nvfp4_linear_ref(x[..., g, :], w_packed[g], w_scale[g], w_global_scale[g])
                        for g in range(x.shape[-2])], dim=-2)


def nvfp4_linear_multi_ref(x, w_packed, w_scale, w_global_scale) -> list[torch.Tensor]:
    """One input, several matrices: [nvfp4_linear_ref(x, W_i) for each i]."""
    return [nvfp4_linear_ref(x, w, s, g) for w, s, g in zip(w_packed, w_scale, w_global_scale)]


def nvfp4_linear_w4a4_ref(x_packed, x_scale, x_global_scale, w_packed, w_scale, w_global_scale,
                          out_dtype=torch.bfloat16) -> torch.Tensor:
    """W4A4 (Blackwell NVFP4 GEMM numerics): both operands dequantized exactly, fp32 accumulation."""
    xd = nvfp4_gemm_dequant_ref(x_packed, x_scale, x_global_scale)
    w = nvfp4_gemm_dequant_ref(w_packed, w_scale, w_global_scale)
    return (xd @ w.t()).to(out_dtype)


def _moe_expert_ref(x, w13, w2, route, limit):
    """bf16(W2 . bf16(swiglu(bf16(Wg x), bf16(Wu x)) [* route])); w13 fp32 [2I, d] = [gate; up], w2 fp32 [d, I]."""
    gate_w, up_w = w13.chunk(2, dim=0)
    g = (x.float() @ gate_w.t()).to(torch.bfloat16).float()
    u = (x.float() @ up_w.t()).to(torch.bfloat16).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = torch.nn.functional.silu(g) * u
    if route is not None:
        h = h * route[:, None]
    return (h.to(torch.bfloat16).float() @ w2.t()).to(torch.bfloat16)


def nvfp4_moe_rows_ref(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, shared=None,
                       swiglu_limit=10.0) -> torch.Tensor:
    """dsv4::nvfp4_moe_rows: each assignment's expert output (bf16) before the combine, [T*k + T*has_shared, d].
    Row t*k + j = o[t, j] = the output of expert topk_ids[t, j] for token t, routing weight applied (zeros where the
    id is outside [0, E)); row T*k + t = the shared expert's output for token t. Arguments as nvfp4_moe_ref."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    ids = topk_ids.long()
    outs = torch.zeros(T, k, x.shape[1], dtype=torch.bfloat16, device=x.device)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < E:
            continue
        t_idx, j_idx = torch.where(ids == e)
        w13_e = nvfp4_gemm_dequant_ref(w13[e], w13_scale[e], w13_gs[e])
        w2_e = nvfp4_gemm_dequant_ref(w2[e], w2_scale[e], w2_gs[e])
        outs[t_idx, j_idx] = _moe_expert_ref(x[t_idx], w13_e, w2_e, topk_weights[t_idx, j_idx].float(), swiglu_limit)
    rows = [outs.reshape(T * k, x.shape[1])]
    if shared is not None:
        sw13, ss13, sg13, sw2, ss2, sg2 = shared
        rows.append(_moe_expert_ref(x, nvfp4_gemm_dequant_ref(sw13, ss13, sg13),
                                    nvfp4_gemm_dequant_ref(sw2, ss2, sg2), None, swiglu_limit))
    return torch.cat(rows)


def moe_combine_rows_ref(rows: torch.Tensor, ids: torch.Tensor, n_experts: int, has_shared: bool) -> torch.Tensor:
    """The MoE combine of nvfp4_moe_rows' layout: [T, d] in rows' dtype (the op's: bf16) = the fp32 sum_j
    fp32(rows[t*k + j]) over the slots with 0 <= ids[t, j] < n_experts, in j order, then + fp32(rows[T*k + t]) when
    has_shared, rounded once; ids [T, k]. The values in rows of other ids do not matter (the CUDA op leaves them
    unwritten: NaN / Inf garbage is masked out)."""
    T, k = ids.shape
    d = rows.shape[-1]
    assert rows.shape == (T * k + (T if has_shared else 0), d), (tuple(rows.shape), T, k, has_shared)
    local = (ids >= 0) & (ids < n_experts)
    routed = rows[:T * k].reshape(T, k, d).float()
    acc = torch.zeros(T, d, dtype=torch.float32, device=rows.device)
    for j in range(k):
        # a skipped slot adds +0: the running sum starts at +0 and is never -0, so no bit changes
        acc = acc + torch.where(local[:, j, None], routed[:, j], 0.0)
    if has_shared:
        acc = acc + rows[T * k:].float()
    return acc.to(rows.dtype)


def nvfp4_moe_ref(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, shared=None,
                  swiglu_limit=10.0) -> torch.Tensor:
    """Routed (+ shared) SwiGLU experts, DeepSeek-V4 order. x bf16 [T, d]; w13 canonical [E, 2I, d/2] with the
    gate rows first; shared = (w13 [2Is, d/2], s13, gs13, w2 [d, Is/2], s2, gs2) or None.
    y = bf16(sum_j fp32(o[t, j]) + fp32(o_shared[t])) summed in slot order, o = the expert's bf16 output;
    assignments whose expert id is outside [0, E) contribute 0."""
    rows = nvfp4_moe_rows_ref(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, shared,
                              swiglu_limit)
    return moe_combine_rows_ref(rows, topk_ids, w13.shape[0], shared is not None)


# ======================================================================================================
# mHC: dsv4::hc_sinkhorn
# ======================================================================================================

def hc_sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits fp32 [..., hc, hc] -> the mixing matrix: row softmax + eps, then Sinkhorn (columns, then
    (iters - 1) x (rows, columns)), each sum + eps (dsv4_model.layers.hc_pre's steps)."""
    comb = torch.softmax(logits.float(), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_pre_ref(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight,
               iters: int, hc_eps: float, norm_eps: float, out_eps: float):
    """dsv4::hc_pre as tensor ops in fp32 (dsv4_model.layers.hc_pre, then the sublayer's RMSNorm of y when
    norm_weight is given): (y [..., d] in x's dtype, post fp32 [..., hc], comb fp32 [..., hc, hc])."""
    hc = x.shape[-2]
    xf = x.float()
    flat = xf.flatten(-2)
    mixes = (flat @ fn.float().t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = hc_sinkhorn_ref((mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc)), iters, hc_eps)
    y = (pre.unsqueeze(-1) * xf).sum(-2).to(x.dtype)
    if norm_weight is not None:
        yf = y.float()
        y = (norm_weight * (yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + out_eps))).to(x.dtype)
    return y, post, comb


def hc_post_ref(out: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new hc streams (dsv4_model.layers.hc_post): stream j = post_j * out + sum_i comb[i, j] * res_i in fp32,
    in out's dtype."""
    mixed = (comb.unsqueeze(-1) * res.float().unsqueeze(-2)).sum(-3)
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


def hc_post_rows_ref(rows: torch.Tensor, ids: torch.Tensor, n_experts: int, lead) -> torch.Tensor:
    """dsv4::hc_post_pre's sublayer output from the MoE's uncombined rows [T*k (+ T), d] (ids [T, k]; the shared row
    is there when rows has T*k + T), shaped lead + (d,): the combine's fp32 sum (moe_combine_rows_ref) rounded once
    to the rows' dtype."""
    tokens, k = ids.shape
    d = rows.shape[-1]
    shared = tokens > 0 and rows.shape[0] == tokens * k + tokens
    return moe_combine_rows_ref(rows, ids, n_experts, shared).reshape(*lead, d)


def hc_post_pre_ref(out, res, post, comb, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps,
                    out_ids=None, out_experts=0):
    """dsv4::hc_post_pre: (h = hc_post_ref(out, res, post, comb), *hc_pre_ref(h, ...)). With out_ids [T, k], out is
    the MoE's uncombined rows [T*k (+ T), d] and the sublayer output their sum (hc_post_rows_ref)."""
    if out_ids is not None:
        out = hc_post_rows_ref(out, out_ids, out_experts, res.shape[:-2])
    h = hc_post_ref(out, res, post, comb)
    return (h, *hc_pre_ref(h, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps))


# ======================================================================================================
# fp32 projections: dsv4::fp32_linear
# ======================================================================================================

def fp32_linear_ref(x: torch.Tensor, weight: list[torch.Tensor]) -> list[torch.Tensor]:
    """out[i] = float(x) @ float(weight[i])^T, summed in float64 and rounded once to fp32 (the op sums in fp32, in
    an order of its own: compare with a bound on fp32 summation error)."""
    return [(x.double() @ w.double().t()).float() for w in weight]


# ======================================================================================================
# MoE routing: dsv4::router_topk
# ======================================================================================================

def router_topk_ref(scores: torch.Tensor, bias, k: int, renormalize: bool, scale: float, sqrt_softplus: bool = False):
    """(weights fp32 [N, k], indices int64 [N, k]): the k largest scores + bias per row (a stable descending sort:
    NaN first, ties to the lower index), their unbiased scores, / their sum (renormalize), * scale. sqrt_softplus:
    scores are the logits, through dsv4_model.moe.Gate's F.softplus(logits).sqrt() first."""
    if sqrt_softplus:
        scores = torch.nn.functional.softplus(scores).sqrt()
    key = scores if bias is None else scores + bias
    indices = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, indices


# ======================================================================================================
# decode attention: dsv4::sparse_attn_decode
# ======================================================================================================

def sparse_attn_decode_ref(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                           scale: float, out_rope=None, rope_dim: int = 0, idx2=None,
                           idx2_offset: int = 0) -> torch.Tensor:
    """q [B, H, D] against the rows idx [B, J] of kv [B' >= B, N, D] (entries outside [0, N) skipped): fp32 scores
    times scale, one softmax together with the per-head sink [H], the fp32 weighted sum of the rows (K = V), in
    q's dtype (dsv4_model.attention.Attention._attend's steps); with out_rope [B, rope_dim / 2, (cos, sin)] the
    inverse RoPE of the trailing rope_dim dims, rounded again (Attention._out's first step). idx2 [B, J2]: more
    rows, idx2 + idx2_offset where idx2 >= 0 (negative: none), listed after idx."""
    if idx2 is not None:
        idx2 = idx2.long()
        idx = torch.cat([idx.long(), torch.where(idx2 >= 0, idx2 + idx2_offset, -1)], dim=1)
    out = _sparse_attn(q, kv, idx, sink, scale)
    if out_rope is None:
        return out
    return _rope_rows(out, out_rope, rope_dim, inverse=True)


def _rope_rows(x: torch.Tensor, cs: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """x [rows, heads, d]: its trailing rope_dim dims rotated as interleaved pairs by cs [rows, rope_dim / 2, (cos,
    sin)] (sin negated when inverse) in fp32 from x's values, rounded to x's dtype (apply_rope's steps)."""
    nope = x.shape[-1] - rope_dim
    r = x[..., nope:].float().unflatten(-1, (rope_dim // 2, 2))
    cos, sin = cs[:, None, :, 0], cs[:, None, :, 1]
    if inverse:
        sin = -sin
    rot = torch.stack([r[..., 0] * cos - r[..., 1] * sin, r[..., 0] * sin + r[..., 1] * cos], -1).flatten(-2)
    return torch.cat([x[..., :nope], rot.to(x.dtype)], -1)


def _sparse_attn(q, kv, idx, sink, scale):
    B, D, N = q.shape[0], q.shape[2], kv.shape[1]
    valid = (idx >= 0) & (idx < N)
    rows = torch.where(valid, idx, torch.zeros_like(idx)).long()
    keys = kv[:B].float().gather(1, rows.unsqueeze(-1).expand(-1, -1, D))
    s = torch.einsum("bhd,bjd->bhj", q.float(), keys).masked_fill(~valid.unsqueeze(1), float("-inf")) * scale
    p = torch.cat([s, sink.float().view(1, -1, 1).expand(B, -1, 1)], dim=-1).softmax(dim=-1)
    return torch.einsum("bhj,bjd->bhd", p[..., :-1], keys).to(q.dtype)


# ======================================================================================================
# compressor decode: dsv4::compressor_decode
# ======================================================================================================

def compressor_decode_ref(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                          kv_state: torch.Tensor, score_state: torch.Tensor) -> torch.Tensor:
    """One decode step of dsv4_model.compressor.Compressor.decode's state update and pooling (its tensor ops):
    writes the token into rows [:B] of the states in place and returns pooled fp32 [B, hd]."""
    B, C = kv.shape
    m = ape.shape[0]
    overlap = kv_state.shape[1] == 2 * m
    hd = C // 2 if overlap else C
    rows = torch.arange(B, device=kv.device)
    pos = positions.long()
    kv_state.index_put_((rows, (m if overlap else 0) + pos % m), kv)
    score_state.index_put_((rows, (m if overlap else 0) + pos % m), score + ape[pos % m])
    if not overlap:
        return (kv_state[:B] * score_state[:B].softmax(dim=1)).sum(dim=1)
    kv_s = torch.cat([kv_state[:B, :m, :hd], kv_state[:B, m:, hd:]], dim=1)
    sc_s = torch.cat([score_state[:B, :m, :hd], score_state[:B, m:, hd:]], dim=1)
    pooled = (kv_s * sc_s.softmax(dim=1)).sum(dim=1)
    closed = ((pos + 1) % m == 0).view(B, 1, 1)
    kv_state[:B, :m] = torch.where(closed, kv_state[:B, m:], kv_state[:B, :m])
    score_state[:B, :m] = torch.where(closed, score_state[:B, m:], score_state[:B, :m])
    return pooled


# ======================================================================================================
# RMSNorm + RoPE: dsv4::rms_norm_rope
# ======================================================================================================

def rms_norm_rope_ref(x: torch.Tensor, weight, cs: torch.Tensor, eps: float, rope_dim: int,
                      fp8_nope: bool) -> torch.Tensor:
    """x [rows, heads, d] -> the model's steps as tensor ops: RMSNorm in fp32 (times weight if given) rounded to
    x's dtype (dsv4_model.layers.RMSNorm / unweighted_rms_norm), RoPE of the trailing interleaved pairs by cs
    [rows, rope_dim / 2, (cos, sin)] rounded again (apply_rope), and with fp8_nope the leading dims rounded to
    FP8 e4m3 with a power-of-two scale per 64 (quant_sim.kv_fake_quant)."""
    d = x.shape[-1]
    nope = d - rope_dim
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    y = _rope_rows((y if weight is None else weight * y).to(x.dtype), cs, rope_dim).float()
    if fp8_nope:
        b = y[..., :nope].unflatten(-1, (nope // 64, 64))
        t = (b.abs().amax(-1, keepdim=True).clamp_min(1e-4) * _f32_recip(448.0)).view(torch.int32)
        s = ((((t >> 23) & 0xFF) + ((t & 0x7FFFFF) != 0).int()) << 23).view(torch.float32)
        q = (b / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
        y = torch.cat([q.flatten(-2).to(x.dtype).float(), y[..., nope:]], -1)
    return y.to(x.dtype)


def rms_norm_rope_store_ref(x: torch.Tensor, weight, cs: torch.Tensor, eps: float, rope_dim: int, fp8_nope: bool,
                            positions: torch.Tensor, ratio: int, offset: int, slots: int,
                            cache: torch.Tensor) -> None:
    """rms_norm_rope_ref of x [rows, d] written into cache [>= rows, S, d] in place: row r at slot offset +
    positions[r] % slots (ratio 0, a sliding window), or offset + min(positions[r] // ratio, slots - 1) only where
    (positions[r] + 1) % ratio == 0 (compressed entries); the model's index_put / _write_entry steps."""
    y = rms_norm_rope_ref(x.unsqueeze(1), weight, cs, eps, rope_dim, fp8_nope).squeeze(1)
    for r, p in enumerate(positions.tolist()):
        if p < 0 or (ratio and (p + 1) % ratio):
            continue
        cache[r, offset + (p % slots if ratio == 0 else min(p // ratio, slots - 1))] = y[r]


def _f32_recip(v: float) -> float:
    """The fp32-rounded reciprocal (the official kernels multiply by it)."""
    return float(torch.tensor(1.0 / v, dtype=torch.float32))


# ======================================================================================================
# indexer Hadamard + FP4: dsv4::hadamard_fp4
# ======================================================================================================

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


# ======================================================================================================
# indexer key store: dsv4::indexer_store_keys
# ======================================================================================================

def indexer_store_keys_ref(keys: torch.Tensor, positions: torch.Tensor, ratio: int, kv_cache: torch.Tensor,
                           k_codes: torch.Tensor, k_scales: torch.Tensor) -> None:
    """The decode step's indexer key writes (Attention._write_entry of the key and of its FP4 form, by
    indexer_fp4_quantize_keys): rows whose window closed at this token ((pos + 1) % ratio == 0) get the key at
    slot min(pos // ratio, n - 1) of each cache, in place; the other rows keep theirs."""
    B, n = keys.shape[0], kv_cache.shape[1]
    rows = torch.arange(B)
    pos = positions.long().cpu()
    done = (pos + 1) % ratio == 0
    slot = (pos // ratio).clamp(max=n - 1)
    codes, scales = indexer_fp4_quantize_keys(keys)
    for cache, value in ((kv_cache, keys), (k_codes, codes), (k_scales, scales)):
        cache[rows[done], slot[done]] = value[done].to(cache.dtype)

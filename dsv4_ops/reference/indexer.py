"""The lightning indexer references (dsv4::indexer_score_topk, the FP4 indexer key storage)."""
import torch


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


def indexer_scores_ref(q, weights, k_codes, k_scales) -> torch.Tensor:
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


def indexer_score_topk_ref(q, weights, k_codes, k_scales, n_valid, topk: int, weights_scale: float = 1.0,
                                 weights_dtype: torch.dtype | None = None, kv_batch: int = 0) -> torch.Tensor:
    """Reference of dsv4::indexer_score_topk (see docs/ops.md "## Indexer"). The head weights used are
    float(weights.to(weights_dtype)) * weights_scale, one fp32 multiply (the scalar rounded to fp32 first).
    kv_batch > 0: row b scores the keys of sequence b % kv_batch."""
    if kv_batch:
        reps = q.shape[0] // kv_batch
        k_codes, k_scales = k_codes.repeat(reps, 1, 1), k_scales.repeat(reps, 1, 1)
    assert weights_dtype in (None, torch.bfloat16, torch.float16), weights_dtype
    w = weights.float() if weights_dtype is None else weights.float().to(weights_dtype).float()
    w = w * weights_scale
    return indexer_topk_from_scores(indexer_scores_ref(q, w, k_codes, k_scales), n_valid, topk)


def indexer_prefill_scores_ref(q, weights, keys, n_visible) -> torch.Tensor:
    """Reference of dsv4::indexer_prefill_scores: fp32 [B, S, T] = sum_h weights[b,s,h] * relu(q[b,s,h] . keys[b,t])
    (q [B, S, H, D], keys [B, T, D], weights fp32 [B, S, H]), -inf where t >= n_visible[b, s] (int64 [B, S]): the
    model's torch form (Indexer.scores, then the visibility mask)."""
    s = torch.einsum("bshd,btd->bsht", q.float(), keys.float()).relu()
    scores = (s * weights.float().unsqueeze(-1)).sum(dim=2)
    t = torch.arange(keys.shape[1], device=keys.device)
    return scores.masked_fill(t.view(1, 1, -1) >= n_visible.unsqueeze(-1), float("-inf"))


def indexer_topk_ref(scores, topk: int) -> torch.Tensor:
    """Reference of dsv4::indexer_topk: int64 [..., topk], each row's indices by (score desc, index asc), -0 and +0
    equal: a stable descending sort (equal scores keep index order)."""
    return torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :topk]

"""Decode attention, compressor, RMSNorm + RoPE, Hadamard + FP4 and indexer key store references."""
import torch

from .indexer import indexer_fp4_quantize_keys

# ======================================================================================================
# decode attention: dsv4::sparse_attn_decode
# ======================================================================================================

def sparse_attn_decode_ref(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                           scale: float, out_rope=None, rope_dim: int = 0, idx2=None,
                           idx2_offset: int = 0) -> torch.Tensor:
    """q [B, H, D] against the rows idx [B, J] of kv [B' >= B, N, D] (entries outside [0, N) skipped): fp32 scores
    times scale, one softmax together with the per-head sink [H], the fp32 weighted sum of the rows (K = V), in
    q's dtype (dsv4_model.model.attention.Attention._attend's steps); with out_rope [B, rope_dim / 2, (cos, sin)] the
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
                          kv_state: torch.Tensor, score_state: torch.Tensor, overlap: bool | None = None
                          ) -> torch.Tensor:
    """One decode step of dsv4_model.model.compressor.Compressor.decode's state update and pooling (as tensor ops):
    writes the token into rows [:B] of the states in place and returns pooled fp32 [B, hd]. overlap: overlapping
    windows (C = 2 hd; default: the state has 2m rows). States of more than c*m rows (c = 2 with overlap) are
    indexed by position (token p in row p mod R, the window read by position, never shifted)."""
    B, C = kv.shape
    m, R = ape.shape[0], kv_state.shape[1]
    overlap = R == 2 * m if overlap is None else overlap
    hd, cm = (C // 2, 2 * m) if overlap else (C, m)
    rows = torch.arange(B, device=kv.device)
    pos = positions.long()
    by_position = R > cm
    slot = pos % R if by_position else (m if overlap else 0) + pos % m
    kv_state.index_put_((rows, slot), kv)
    score_state.index_put_((rows, slot), score + ape[pos % m])
    if by_position:  # the window's rows by position; positions below 0 read as unwritten rows
        q = pos.unsqueeze(1) - (cm - 1) + torch.arange(cm, device=kv.device).unsqueeze(0)
        kv_w = kv_state[rows.unsqueeze(1), q % R]
        sc_w = score_state[rows.unsqueeze(1), q % R].masked_fill((q < 0).unsqueeze(-1), float("-inf"))
        kv_w = kv_w.masked_fill((q < 0).unsqueeze(-1), 0.0)
    else:
        kv_w, sc_w = kv_state[:B], score_state[:B]
    if not overlap:
        return (kv_w * sc_w.softmax(dim=1)).sum(dim=1)
    kv_s = torch.cat([kv_w[:, :m, :hd], kv_w[:, m:, hd:]], dim=1)
    sc_s = torch.cat([sc_w[:, :m, :hd], sc_w[:, m:, hd:]], dim=1)
    pooled = (kv_s * sc_s.softmax(dim=1)).sum(dim=1)
    if not by_position:
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
    x's dtype (dsv4_model.model.layers.RMSNorm / unweighted_rms_norm), RoPE of the trailing interleaved pairs by cs
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

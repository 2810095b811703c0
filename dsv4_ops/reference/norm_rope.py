"""RMSNorm + RoPE references (dsv4::rms_norm_rope, dsv4::rms_norm_rope_store)."""
import torch

from ._helpers import _f32_recip, _rope_rows


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
                            cache: torch.Tensor, kv_batch: int = 0) -> None:
    """rms_norm_rope_ref of x [rows, d] written into cache [>= rows, S, d] in place: row r (into cache row
    r % kv_batch with kv_batch > 0) at slot offset + positions[r] % slots (ratio 0, a sliding window), or offset +
    min(positions[r] // ratio, slots - 1) only where (positions[r] + 1) % ratio == 0 (compressed entries); the
    model's index_put / _write_entry steps."""
    y = rms_norm_rope_ref(x.unsqueeze(1), weight, cs, eps, rope_dim, fp8_nope).squeeze(1)
    for r, p in enumerate(positions.tolist()):
        if p < 0 or (ratio and (p + 1) % ratio):
            continue
        slot = p % slots if ratio == 0 else min(p // ratio, slots - 1)
        cache[r % kv_batch if kv_batch else r, offset + slot] = y[r]

"""Helpers several references share: RoPE of the trailing dims of a vector, the fp32 reciprocal."""
import torch


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


def _f32_recip(v: float) -> float:
    """The fp32-rounded reciprocal (the official kernels multiply by it)."""
    return float(torch.tensor(1.0 / v, dtype=torch.float32))

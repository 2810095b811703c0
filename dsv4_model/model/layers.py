"""Building blocks: the projections (bias-free Linear, grouped Linear, `project` for several of one input), RMSNorm,
interleaved RoPE (+YaRN), mHC hyper-connections."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_ops import ops


# A stored form's one call for several projections of the same x: run(x, projections) -> their outputs.
JointRun = Callable[[torch.Tensor, Sequence["Projection"]], Sequence[torch.Tensor]]


class Projection(nn.Module):
    """A weight matrix the model multiplies by, each stored form its own class: float here (`Linear`,
    `GroupedLinear`), NVFP4 in dsv4_model.quant.nvfp4_modules (the conversion puts those in place of these). One
    projection is `mod(x)`; several that read the same x go through `project`.

    `joint`: the call that runs projections of this stored form together on one x (`project` uses it for two or
    more that share it), or None: each runs alone. Set when the module is built, from how its weight is stored,
    so a call asks nothing."""

    joint: JointRun | None = None


def project(x: torch.Tensor, *projections: Projection, fp32: bool = False) -> tuple[torch.Tensor, ...]:
    """x @ W^T for each projection of the same x, computed as its weight is stored, in one launch where the stored
    forms allow (DeepSeek's inference `linear()` dispatches on the weight's dtype the same way):
    - fp32: float Linears in fp32 math, one dsv4::fp32_linear, fp32 out;
    - two or more of one `joint` (W4A16 NVFP4: one dsv4::nvfp4_linear_multi; `Linear(fp32=True)`: one
      dsv4::fp32_linear): that call, the values of calling each;
    - otherwise (float in the weight's dtype, W4A4, grouped, mixed forms) each projection's own forward."""
    if fp32:
        if not all(isinstance(p, Linear) for p in projections):
            raise ValueError("project(fp32=True) takes float Linears only")
        return tuple(fp32_linear(x, [p.weight for p in projections]))
    run = projections[0].joint
    if run is not None and len(projections) > 1 and all(p.joint is run for p in projections):
        return tuple(run(x, projections))
    return tuple(p(x) for p in projections)


def _fp32_run(x: torch.Tensor, projections: Sequence[Linear]) -> list[torch.Tensor]:
    return fp32_linear(x, [p.weight for p in projections])


class Linear(Projection):
    """y = x @ W^T without bias, in the weight's dtype; fp32: in fp32 math with an fp32 output whatever dtype the weight
    is held in (official's fp32 projections; `narrow_if_lossless_` may hold the weight in bf16). Parameters are
    allocated uninitialised (weights come from a checkpoint)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, fp32: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.fp32 = in_features, out_features, fp32
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.joint = _fp32_run if fp32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return fp32_linear(x, [self.weight])[0]
        return F.linear(x.to(self.weight.dtype), self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, dtype={self.weight.dtype}" + (", fp32" if self.fp32 else "")


class GroupedLinear(Projection):
    """z[..., g, :] = x[..., g, :] @ W_g^T for G matrices [R, K] stored as one weight [G * R, K] (attention wo_a).
    forward(x [..., G, K]) -> [..., G, R]."""

    def __init__(self, groups: int, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...gd,grd->...gr", x, self.weight.view(self.groups, self.out_features, -1))

    def extra_repr(self) -> str:
        return f"groups={self.groups}, {self.in_features}, {self.out_features}, dtype={self.weight.dtype}"


class RMSNorm(nn.Module):
    """Weighted RMSNorm computed in fp32 with an fp32 weight (official keeps norm weights in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


# ---------------------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """Per-pair inverse frequencies [dim//2] (fp32). YaRN ramp when original_seq_len > 0 (official formula)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corr_dim(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_table(inv_freq: torch.Tensor, n_pos: int, device=None) -> torch.Tensor:
    """[n_pos, dim//2, 2] fp32 table of (cos, sin) for positions 0..n_pos-1."""
    t = torch.arange(n_pos, dtype=torch.float32, device=device)
    ang = torch.outer(t, inv_freq.to(device))
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cs: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of the trailing `rope_dim` dims of x.

    cs: (cos, sin) table rows broadcastable to x[..., :rope_dim//2, 2] (leading dims of x, one row per position).
    inverse=True applies the conjugate rotation (used on the attention output)."""
    d = x.shape[-1]
    nope, rope = x[..., : d - rope_dim], x[..., d - rope_dim:]
    r = rope.float().unflatten(-1, (rope_dim // 2, 2))
    cos, sin = cs[..., 0], cs[..., 1]
    if inverse:
        sin = -sin
    x0, x1 = r[..., 0], r[..., 1]
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([nope, y.to(x.dtype)], dim=-1)


def fp32_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[float(x) @ float(w)^T for w in weights] in fp32: the projections official runs in fp32. One
    dsv4::fp32_linear launch for all of them (x and the weights are read as they are: widening bf16 is exact);
    the op has no backward, so with a gradient to track they run as F.linear."""
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return [F.linear(x.float(), w.float()) for w in weights]
    return list(ops.fp32_linear(x, weights))


@torch.no_grad()
def narrow_if_lossless_(lin: Linear, lossless: bool | None = None) -> None:
    """Hold an fp32 Linear's weight in bf16 when every value fits (the released checkpoints store these weights in
    bf16): fp32_linear widens bf16 exactly, so results are unchanged and reads halve. Weights with values bf16
    cannot hold stay fp32; so does one that tracks gradients. lossless=True narrows without looking (a meta model
    sized as the released checkpoints load)."""
    w = lin.weight
    if w.dtype != torch.float32 or w.requires_grad or (w.device.type == "meta" and not lossless):
        return
    narrow = w.to(torch.bfloat16)
    if lossless or torch.equal(narrow.float(), w):
        lin.weight = nn.Parameter(narrow, requires_grad=False)


# ---------------------------------------------------------------------------------------------------- mHC
def _hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.flatten(-2).float()
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    return fp32_linear(x.flatten(-2), [fn])[0] * rs, xf


def _sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """dsv4::hc_sinkhorn as tensor ops (they have a backward): row softmax + eps, normalise the columns, then
    iters - 1 rounds of rows and columns, every sum + eps."""
    comb = torch.softmax(logits.float(), dim=-1) + eps
    for i in range(2 * iters - 1):
        dim = -2 if i % 2 == 0 else -1
        comb = comb / (comb.sum(dim, keepdim=True) + eps)
    return comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the hc residual streams [..., hc, d] into one sublayer input (fp32 math).

    Returns (y [..., d] in x.dtype, post [..., hc] fp32, comb [..., hc, hc] fp32 with comb[i, j] = weight of old
    stream i in new stream j)."""
    mixes, _ = _hc_mixes(x, fn, norm_eps)
    scale = scale.float()
    base = base.float()
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    # row softmax + eps, then Sinkhorn: one kernel (as tensor ops it is 2 * iters GPU kernels); the op has no
    # backward, so training runs the same steps as tensor ops
    if torch.is_grad_enabled() and comb.requires_grad:
        comb = _sinkhorn(comb, iters, hc_eps)
    else:
        comb = ops.hc_sinkhorn(comb, iters=iters, eps=hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=-2)
    return y.to(x.dtype), post, comb


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a sublayer output back to hc streams: h'_j = post_j * out + sum_i comb[i, j] * res_i (fp32)."""
    y = post.unsqueeze(-1) * out.float().unsqueeze(-2) + (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(-3)
    return y.to(out.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final stream collapse (no Sinkhorn, no post): y = sum_i (sigmoid(mix_i*scale + base_i) + eps) h_i."""
    mixes, _ = _hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)

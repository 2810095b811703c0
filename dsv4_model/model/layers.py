"""Building blocks: the projections (bias-free Linear, grouped Linear, `project` for several of one input; each
multiplies as its weight is stored: float, fp32 math, NVFP4 W4A16 / W4A4), RMSNorm, interleaved RoPE (+YaRN), mHC
hyper-connections."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_ops import ops


# A stored form's one call for several projections of the same x: run(x, projections) -> their outputs.
JointRun = Callable[[torch.Tensor, Sequence["Projection"]], Sequence[torch.Tensor]]


class WeightForm:
    """How a projection's weight is stored: the tensors its module holds (`names`, as parameters when `parameters`,
    else as buffers) and the calls that multiply by them, one for a plain projection (`linear`) and one for a
    grouped one (`grouped`). DeepSeek's inference `linear()` asks the weight's dtype on every call; here the form
    is set when the weight is stored (`Projection.store_`), so a call asks nothing.

    `joint`: the call that runs plain projections (`Linear`s) of this form together on one x (`project` uses it
    for two or more that share it), or None: each runs alone."""

    names: tuple[str, ...] = ("weight",)
    parameters = True
    joint: JointRun | None = None

    def linear(self, x: torch.Tensor, p: Linear) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no plain projection")

    def grouped(self, x: torch.Tensor, p: GroupedLinear) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no grouped projection")

    def describe(self, p: Projection) -> str:
        return ""


class FloatWeight(WeightForm):
    """A float `weight` [N, K] (grouped: [G * R, K]), multiplied in its dtype."""

    def linear(self, x: torch.Tensor, p: Linear) -> torch.Tensor:
        return F.linear(x.to(p.weight.dtype), p.weight)

    def grouped(self, x: torch.Tensor, p: GroupedLinear) -> torch.Tensor:
        return torch.einsum("...gd,grd->...gr", x, p.weight.view(p.groups, p.out_features, -1))

    def describe(self, p: Projection) -> str:
        return f"dtype={p.weight.dtype}"


def _fp32_run(x: torch.Tensor, projections: Sequence[Linear]) -> list[torch.Tensor]:
    return fp32_linear(x, [p.weight for p in projections])


class Fp32Weight(FloatWeight):
    """A float `weight` multiplied in fp32 math with an fp32 output whatever dtype it is held in (official's fp32
    projections; `narrow_if_lossless_` may hold it in bf16); several of one x: one dsv4::fp32_linear."""

    joint = staticmethod(_fp32_run)

    def linear(self, x: torch.Tensor, p: Linear) -> torch.Tensor:
        return fp32_linear(x, [p.weight])[0]

    def grouped(self, x: torch.Tensor, p: GroupedLinear) -> torch.Tensor:
        return WeightForm.grouped(self, x, p)

    def describe(self, p: Projection) -> str:
        return super().describe(p) + ", fp32"


FLOAT, FP32 = FloatWeight(), Fp32Weight()


def w4a4_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """fp32 x @ W^T with x quantized to NVFP4 per row (each token's own global scale, so a row's result does not
    depend on the other rows of its batch), the row's global scale applied after the fp32 GEMM."""
    xp, xs, xg = ops.fused_amax_quantize_per_row(x)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = ops.nvfp4_linear_w4a4(xp, xs, one, w_packed=packed, w_scale=scale, w_global_scale=gs, out_dtype=torch.float32)
    return y * xg.unsqueeze(-1)


def _nvfp4_weights(projections: Sequence[Linear]) -> dict[str, list[torch.Tensor]]:
    """The NVFP4 weight lists of the multi ops' calls (w_packed, w_scale, w_global_scale)."""
    return {"w_packed": [p.weight_packed for p in projections], "w_scale": [p.weight_scale for p in projections],
            "w_global_scale": [p.weight_global_scale for p in projections]}


def _w4a16_run(x: torch.Tensor, projections: Sequence[Linear]) -> list[torch.Tensor]:
    """W4A16 projections of one x in one dsv4::nvfp4_linear_multi call (the values of calling each)."""
    outs = ops.nvfp4_linear_multi(x.to(torch.bfloat16), **_nvfp4_weights(projections))
    return [o.to(p.form.out_dtype) for o, p in zip(outs, projections)]


class Nvfp4Weight(WeightForm):
    """An NVFP4 weight in the kernel layout of dsv4_model.quant.nvfp4 (`weight_packed`, `weight_scale`,
    `weight_global_scale`; grouped: [G, ...] with one global scale per group; the conversion,
    dsv4_model.quant.nvfp4_modules.store_nvfp4_, allocates them), the product returned in `out_dtype` (the float
    weight's dtype). w4a4 False: bf16 activations (W4A16, the fast Hopper path; several of one x: one
    dsv4::nvfp4_linear_multi); True: activations quantized to NVFP4 per row (W4A4, the numerics of a Blackwell
    NVFP4 GEMM). exact_out (W4A16, one Linear: a head): the op writes out_dtype from its fp32 sums, no bf16
    rounding between (fp32 logits)."""

    names = ("weight_packed", "weight_scale", "weight_global_scale")
    parameters = False

    def __init__(self, w4a4: bool = False, out_dtype: torch.dtype = torch.bfloat16, exact_out: bool = False):
        if exact_out and w4a4:
            raise ValueError("exact_out is W4A16's (the W4A4 rows carry their own scales)")
        self.w4a4, self.out_dtype, self.exact_out = w4a4, out_dtype, exact_out
        self.joint = None if w4a4 or exact_out else _w4a16_run

    def linear(self, x: torch.Tensor, p: Linear) -> torch.Tensor:
        if self.w4a4:
            y = w4a4_rows(x, p.weight_packed, p.weight_scale, p.weight_global_scale)
        else:
            y = ops.nvfp4_linear(x.to(torch.bfloat16), w_packed=p.weight_packed, w_scale=p.weight_scale,
                                 w_global_scale=p.weight_global_scale,
                                 out_dtype=self.out_dtype if self.exact_out else None)
        return y.to(self.out_dtype)

    def grouped(self, x: torch.Tensor, p: GroupedLinear) -> torch.Tensor:
        """W4A16: one dsv4::nvfp4_linear_grouped call (one launch at decode); W4A4: G per-row-quantized linears."""
        if not self.w4a4:
            return ops.nvfp4_linear_grouped(x.to(torch.bfloat16), w_packed=p.weight_packed, w_scale=p.weight_scale,
                                            w_global_scale=p.weight_global_scale).to(self.out_dtype)
        outs = []
        for g in range(p.groups):
            w, s, gs = p.weight_packed[g], p.weight_scale[g], p.weight_global_scale[g]
            outs.append(w4a4_rows(x[..., g, :], w, s, gs).to(self.out_dtype))
        return torch.stack(outs, dim=-2)

    def describe(self, p: Projection) -> str:
        return f"nvfp4, w4a4={self.w4a4}"


class Projection(nn.Module):
    """A weight matrix the model multiplies by: `Linear` (y = x @ W^T) or `GroupedLinear` (one matrix per group),
    the weight held in a stored form (`form`: float, fp32-math float or NVFP4; the conversion,
    dsv4_model.quant.nvfp4_modules, stores NVFP4 in place of the float weight: `store_`). One projection is `mod(x)`; several that read
    the same x go through `project`."""

    form: WeightForm = FLOAT

    def store_(self, form: WeightForm, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hold the weight as `tensors` of `form` (its `names`) in place of the current ones, which are returned:
        the module, its name and its other state stay as they are, only how the weight is stored changes."""
        if set(tensors) != set(form.names):
            raise ValueError(f"{type(form).__name__} stores {form.names}, got {tuple(tensors)}")
        old = {n: getattr(self, n) for n in self.form.names}
        for n in self.form.names:
            delattr(self, n)
        for n in form.names:
            if form.parameters:
                self.register_parameter(n, nn.Parameter(tensors[n], requires_grad=False))
            else:
                self.register_buffer(n, tensors[n])
        self.form = form
        return old


def project(x: torch.Tensor, *projections: Projection, fp32: bool = False) -> tuple[torch.Tensor, ...]:
    """x @ W^T for each projection of the same x, computed as its weight is stored, in one launch where the stored
    forms allow:
    - fp32: float Linears in fp32 math, one dsv4::fp32_linear, fp32 out;
    - two or more Linears of one `joint` (W4A16 NVFP4: one dsv4::nvfp4_linear_multi; `Linear(fp32=True)`: one
      dsv4::fp32_linear): that call, the values of calling each;
    - otherwise (float in the weight's dtype, W4A4, grouped, mixed forms) each projection's own forward."""
    if fp32:
        if not all(is_float_linear(p) for p in projections):
            raise ValueError("project(fp32=True) takes float Linears only")
        return tuple(fp32_linear(x, [p.weight for p in projections]))
    run = projections[0].form.joint
    if run is not None and len(projections) > 1 and all(isinstance(p, Linear) and p.form.joint is run
                                                         for p in projections):
        return tuple(run(x, projections))
    return tuple(p(x) for p in projections)


def project_with_fp32(x: torch.Tensor, projections: Sequence[Projection], fp32_projections: Sequence[Projection]
                      ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(project(x, *projections), project(x, *fp32_projections, fp32=True)) of one bf16 x, in one
    dsv4::nvfp4_fp32_linear_multi call where `projections` are W4A16 NVFP4 Linears (on CUDA under PDL its fp32
    kernel runs beside the NVFP4 gemv instead of after it), else as those two calls; the same values either way."""
    if not all(is_float_linear(p) for p in fp32_projections):
        raise ValueError("project_with_fp32 takes float Linears as fp32_projections")
    if not fp32_projections:
        return project(x, *projections), ()
    if not (x.dtype == torch.bfloat16 and projections
            and all(isinstance(p, Linear) and p.form.joint is _w4a16_run for p in projections)):
        return project(x, *projections), project(x, *fp32_projections, fp32=True)
    outs = ops.nvfp4_fp32_linear_multi(x, **_nvfp4_weights(projections),
                                       fp32_weight=[p.weight for p in fp32_projections])
    n = len(projections)
    return tuple(o.to(p.form.out_dtype) for o, p in zip(outs[:n], projections)), tuple(outs[n:])


def is_float_linear(p: nn.Module) -> bool:
    """Whether p is a Linear holding a float weight."""
    return isinstance(p, Linear) and isinstance(p.form, FloatWeight)


class Linear(Projection):
    """y = x @ W^T without bias, as the weight is stored (`form`); built float: in the weight's dtype, or with
    fp32=True in fp32 math with an fp32 output (`Fp32Weight`). Parameters are allocated uninitialised (weights
    come from a checkpoint)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, fp32: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.form = FP32 if fp32 else FLOAT
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    @property
    def fp32(self) -> bool:
        return isinstance(self.form, Fp32Weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.form.linear(x, self)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.form.describe(self)}"


class GroupedLinear(Projection):
    """z[..., g, :] = x[..., g, :] @ W_g^T for G matrices [R, K] (attention wo_a), as the weight is stored; built
    float: one weight [G * R, K]. forward(x [..., G, K]) -> [..., G, R]."""

    def __init__(self, groups: int, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.form.grouped(x, self)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, {self.in_features}, {self.out_features}, {self.form.describe(self)}"


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


def wide_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for rows as wide as a vocabulary, in two reductions: Inductor reduces each row of an argmax in
    one program, so the verification's [2, 129280] argmax took ~30 µs on two SMs (H100, bench/RESULTS.md session
    39); the maximum of 64 pieces per row, then across them, spreads over the GPU. The same index (the first
    maximum: a piece's first, in the first piece that holds the row's maximum; NaN counts as the maximum)."""
    V = x.shape[-1]
    n = next((n for n in (64, 32, 16, 8) if V % n == 0 and V // n >= 512), 1)
    if n == 1:
        return x.argmax(-1)
    best, at = x.unflatten(-1, (n, V // n)).max(-1)
    piece = best.argmax(-1, keepdim=True)
    return (piece * (V // n) + at.gather(-1, piece)).squeeze(-1)


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
        lin.store_(lin.form, {"weight": narrow})


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
    """Expand a sublayer output back to hc streams: h'_j = post_j * out + sum_i comb[i, j] * res_i (fp32).
    The sum over i runs in order, one [..., hc, d] term at a time: the same sums as reducing the [..., hc, hc, d]
    products, which eager prefill would otherwise hold (16 GiB at 65,536 tokens of V4-Flash width)."""
    res = residual.float()
    mix = comb[..., 0, :].unsqueeze(-1) * res[..., 0:1, :]
    for i in range(1, comb.shape[-2]):
        mix = mix + comb[..., i, :].unsqueeze(-1) * res[..., i:i + 1, :]
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mix).to(out.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final stream collapse (no Sinkhorn, no post): y = sum_i (sigmoid(mix_i*scale + base_i) + eps) h_i."""
    mixes, _ = _hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)

"""The NVFP4 modules the conversion (dsv4_model.quant.quantize_model) puts in place of the float ones: projections
(`Nvfp4Linear`, the grouped `Nvfp4GroupedLinear` of attention wo_a) and the MoE's experts (`Nvfp4MoE` behind the
`Nvfp4Experts` backend). Buffers in the kernel layout of dsv4_model.quant.nvfp4; forward calls the dsv4 ops, so a
stored NVFP4 model needs no converter.

act_quant "none" (W4A16): bf16 activations, the fast Hopper path. "nvfp4" (W4A4): each token's activation row
quantized to NVFP4 with its own global scale (results do not depend on the other rows of a batch), the numerics
of a Blackwell NVFP4 GEMM.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dsv4_ops import ops

from dsv4_model.model.layers import Projection
from dsv4_model.quant.nvfp4 import (BLOCK, deinterleave_gate_up, dequantize_kernel_layout, interleave_gate_up, padded_k,
                                    quantize_weight, repack_weight)

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


def _w4a16_run(x: torch.Tensor, projections: Sequence[Nvfp4Linear]) -> list[torch.Tensor]:
    """W4A16 projections of one x in one dsv4::nvfp4_linear_multi call (the values of calling each)."""
    outs = ops.nvfp4_linear_multi(x.to(torch.bfloat16), w_packed=[p.weight_packed for p in projections],
                                  w_scale=[p.weight_scale for p in projections],
                                  w_global_scale=[p.weight_global_scale for p in projections])
    return [o.to(p.out_dtype) for o, p in zip(outs, projections)]


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
        self.joint = None if self.w4a4 else _w4a16_run
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w4a4:
            y = w4a4_rows(x, self.weight_packed, self.weight_scale, self.weight_global_scale)
        else:
            y = ops.nvfp4_linear(x.to(torch.bfloat16), w_packed=self.weight_packed, w_scale=self.weight_scale,
                                 w_global_scale=self.weight_global_scale)
        return y.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, w4a4={self.w4a4}"


class Nvfp4GroupedLinear(Projection):
    """Grouped projection z[..., g, :] = x[..., g, :] @ W_g^T (attention wo_a): G NVFP4 matrices [R, K] with one
    global scale each: one dsv4::nvfp4_linear_grouped call (W4A16; one launch at decode), G W4A4 linears.
    forward(x [..., G, K]) -> [..., G, R]."""

    def __init__(self, groups: int, in_features: int, out_features: int, out_dtype: torch.dtype,
                 act_quant: str = "none", device=None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"Nvfp4GroupedLinear: in_features must be a multiple of 16, got {in_features}")
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        self.out_dtype, self.w4a4 = out_dtype, act_quant == "nvfp4"
        kp = padded_k(in_features)
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("weight_packed", torch.zeros(groups, out_features, kp // 2, **u8))
        self.register_buffer("weight_scale", torch.zeros(groups, out_features, kp // BLOCK, **u8))
        self.register_buffer("weight_global_scale", torch.zeros(groups, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.w4a4:
            return ops.nvfp4_linear_grouped(x.to(torch.bfloat16), w_packed=self.weight_packed,
                                            w_scale=self.weight_scale,
                                            w_global_scale=self.weight_global_scale).to(self.out_dtype)
        outs = []
        for g in range(self.groups):
            xg = x[..., g, :]
            w, s, gs = self.weight_packed[g], self.weight_scale[g], self.weight_global_scale[g]
            outs.append(w4a4_rows(xg, w, s, gs).to(self.out_dtype))
        return torch.stack(outs, dim=-2)

    def load_nvfp4_(self, t) -> None:
        """t: [G, R, K/2] / [G, R, K/16] / [G]."""
        dev = self.weight_packed.device
        p, s = repack_weight(t.packed.to(dev), t.scale.to(dev))
        self.weight_packed.copy_(p)
        self.weight_scale.copy_(s)
        self.weight_global_scale.copy_(t.global_scale.reshape(self.groups))

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [G * R, K] (the layout of the bf16 wo_a weight)."""
        w = dequantize_kernel_layout(self.weight_packed, self.weight_scale, self.weight_global_scale,
                                     self.in_features)
        return w.flatten(0, 1)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, {self.in_features}, {self.out_features}, w4a4={self.w4a4}"


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

    def op_weights(self) -> dict:
        """The weights as dsv4::nvfp4_moe / nvfp4_moe_rows take them."""
        shared = self.shared_inter > 0
        return dict(w13=(self.w13_packed, self.w13_scale, self.w13_global_scale),
                    w2=(self.w2_packed, self.w2_scale, self.w2_global_scale),
                    shared_w13=(self.shared_w13_packed, self.shared_w13_scale, self.shared_w13_global_scale)
                    if shared else None,
                    shared_w2=(self.shared_w2_packed, self.shared_w2_scale, self.shared_w2_global_scale)
                    if shared else None,
                    swiglu_limit=self.swiglu_limit)

    def op_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as dsv4::nvfp4_moe / nvfp4_moe_rows take it: bf16 (W4A4: each row NVFP4-rounded first)."""
        if self.w4a4:
            xp, xs, xg = ops.fused_amax_quantize_per_row(x)
            x = ops.nvfp4_dequantize(xp, xs, xg, dtype=torch.bfloat16)
        return x.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        y = ops.nvfp4_moe(self.op_input(x), topk_ids, topk_weights.float(), **self.op_weights())
        return y.to(self.out_dtype)

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


class Nvfp4Experts:
    """The MoE experts backend of a converted MoE: routed + shared experts in one `Nvfp4MoE` (child `nvfp4`),
    static shapes in prefill and decode; at decode its uncombined rows can go to the next hc_post_pre."""

    modules = ("nvfp4",)
    quantized = True

    def combined(self, moe, x, weights, indices, static):
        if moe.shard is None:
            return moe.nvfp4(x, indices, weights).to(x.dtype)
        return combine_rows(self.rows(moe, x, weights, indices), indices.shape[1]).to(x.dtype)

    def rows_dtype(self, moe):
        return torch.bfloat16 if moe.nvfp4.out_dtype == torch.bfloat16 else None

    def rows(self, moe, x, weights, indices):
        """The module's expert rows before forward's combine (dsv4::nvfp4_moe_rows): bf16 [T*k (+ T), d]."""
        nv, shard = moe.nvfp4, moe.shard
        if shard is not None:  # this rank's experts only (the others' ids -1: rows of zeros)
            local, ids = moe.local_ids(indices)
            indices = torch.where(local, ids, -1)
        rows = ops.nvfp4_moe_rows(nv.op_input(x), indices, weights.float(), **nv.op_weights())
        if shard is None:
            return rows
        # the shared expert's rows on rank 0 only: summed across the ranks, every row is the single-process row
        # (one nonzero term: exact in bf16)
        keep = torch.cat((local.reshape(-1), torch.full((x.shape[0],), shard.rank == 0, device=x.device)))
        return shard.all_reduce(torch.where(keep.unsqueeze(-1), rows, 0.0))

    def narrow_(self, moe, start, count):
        moe.nvfp4.narrow_experts_(start, count)


def combine_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The MoE combine of every row of nvfp4_moe_rows' layout ([T*k routed + T shared, d] bf16), as dsv4::nvfp4_moe
    does it: the fp32 sum in slot order from +0, then the shared row, rounded once to bf16."""
    T = rows.shape[0] // (k + 1)
    routed = rows[: T * k].reshape(T, k, -1).float()
    acc = torch.zeros_like(routed[:, 0])
    for j in range(k):
        acc = acc + routed[:, j]
    return (acc + rows[T * k:].float()).to(torch.bfloat16)

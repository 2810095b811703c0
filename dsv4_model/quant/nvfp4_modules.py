"""NVFP4 storage, what the conversion (dsv4_model.quant.quantize_model) puts in place of float weights: a projection's
weight held as NVFP4 (`store_nvfp4_` / `load_nvfp4_`: the module stays a `Linear` / `GroupedLinear`, its form
becomes dsv4_model.model.layers.Nvfp4Weight, which multiplies) and the MoE's experts (`Nvfp4MoE` behind the
`Nvfp4Experts` backend). Buffers in the kernel layout of dsv4_model.quant.nvfp4; the products call the dsv4 ops,
so a stored NVFP4 model needs no converter.

act_quant "none" (W4A16): bf16 activations, the fast Hopper path. "nvfp4" (W4A4): each token's activation row
quantized to NVFP4 with its own global scale (results do not depend on the other rows of a batch), the numerics
of a Blackwell NVFP4 GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4_ops import ops

from dsv4_model.model.layers import GroupedLinear, Linear, Nvfp4Weight, Projection
from dsv4_model.quant.nvfp4 import (BLOCK, deinterleave_gate_up, dequantize_kernel_layout, interleave_gate_up, padded_k,
                                    quantize_weight, quantize_weight_mse, repack_weight)
from dsv4_model.quant.nvfp4_convert import Nvfp4Tensor, float_to_nvfp4

ACT_QUANT_MODES = ("none", "nvfp4")


def _check_act_quant(act_quant: str) -> bool:
    """act_quant -> whether activations are quantized (W4A4)."""
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")
    return act_quant == "nvfp4"


def is_nvfp4(p: nn.Module) -> bool:
    """Whether p is a projection holding an NVFP4 weight."""
    return isinstance(p, Projection) and isinstance(p.form, Nvfp4Weight)


def store_nvfp4_(p: Projection, act_quant: str = "none", *, fp32_out: bool = False,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Hold projection p's weight as empty NVFP4 buffers on `device` (default: the float weight's; meta stays
    meta), the product in the float weight's dtype, or with fp32_out in fp32 straight from the op's sums (a head's
    logits). Returns the float tensors it held."""
    if p.in_features % BLOCK:
        raise ValueError(f"NVFP4: in_features must be a multiple of 16, got {p.in_features}")
    lead = (p.groups, p.out_features) if isinstance(p, GroupedLinear) else (p.out_features,)
    kp, dev = padded_k(p.in_features), p.weight.device if device is None else device
    u8 = dict(dtype=torch.uint8, device=dev)
    form = (Nvfp4Weight(_check_act_quant(act_quant), torch.float32, exact_out=True) if fp32_out
            else Nvfp4Weight(_check_act_quant(act_quant), p.weight.dtype))
    return p.store_(form,
                    dict(weight_packed=torch.zeros(*lead, kp // 2, **u8),
                         weight_scale=torch.zeros(*lead, kp // BLOCK, **u8),
                         weight_global_scale=torch.zeros(lead[:-1], dtype=torch.float32, device=dev)))


def load_nvfp4_(p: Projection, t) -> None:
    """Fill NVFP4 projection p from a canonical NVFP4 tensor t (.packed [..., N, K/2], .scale [..., N, K/16],
    .global_scale: 0-d, grouped [G])."""
    dev = p.weight_packed.device
    packed, scale = repack_weight(t.packed.to(dev), t.scale.to(dev))
    p.weight_packed.copy_(packed)
    p.weight_scale.copy_(scale)
    p.weight_global_scale.copy_(t.global_scale.reshape(p.weight_global_scale.shape))


def dequantized_weight(p: Projection) -> torch.Tensor:
    """NVFP4 projection p's weight in fp32, in the float layout ([N, K]; grouped [G * R, K])."""
    return dequantize_kernel_layout(p.weight_packed, p.weight_scale, p.weight_global_scale,
                                    p.in_features).reshape(-1, p.in_features)


def nvfp4_linear(weight: torch.Tensor, act_quant: str = "none", out_dtype: torch.dtype = torch.bfloat16) -> Linear:
    """A Linear holding float weight [N, K] quantized to NVFP4 (post-training, per-tensor amax)."""
    with torch.device(weight.device):
        lin = Linear(weight.shape[1], weight.shape[0], out_dtype)
    store_nvfp4_(lin, act_quant)
    load_nvfp4_(lin, float_to_nvfp4(weight))
    return lin


def nvfp4_draft_head(head: Linear) -> Linear:
    """An NVFP4 copy of the model's head for the drafters (transformer.attach_draft_head): the W4A16 product's fp32
    sums as fp32 logits, from the head's float weight (a quarter of its bf16 bytes; head_nvfp4's post-training
    quantization). The float weight is not copied: the copy's float side is never allocated."""
    if is_nvfp4(head):
        raise ValueError("the head is NVFP4 already: draft with it as it is")
    w = head.weight.detach()
    with torch.device("meta"):
        lin = Linear(head.in_features, head.out_features, torch.float32)
    store_nvfp4_(lin, fp32_out=True, device=w.device)
    load_nvfp4_(lin, head_nvfp4(w))
    return lin


def head_nvfp4(w: torch.Tensor) -> Nvfp4Tensor:
    """A head's float weight [V, dim] in NVFP4: each block's scale for the least squared error
    (nvfp4.quantize_weight_mse; on the built-in model's held-out text it agrees with the stored head's top-1 more
    often than ModelOpt's amax scales: bench/RESULTS.md session 36)."""
    return Nvfp4Tensor(*quantize_weight_mse(w))


def quantize_head_(head: Linear) -> None:
    """The model's head itself to NVFP4 in place (W4A16, fp32 logits from the op's sums; its float weight freed): a
    quarter of its bytes per decode step, at some accuracy (head_nvfp4's scales; bench/RESULTS.md session 36: the
    built-in model's greedy token changes at ~5% of positions, perplexity within 0.3%)."""
    if is_nvfp4(head):
        return
    w = store_nvfp4_(head, fp32_out=True)["weight"]
    load_nvfp4_(head, head_nvfp4(w.detach()))


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

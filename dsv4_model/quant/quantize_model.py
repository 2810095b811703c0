"""Convert a `Transformer` to NVFP4 weights in place (W4A16, or W4A4 with act_quant="nvfp4"): each converted
projection keeps its module and stores its weight as NVFP4 (`Nvfp4Weight` of dsv4_model.quant.nvfp4_modules);
each converted MoE swaps its experts backend for the NVFP4 one.

Converted (the weight bytes that dominate decode):
- attention: wq_a, wq_b, wkv, wo_b -> NVFP4 (W4A16 wq_a + wkv run as one dsv4::nvfp4_linear_multi
  call, at decode with the fp32-math projections of the same x as one dsv4::nvfp4_fp32_linear_multi, and at
  decode wq_b + the indexer's wq_b as another: `model.layers.project`, `project_with_fp32`); wo_a (a grouped einsum, G
  groups of [R, H*D/G]) -> NVFP4 grouped, one dsv4::nvfp4_linear_grouped call, one global scale per group
  (official runs wo_a in bf16 because it has no grouped FP8 kernel; at 8192x4096 per layer it is as large as the
  activated experts, so it is worth 4 bits); indexer.wq_b -> NVFP4;
- MoE: routed experts + shared expert -> ONE `Nvfp4MoE` (dsv4::nvfp4_moe, shared expert fused), one global
  scale per expert shared by w1 and w3.
Kept as they are (bf16 / fp32, as in the official numerics):
- embed (a gather, no GEMM) and head (fp32 logits; precision-sensitive, 1 row per token of a 129k vocab);
- every RMSNorm weight, mHC parameters (hc_*_fn/base/scale; fp32 in the release), attn_sink;
- the router gate weight (fp32 logits decide expert selection) and its bias / tid2eid;
- compressors (wkv / wgate run in fp32, ape fp32) and indexer weights_proj ([H_I, dim], tiny; scales scores);
- MTP e_proj / h_proj (not on the decode path yet), and DSpark's main_proj (its context projection, read once per
  committed position; the DSpark stages' attention and MoE convert as the main layers').

Activations: W4A16 feeds bf16 activations. W4A4 (act_quant="nvfp4") quantizes each token's activation row to
NVFP4 with its own global scale (dsv4::fused_amax_quantize_per_row, so results do not depend on the other rows
of a batch), runs dsv4::nvfp4_linear_w4a4 with global scale 1 into fp32 and applies the row's global scale
before the single rounding to the output dtype. In the MoE only the expert INPUT is NVFP4-quantized (quantize ->
dequantize to bf16, one extra bf16 rounding); the SwiGLU output h feeding w2 stays bf16 inside dsv4::nvfp4_moe.

Every converted module returns the dtype of its float weight (the model dtype), so fp32 test models work.
The decode path stays torch.compile(fullgraph=True)-friendly: only dsv4 ops with fakes, static shapes.

Entry points: `quantize_model_(model, act_quant)` (from the model's float weights), `convert_structure_` +
`fill_unit_` (the loader: empty storage first, then filled from checkpoint sources without materializing
float weights), `dequantize_model_(model)` (back to float weights: the dequantized values).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from dsv4_model.model.attention import Attention
from dsv4_model.model.layers import FLOAT, GroupedLinear, is_float_linear
from dsv4_model.model.moe import Expert, Experts, FloatExperts, MoE
from dsv4_model.quant.nvfp4 import BLOCK, CODE_CHUNK_BYTES, SCALE_CHUNK_BYTES, tile_major
from dsv4_model.quant.nvfp4_modules import (ACT_QUANT_MODES, Nvfp4Experts, Nvfp4MoE, dequantized_weight, is_nvfp4,
                                            load_nvfp4_, store_nvfp4_)
from dsv4_model.quant.nvfp4_convert import float_to_nvfp4, gate_up_to_nvfp4, to_float, to_nvfp4

QUANT_MODES = ("none", "nvfp4")
# Converted checkpoints store the kernel layout of dsv4_model.quant.nvfp4 (repack_weight); bump when it changes.
# Version 1 (row-major tiles) still loads: upgrade_kernel_layout_ reorders its buffers.
KERNEL_LAYOUT_VERSION = 2
KERNEL_LAYOUT_VERSIONS = (1, 2)
_KERNEL_BUFFERS = (("weight_packed", "weight_scale"), ("w13_packed", "w13_scale"), ("w2_packed", "w2_scale"),
                   ("shared_w13_packed", "shared_w13_scale"), ("shared_w2_packed", "shared_w2_scale"))
QUANT_INFO_KEY = "dsv4_quant"


def check_modes(quant: str, act_quant: str) -> None:
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")
    if act_quant != "none" and quant == "none":
        raise ValueError("act_quant='nvfp4' needs quant='nvfp4' (W4A4 runs on NVFP4 weights)")


# ---------------------------------------------------------------------------------------------- units
@dataclass
class QuantUnit:
    """One converted module. `sources`: role -> name of the float tensor it replaces in the unconverted model's
    state_dict (routed-expert roles "w1"/"w2"/"w3" name the stacked [E, ...] tensors). `old`: those float tensors
    by state_dict name (None once filled)."""

    name: str
    kind: str  # "linear" | "grouped" | "moe"
    sources: dict[str, str]
    old: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _linear_ok(lin: nn.Module) -> bool:
    return lin.in_features % BLOCK == 0


def find_units(model: nn.Module) -> list[QuantUnit]:
    """The modules `convert_structure_` converts (float ones only), in state_dict order."""
    units = []
    skipped = []
    for name, mod in model.named_modules():
        if isinstance(mod, Attention):
            for attr in ("wq_a", "wq_b", "wkv", "wo_b"):
                lin = getattr(mod, attr)
                if is_float_linear(lin):
                    (units.append(QuantUnit(f"{name}.{attr}", "linear", {"weight": f"{name}.{attr}.weight"}))
                     if _linear_ok(lin) else skipped.append(f"{name}.{attr}"))
            if isinstance(mod.wo_a, GroupedLinear) and mod.wo_a.form is FLOAT:
                (units.append(QuantUnit(f"{name}.wo_a", "grouped", {"weight": f"{name}.wo_a.weight"}))
                 if _linear_ok(mod.wo_a) else skipped.append(f"{name}.wo_a"))
            if mod.indexer is not None and is_float_linear(mod.indexer.wq_b):
                (units.append(QuantUnit(f"{name}.indexer.wq_b", "linear", {"weight": f"{name}.indexer.wq_b.weight"}))
                 if _linear_ok(mod.indexer.wq_b) else skipped.append(f"{name}.indexer.wq_b"))
        elif isinstance(mod, MoE) and not mod.backend.quantized:
            inter = mod.experts.w1.shape[1]
            s_inter = mod.shared_experts.w1.out_features
            if mod.dim % BLOCK or inter % BLOCK or s_inter % BLOCK:
                skipped.append(f"{name}.experts")
                continue
            src = {r: f"{name}.experts.{r}" for r in ("w1", "w2", "w3")}
            src.update({f"shared_{r}": f"{name}.shared_experts.{r}.weight" for r in ("w1", "w2", "w3")})
            units.append(QuantUnit(name, "moe", src))
    if skipped:
        warnings.warn(f"NVFP4: dimensions not multiples of 16, kept in float: {', '.join(skipped)}", stacklevel=2)
    return units


def convert_structure_(model: nn.Module, act_quant: str = "none") -> list[QuantUnit]:
    """Store every convertible weight as EMPTY NVFP4 buffers on the same device (meta stays meta) and return the
    units, each holding the float tensors it replaced in `old`. Marks `model.quant_info`."""
    check_modes("nvfp4", act_quant)
    units = find_units(model)
    for u in units:
        mod = _get(model, u.name)
        if u.kind in ("linear", "grouped"):
            u.old = {f"{u.name}.{n}": t for n, t in store_nvfp4_(mod, act_quant).items()}
        else:
            ex, sh = mod.experts, mod.shared_experts
            E, inter, dim = ex.w1.shape
            new = Nvfp4MoE(E, dim, inter, sh.w1.out_features, ex.limit, ex.w1.dtype, act_quant, device=ex.w1.device)
            old = nn.ModuleDict(mod.swap_backend_(Nvfp4Experts(), {"nvfp4": new}))
            u.old = dict(old.named_parameters(prefix=u.name))
    model.quant_info = {"method": "nvfp4", "act_quant": act_quant, "kernel_layout": KERNEL_LAYOUT_VERSION}
    return units


@torch.no_grad()
def upgrade_kernel_layout_(model: nn.Module, version: int) -> None:
    """NVFP4 buffers loaded from a checkpoint of kernel layout `version` -> the current layout, in place."""
    if version == KERNEL_LAYOUT_VERSION:
        return
    if version != 1:
        raise ValueError(f"kernel layout version {version!r}: cannot upgrade (known: {KERNEL_LAYOUT_VERSIONS})")
    for mod in model.modules():
        if not (is_nvfp4(mod) or isinstance(mod, Nvfp4MoE)):
            continue
        for packed, scale in _KERNEL_BUFFERS:
            if getattr(mod, packed, None) is not None:
                getattr(mod, packed).copy_(tile_major(getattr(mod, packed), CODE_CHUNK_BYTES))
                getattr(mod, scale).copy_(tile_major(getattr(mod, scale), SCALE_CHUNK_BYTES))


Getter = Callable[[str, "int | None"], object]


@torch.no_grad()
def fill_unit_(model: nn.Module, unit: QuantUnit, get: Getter) -> None:
    """Fill a converted unit from sources: `get(name, index)` returns the float tensor / `Mxfp4Tensor` /
    `Nvfp4Tensor` stored under the unconverted model's state_dict `name` (expert `index` of a stacked one)."""
    if unit.kind == "linear":
        load_nvfp4_(_get(model, unit.name), to_nvfp4(get(unit.sources["weight"], None), name=unit.name))
    elif unit.kind == "grouped":
        mod = _get(model, unit.name)
        w = to_float(get(unit.sources["weight"], None))
        load_nvfp4_(mod, float_to_nvfp4(w.view(mod.groups, mod.out_features, mod.in_features)))
    else:
        moe = _get(model, unit.name).nvfp4
        s = unit.sources
        for e in range(moe.n_experts):
            w13 = gate_up_to_nvfp4(get(s["w1"], e), get(s["w3"], e), name=f"{unit.name}.experts.{e}.w1/w3")
            moe.load_expert_(e, w13, to_nvfp4(get(s["w2"], e), name=f"{unit.name}.experts.{e}.w2"))
        moe.load_shared_(gate_up_to_nvfp4(get(s["shared_w1"], None), get(s["shared_w3"], None),
                                          name=f"{unit.name}.shared_experts.w1/w3"),
                         to_nvfp4(get(s["shared_w2"], None), name=f"{unit.name}.shared_experts.w2"))
    unit.old = None


@torch.no_grad()
def quantize_model_(model: nn.Module, act_quant: str = "none") -> nn.Module:
    """Convert `model` (float weights, any device) to NVFP4 in place (post-training, per-tensor amax global
    scales; w1/w3 of an expert share one). Returns the model. An attached DSpark module (`model.dspark`, not a
    submodule: docs/dspark.md) is converted too, as the loader converts it."""
    if getattr(model, "quant_info", None):
        raise ValueError("model is already NVFP4-converted")
    units = convert_structure_(model, act_quant)
    for u in units:
        def get(name, index, params=u.old):
            t = params[name]
            return t if index is None else t[index]

        fill_unit_(model, u, get)
    dspark = getattr(model, "dspark", None)
    if dspark is not None and not getattr(dspark, "quant_info", None):
        quantize_model_(dspark, act_quant)
    return model


@torch.no_grad()
def dequantize_model_(model: nn.Module) -> nn.Module:
    """Inverse of the conversion: NVFP4 weights -> float weights (model dtype) holding the dequantized values, so
    the result computes with exactly the NVFP4 weight values (rounded once to the model dtype)."""
    for name, mod in list(model.named_modules()):
        if is_nvfp4(mod):
            mod.store_(FLOAT, {"weight": dequantized_weight(mod).to(mod.form.out_dtype)})
        elif isinstance(mod, MoE) and mod.backend.quantized:
            q = mod.nvfp4
            with torch.device("meta"):  # the dequantized tensors replace the parameters
                ex = Experts(q.n_experts, q.dim, q.inter, q.swiglu_limit, q.out_dtype)
            for r, w in zip(("w1", "w2", "w3"), q.dequantized_experts()):
                setattr(ex, r, nn.Parameter(w.to(q.out_dtype), requires_grad=False))
            sh = Expert(q.dim, q.shared_inter, q.out_dtype, q.swiglu_limit)
            for r, w in zip(("w1", "w2", "w3"), q.dequantized_shared()):
                getattr(sh, r).weight.data = w.to(q.out_dtype)
            mod.swap_backend_(FloatExperts(), {"experts": ex, "shared_experts": sh})
    model.quant_info = None
    if getattr(model, "dspark", None) is not None:  # the attached DSpark module (not a submodule) too
        dequantize_model_(model.dspark)
    return model

"""Random models: `init_random_weights` fills a float model (tests, small benchmarks); the rest builds models of any
size directly on their device (benchmarks at real sizes without a checkpoint).

`random_nvfp4_model` stores the NVFP4 weights first (`convert_structure_` on the meta device) and fills them with
random E2M1 codes and block scales, so no float copy of a converted weight ever exists (a full-width V4-Flash layer
stack holds ~0.56 bytes per weight); everything else gets O(1)-activation float values (`randomize_floats_`).
A weight is code x block scale 1 x global scale 1 / (rms(code) sqrt(K)): entries of rms 1 / sqrt(K), as a
N(0, 1/K) float init gives.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

from dsv4_model.model.compressor import Compressor
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.nvfp4 import BLOCK, TILE, repack_weight
from dsv4_model.quant.nvfp4_modules import Nvfp4MoE, is_nvfp4
from dsv4_model.quant.quantize_model import convert_structure_

# E2M1 magnitudes of codes 0..7 (bit 3 is the sign): a uniformly random byte's code has this rms.
CODE_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)
BLOCK_ELEMS = 2**22  # weights repacked at a time: the repack's per-code int64 intermediates stay ~32 MB each


@torch.no_grad()
def init_random_weights(model: Transformer, seed: int = 0) -> Transformer:
    """Deterministic random weights with O(1) activations for a float model, from a CPU generator (the tests' and
    the small benchmarks' model; the same values on every device). Returns the model."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * rnd(*p.shape)
        elif "_scale" in leaf:
            v = 0.5 + torch.rand(*p.shape, generator=g)
        elif "_base" in leaf or leaf in ("ape", "bias"):
            v = 0.3 * rnd(*p.shape)
        elif leaf == "attn_sink":
            v = rnd(*p.shape)
        elif name == "embed.weight":
            v = rnd(*p.shape)
        else:
            v = rnd(*p.shape) / math.sqrt(p.shape[-1])
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            V, k = b.shape
            perm = torch.rand(V, model.config.n_routed_experts, generator=g).argsort(dim=-1)[:, :k]
            b.copy_(perm)
    return model


@torch.no_grad()
def randomize_floats_(module: nn.Module, seed: int, n_experts: int) -> None:
    """O(1)-activation random values for every float parameter (norms ~1, mHC scales ~1, projections
    N(0, 1 / fan_in)) and the router's buffers, generated on the module's device (no host round trip)."""
    device = next(module.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if re.search(r"norm\.weight$|layernorm\.weight$", name):
            p.normal_(1.0, 0.1, generator=g)
        elif "scale" in leaf:
            p.uniform_(0.5, 1.5, generator=g)
        elif "base" in leaf or leaf in ("ape", "bias", "position_bias"):
            p.normal_(0.0, 0.3, generator=g)
        elif leaf in ("attn_sink", "sinks") or "embed" in name:
            p.normal_(0.0, 1.0, generator=g)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    for name, b in module.named_buffers():
        if name.endswith("tid2eid"):
            V, k = b.shape
            b.copy_(torch.rand(V, n_experts, device=b.device, generator=g).argsort(dim=-1)[:, :k])
        elif name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.3, generator=g)


@torch.no_grad()
def bf16_released_values_(model: nn.Module) -> None:
    """Round the fp32 weights the checkpoints store in bf16 (the compressors' projections, the head) to bf16
    values, so that the loader's narrow_weights_ holds them in bf16 as it does a released checkpoint's."""
    ws = [w for mod in model.modules() if isinstance(mod, Compressor) for w in (mod.wkv.weight, mod.wgate.weight)]
    if hasattr(model, "head"):
        ws.append(model.head.weight)
    for w in ws:
        w.copy_(w.to(torch.bfloat16))


def _random_nvfp4_(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, k: int,
                   g: torch.Generator, slice_seed=None) -> None:
    """Fill kernel-layout buffers [..., N, Kp/2] / [..., N, Kp/16] with random codes, block scales 1 and the
    global scale for rms 1 / sqrt(k). One leading slice and ~BLOCK_ELEMS weights at a time, so the repack's
    intermediates stay small (a whole 4096 x 8192 matrix's reach 1.2 GB); a block of whole 16-row tiles of the
    kernel layout repacks on its own. slice_seed(i): g is reseeded with it before leading slice i (routed
    experts: each expert's codes from its own seed)."""
    lead = packed.shape[:-2]
    flat_p, flat_s = packed.view(-1, *packed.shape[-2:]), scale.view(-1, *scale.shape[-2:])
    n = packed.shape[-2]
    rows = max(TILE, BLOCK_ELEMS // k // TILE * TILE)
    for i in range(flat_p.shape[0]):
        if slice_seed is not None:
            g.manual_seed(slice_seed(i))
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            codes = torch.randint(0, 256, (r1 - r0, k // 2), dtype=torch.uint8, device=packed.device, generator=g)
            ones = torch.ones(r1 - r0, k // BLOCK, device=packed.device).to(torch.float8_e4m3fn)
            kp, ks = repack_weight(codes, ones)
            flat_p[i, r0:r1].copy_(kp)
            flat_s[i, r0:r1].copy_(ks)
    global_scale.copy_(torch.full(lead, 1.0 / (CODE_RMS * math.sqrt(k))))


@torch.no_grad()
def randomize_nvfp4_(model: nn.Module, seed: int, routed_seed: int | None = None) -> None:
    """Random codes in every NVFP4 module of `model` (see `_random_nvfp4_`). Each routed expert draws from a
    generator seeded by (`routed_seed` (default seed + 1), its MoE's place in the model, its global index, the
    projection), so a rank of an expert-parallel build holds exactly its slice of the single-process model's
    experts, and every replicated weight gets the same codes on every rank."""
    from dsv4_model.model.moe import MoE

    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    g_routed = torch.Generator(device=device)
    base = seed + 1 if routed_seed is None else routed_seed
    first = {id(m.nvfp4): m.expert_start for m in model.modules() if isinstance(m, MoE) and hasattr(m, "nvfp4")}
    ordinal = 0
    for mod in model.modules():
        if is_nvfp4(mod):
            _random_nvfp4_(mod.weight_packed, mod.weight_scale, mod.weight_global_scale, mod.in_features, g)
        elif isinstance(mod, Nvfp4MoE):
            start, ordinal = first.get(id(mod), 0), ordinal + 1
            for j, (p, k) in enumerate((("w13", mod.dim), ("w2", mod.inter))):
                _random_nvfp4_(getattr(mod, f"{p}_packed"), getattr(mod, f"{p}_scale"),
                               getattr(mod, f"{p}_global_scale"), k, g_routed,
                               slice_seed=lambda e, j=j, o=ordinal: _expert_seed(base, o, start + e, j))
            if mod.shared_inter:
                for p, k in (("shared_w13", mod.dim), ("shared_w2", mod.shared_inter)):
                    _random_nvfp4_(getattr(mod, f"{p}_packed"), getattr(mod, f"{p}_scale"),
                                   getattr(mod, f"{p}_global_scale"), k, g)


def _expert_seed(base: int, moe: int, expert: int, proj: int) -> int:
    """A routed expert's seed: distinct for every (base, MoE, expert, projection) a model has."""
    return (((base * 4099 + moe) * 65537 + expert) * 2 + proj) % (2**63)


def random_nvfp4_model(cfg: ModelConfig, *, device, max_batch_size: int = 1, max_seq_len: int = 4096,
                       dtype: torch.dtype = torch.bfloat16, act_quant: str = "none", seed: int = 0,
                       expert_shard=None, spare_window_slots: int = 0) -> Transformer:
    """A `Transformer` of `cfg` with random NVFP4 weights (what `quantize_model_` converts) and random floats,
    built on `device` without a float copy of any converted weight; ready to prefill / decode. expert_shard (a
    `dsv4_model.model.parallel.ExpertShard`): only this rank's routed experts are built (the single-process model's
    slice of them, code for code), every other weight the same on every rank. spare_window_slots: as
    Transformer's (speculative decoding)."""
    device = torch.device(device)
    model = Transformer(cfg, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, device="meta",
                        spare_window_slots=spare_window_slots)
    for unit in convert_structure_(model, act_quant):
        unit.old = None  # the meta float weights: never materialized
    if expert_shard is not None:
        model.shard_experts_(expert_shard)
    # the weights the loader holds in bf16 (head, compressors) made bf16 on meta: a full-width fp32 head and its
    # narrowing would add ~4 GB to the build's peak (V4-Flash's 129280 x 4096)
    model.narrow_weights_(lossless=True)
    model.to_empty(device=device)
    randomize_floats_(model, seed, cfg.n_routed_experts)
    randomize_nvfp4_(model, seed + 1, routed_seed=seed + 2)
    model.setup_runtime(device)
    model.reset_caches()
    return model.eval()


def random_nvfp4_dspark(cfg: ModelConfig, *, device, max_batch_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                        act_quant: str = "none", seed: int = 100, expert_shard=None):
    """A DSpark module of `cfg` (cfg.dspark: its stage count given) with random NVFP4 weights, built as
    `random_nvfp4_model` builds the main model (no float copy of a converted weight): what the loader holds for a
    V4-Flash-0731 checkpoint under quant="nvfp4", for benchmarks at full size. Attach it with
    `dsv4_model.model.dspark.attach(model, module)`."""
    from dsv4_model.model.dspark import DSpark

    device = torch.device(device)
    module = DSpark(cfg, dtype=dtype, max_batch_size=max_batch_size, device="meta")
    for unit in convert_structure_(module, act_quant):
        unit.old = None
    if expert_shard is not None:
        module.shard_experts_(expert_shard)
    module.to_empty(device=device)
    randomize_floats_(module, seed, cfg.n_routed_experts)
    randomize_nvfp4_(module, seed + 1, routed_seed=seed + 2)
    module.setup_runtime(device)
    return module.eval()

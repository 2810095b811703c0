"""Write random tiny checkpoints in the layouts the loader reads (hf / official / dsv4, and modelopt).

All are written from the same "canonical" weights: random values that have already been
rounded to what the official release would store (FP8 128x128-block or MXFP4 values for quantized
tensors, bf16 for bf16 tensors, fp32 for fp32 ones). The official layout stores them quantized,
the hf and dsv4 layouts store the dequantized values (exact in bf16), so every layout loads to
bit-identical weights.

"modelopt" mimics NVIDIA's ModelOpt NVFP4 release of V4: the official layout, except that the main
model's routed experts are NVFP4 (`.weight` packed uint8 [N, K/2], `.weight_scale` E4M3 [N, K/16],
`.weight_scale_2` fp32 0-d, `.input_scale` fp32 0-d), converted LOSSLESSLY from their MXFP4 values
(dsv4_model.quant.nvfp4_convert.mxfp4_to_nvfp4, one power-of-two global scale per tensor, so w1 and w3 of an expert
may differ by a power of two); MTP experts stay MXFP4. It loads to the same weights as the other layouts.
Config: an HF `config.json` (base `quant_method` fp8) and an `hf_quant_config.json`.

A config with a `dspark` (DSparkConfig) gets the 0731 release's DSpark module instead of an MTP block: its stages
under `mtp.*` (MXFP4 experts in every layout but HF, which leaves `mtp.*` out) and the release's config keys
(docs/dspark.md).

Tensor names and shapes come from the release's spec (written out below), not from the model code, so loading a written
checkpoint also checks the model's parameter shapes against the spec.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import torch

from dsv4_model.checkpoint.io import write_shards, write_sharded
from dsv4_model.checkpoint.dspark import dspark_extra_shapes, stage_ratios as dspark_stage_ratios
from dsv4_model.checkpoint.names import official_storage, official_to_hf_name, split_expert_name
from dsv4_model.checkpoint.loader import DSV4_FORMAT_KEY, DSV4_FORMAT_VERSION, LAYOUTS
from dsv4_model.quant.nvfp4_convert import mxfp4_to_nvfp4
from dsv4_model.quant.formats import FP8_BLOCK, dequant_fp8_blocks, dequant_mxfp4, quant_fp8_blocks, quant_mxfp4

# Covers SWA-only (L0), CSA (L1, L3) and HCA (L2, L4) layers, hash (L0-1) and learned (L2-4) MoE,
# 8 indexer heads, an SWA-only MTP block; wq_b / wo_a span several (partial) 128x128 FP8 blocks.
TINY_CONFIG = dict(
    vocab_size=96, dim=64, n_layers=5, n_heads=4, head_dim=80, rope_head_dim=16, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, window_size=16, compress_ratios=[0, 4, 16, 4, 16, 0],
    index_n_heads=8, index_head_dim=32, index_topk=4, moe_inter_dim=32, n_routed_experts=8,
    n_shared_experts=1, n_activated_experts=2, n_hash_layers=2, n_mtp_layers=1, hc_mult=4,
    max_position_embeddings=4096,
)

CONFIGS = {"tiny": TINY_CONFIG}

WRITER_LAYOUTS = LAYOUTS + ("modelopt",)

# what ModelOpt's hf_quant_config.json says for the V4 NVFP4 release (exact extra fields unverified)
MODELOPT_QUANT_CONFIG = {"producer": {"name": "modelopt"},
                         "quantization": {"quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4",
                                          "group_size": 16, "kv_cache_quant_algo": None}}

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic"}


def make_config(name: str = "tiny", **overrides):
    from dsv4_model.model.config import ModelConfig

    return ModelConfig(**{**CONFIGS[name], **overrides}).validate()


def official_tensor_specs(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """{official name (per-expert form): (shape, storage)} for `cfg`, in a fixed order."""
    d, hc, H, D = cfg.dim, cfg.hc_mult, cfg.n_heads, cfg.head_dim
    mix = (2 + hc) * hc
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, d),
        "head.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }

    def block(p: str, ratio: int, hash_routed: bool):
        for site in ("attn", "ffn"):
            shapes[f"{p}hc_{site}_fn"] = (mix, hc * d)
            shapes[f"{p}hc_{site}_base"] = (mix,)
            shapes[f"{p}hc_{site}_scale"] = (3,)
        shapes[f"{p}attn_norm.weight"] = (d,)
        shapes[f"{p}ffn_norm.weight"] = (d,)
        a = p + "attn."
        shapes[a + "attn_sink"] = (H,)
        shapes[a + "wq_a.weight"] = (cfg.q_lora_rank, d)
        shapes[a + "q_norm.weight"] = (cfg.q_lora_rank,)
        shapes[a + "wq_b.weight"] = (H * D, cfg.q_lora_rank)
        shapes[a + "wkv.weight"] = (D, d)
        shapes[a + "kv_norm.weight"] = (D,)
        shapes[a + "wo_a.weight"] = (cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups)
        shapes[a + "wo_b.weight"] = (d, cfg.o_groups * cfg.o_lora_rank)
        if ratio:
            c = 2 if ratio == 4 else 1
            shapes[a + "compressor.ape"] = (ratio, c * D)
            shapes[a + "compressor.wkv.weight"] = (c * D, d)
            shapes[a + "compressor.wgate.weight"] = (c * D, d)
            shapes[a + "compressor.norm.weight"] = (D,)
        if ratio == 4:
            Di, Hi = cfg.index_head_dim, cfg.index_n_heads
            shapes[a + "indexer.wq_b.weight"] = (Hi * Di, cfg.q_lora_rank)
            shapes[a + "indexer.weights_proj.weight"] = (Hi, d)
            shapes[a + "indexer.compressor.ape"] = (4, 2 * Di)
            shapes[a + "indexer.compressor.wkv.weight"] = (2 * Di, d)
            shapes[a + "indexer.compressor.wgate.weight"] = (2 * Di, d)
            shapes[a + "indexer.compressor.norm.weight"] = (Di,)
        f = p + "ffn."
        shapes[f + "gate.weight"] = (cfg.n_routed_experts, d)
        if hash_routed:
            shapes[f + "gate.tid2eid"] = (cfg.vocab_size, cfg.n_activated_experts)
        else:
            shapes[f + "gate.bias"] = (cfg.n_routed_experts,)
        inter = cfg.moe_inter_dim
        for e in range(cfg.n_routed_experts):
            shapes[f"{f}experts.{e}.w1.weight"] = (inter, d)
            shapes[f"{f}experts.{e}.w2.weight"] = (d, inter)
            shapes[f"{f}experts.{e}.w3.weight"] = (inter, d)
        shared = inter * cfg.n_shared_experts
        shapes[f + "shared_experts.w1.weight"] = (shared, d)
        shapes[f + "shared_experts.w2.weight"] = (d, shared)
        shapes[f + "shared_experts.w3.weight"] = (shared, d)

    for i in range(cfg.n_layers):
        block(f"layers.{i}.", cfg.compress_ratios[i], i < cfg.n_hash_layers)
    for j in range(cfg.n_mtp_layers):
        p = f"mtp.{j}."
        shapes[p + "e_proj.weight"] = (d, d)
        shapes[p + "h_proj.weight"] = (d, d)
        shapes[p + "enorm.weight"] = (d,)
        shapes[p + "hnorm.weight"] = (d,)
        shapes[p + "norm.weight"] = (d,)
        shapes[p + "hc_head_fn"] = (hc, hc * d)
        shapes[p + "hc_head_base"] = (hc,)
        shapes[p + "hc_head_scale"] = (1,)
        block(p, cfg.compress_ratios[cfg.n_layers + j], False)
    if cfg.dspark is not None:  # the 0731 release's DSpark module (docs/dspark.md)
        n = cfg.dspark.n_stages or 3
        for j, ratio in enumerate(dspark_stage_ratios(cfg, n)):
            block(f"mtp.{j}.", ratio, False)
        shapes.update(dspark_extra_shapes(cfg, n))
    return {k: (v, official_storage(k)) for k, v in shapes.items()}


def _random_value(name: str, shape: tuple[int, ...], g: torch.Generator, cfg) -> torch.Tensor:
    def randn(*s):
        return torch.randn(*s, generator=g, device=g.device)

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        rows = [torch.randperm(cfg.n_routed_experts, generator=g, device=g.device)[: shape[1]]
                for _ in range(shape[0])]
        return torch.stack(rows).to(torch.int64)
    if "norm" in name and leaf == "weight":
        return 1.0 + 0.1 * randn(*shape)
    if leaf.endswith("_fn"):
        return randn(*shape) * (0.5 / math.sqrt(shape[-1]))
    if leaf.endswith("_base"):
        return 0.5 * randn(*shape)
    if leaf.endswith("_scale"):
        return 0.5 + 0.1 * randn(*shape)
    if leaf == "attn_sink":
        return randn(*shape)
    if leaf == "ape":
        return 0.5 * randn(*shape)
    if name.endswith("gate.bias"):
        return 0.05 * randn(*shape)
    if name == "embed.weight":
        return randn(*shape)
    return randn(*shape) / math.sqrt(shape[-1])


def canonical_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights (official per-expert names) already rounded to their release storage format:
    FP8/MXFP4 tensors hold their dequantized values in bf16, bf16 tensors bf16, fp32 tensors fp32."""
    return dict(iter_canonical_weights(cfg, seed))


def iter_canonical_weights(cfg, seed: int = 0, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """canonical_weights one tensor at a time (the same values: one generator, the same order), made on `device`
    (another device's generator draws other values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    for name, (shape, storage) in official_tensor_specs(cfg).items():
        w = _random_value(name, shape, g, cfg)
        if storage == "fp8":
            w = dequant_fp8_blocks(*quant_fp8_blocks(w), dtype=torch.bfloat16)
        elif storage == "fp4":
            w = dequant_mxfp4(*quant_mxfp4(w), dtype=torch.bfloat16)
        elif storage == "bf16":
            w = w.to(torch.bfloat16)
        elif storage == "f32":
            w = w.to(torch.float32)
        yield name, w


def official_tensors(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Release storage of canonical weights: FP8 / MXFP4 codes + `.scale` E8M0 for quantized tensors."""
    out = []
    for name, w in weights.items():
        storage = official_storage(name)
        if storage in ("fp8", "fp4"):
            q, s = (quant_fp8_blocks if storage == "fp8" else quant_mxfp4)(w.float())
            out.append((name, q))
            out.append((name[: -len("weight")] + "scale", s))
        else:
            out.append((name, w))
    return out


def _modelopt_nvfp4(name: str) -> bool:
    return split_expert_name(name) is not None and not name.startswith("mtp.")


def modelopt_tensors(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Official storage with the main model's routed experts as ModelOpt NVFP4 (lossless from MXFP4)."""
    out = []
    for name, w in weights.items():
        if not _modelopt_nvfp4(name):
            out += official_tensors({name: w})
            continue
        base = name[: -len("weight")]
        q = mxfp4_to_nvfp4(*quant_mxfp4(w.float()), name=name)
        amax = w.float().abs().amax()
        out += [(name, q.packed), (base + "weight_scale", q.scale), (base + "weight_scale_2", q.global_scale),
                (base + "input_scale", (amax / 2688).reshape(()))]
    return out


def hf_tensors(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """transformers `save_pretrained` names; HF has no MTP module, so `mtp.*` is left out."""
    return [(official_to_hf_name(n), w) for n, w in weights.items() if not n.startswith("mtp.")]


def dsv4_tensors(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Model state_dict names: routed experts stacked into `...ffn.experts.w{1,2,3}` [E, ...]."""
    out: list = []
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in weights.items():
        split = split_expert_name(name)
        if split is None:
            out.append((name, w))
            continue
        stacked, e = split
        if stacked not in experts:
            experts[stacked] = {}
            out.append((stacked, experts[stacked]))
        experts[stacked][e] = w
    return [(n, torch.stack([w[e] for e in sorted(w)]) if isinstance(w, dict) else w) for n, w in out]


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_checkpoint(weights: dict[str, torch.Tensor], cfg, out_dir: str | os.PathLike, layout: str, *,
                     num_shards: int = 1) -> Path:
    """Write canonical `weights` (official per-expert names) + config files in `layout`."""
    if layout not in WRITER_LAYOUTS:
        raise ValueError(f"layout must be one of {WRITER_LAYOUTS}, got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if layout == "dsv4":
        write_sharded(dsv4_tensors(weights), out, num_shards=num_shards,
                      metadata={DSV4_FORMAT_KEY: str(DSV4_FORMAT_VERSION)})
    else:
        write_sharded(_PER_TENSOR[layout](weights), out, num_shards=num_shards)
    _write_configs(out, cfg, layout)
    return out


def write_random_checkpoint(cfg, out_dir: str | os.PathLike, layout: str = "official", *, seed: int = 0,
                            max_shard_bytes: int = 4 << 30, device: str | torch.device = "cpu") -> list[str]:
    """A random checkpoint of any size (a full V4 preset included) in `layout` ("official", "modelopt" or "hf"),
    made and written one tensor at a time: the host holds one shard (max_shard_bytes) and the tensor being made,
    whatever the model's size. On the CPU its weights are canonical_weights(cfg, seed): it loads to the same model
    as write_tiny_checkpoint with that config and seed. `device` makes the values there (faster for real sizes).
    Returns the shard file names."""
    if layout not in _PER_TENSOR:
        raise ValueError(f"layout must be one of {tuple(_PER_TENSOR)} (streamed tensor by tensor), got {layout!r}")
    convert = _PER_TENSOR[layout]
    named = (item for name, w in iter_canonical_weights(cfg, seed, device) for item in convert({name: w}))
    out = Path(out_dir)
    names = write_shards(named, out, max_shard_bytes=max_shard_bytes)
    _write_configs(out, cfg, layout)
    return names


# Layouts whose stored tensors each come from one canonical tensor (dsv4 stacks a layer's experts).
_PER_TENSOR = {"official": official_tensors, "modelopt": modelopt_tensors, "hf": hf_tensors}


def _write_configs(out: Path, cfg, layout: str) -> None:
    # a DSpark release's MTP count keys: the HF config keeps V4-Flash's 1, the inference config counts the stages
    hf_mtp = {} if cfg.dspark is None else {"num_nextn_predict_layers": 1}
    inf_mtp = {} if cfg.dspark is None else {"n_mtp_layers": cfg.dspark.n_stages or 3}
    if layout == "official":
        _write_json(out / "config.json", {**cfg.to_hf_dict(), "quantization_config": QUANTIZATION_CONFIG,
                                          "expert_dtype": "fp4", "dtype": "bfloat16", **hf_mtp})
        _write_json(out / "inference" / "config.json", {**cfg.to_dict(), "dtype": "fp8", "scale_fmt": "ue8m0",
                                                        "expert_dtype": "fp4", "scale_dtype": "fp8",
                                                        "quantization_config": None, **inf_mtp})
    elif layout == "modelopt":
        _write_json(out / "config.json", {**cfg.to_hf_dict(), "quantization_config": QUANTIZATION_CONFIG,
                                          "dtype": "bfloat16", **hf_mtp})
        _write_json(out / "hf_quant_config.json", MODELOPT_QUANT_CONFIG)
    elif layout == "hf":
        _write_json(out / "config.json", {**cfg.to_hf_dict(), "dtype": "bfloat16", "transformers_version": "5.23.0"})
    else:
        _write_json(out / "config.json", {**cfg.to_dict(), DSV4_FORMAT_KEY: DSV4_FORMAT_VERSION})


def write_tiny_checkpoint(out_dir: str | os.PathLike, layout: str, seed: int = 0, config=None, *,
                          num_shards: int = 1):
    """Random tiny checkpoint in `layout`; the same `seed` and `config` give the same weights in every
    layout. `config`: a ModelConfig, a preset name from CONFIGS, or None (= "tiny"). Returns the config."""
    if config is None or isinstance(config, str):
        config = make_config(config or "tiny")
    write_checkpoint(canonical_weights(config, seed), config, out_dir, layout, num_shards=num_shards)
    return config

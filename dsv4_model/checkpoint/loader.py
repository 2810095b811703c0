"""Load a DeepSeek-V4 checkpoint into `dsv4_model.model.Transformer`.

Three layouts (auto-detected, or forced with `layout=`):
- "hf":       transformers `deepseek_v4` (save_pretrained names with `model.` prefix, or in-memory names
              incl. fused `mlp.experts.gate_up_proj`); HF configs in `config.json`.
- "official": the DeepSeek release (`inference/` names, FP8 e4m3 + 128x128 E8M0 scales, MXFP4 routed
              experts); config from `inference/config.json` if present, else `config.json`. NVIDIA ModelOpt
              NVFP4 checkpoints are this layout with NVFP4 routed experts (`.weight` packed uint8 [N, K/2],
              `.weight_scale` E4M3 [N, K/16], `.weight_scale_2` fp32 0-d, optional `.input_scale`, ignored:
              activations are quantized dynamically).
- "dsv4":     this project's own format written by `save_model` (model state_dict names, stacked
              experts, `config.json` = `ModelConfig.to_dict()` + `"dsv4_format": 1`). An NVFP4-converted
              model is saved with its NVFP4 buffers (kernel layout of dsv4_model.quant.nvfp4, see
              dsv4_model.quant.quantize_model) and `"dsv4_quant": {"method": "nvfp4", "act_quant": ...,
              "kernel_layout": 2}`; it loads back as is, without re-quantizing (a version 1 checkpoint's
              buffers are reordered into the version 2 tiles at load).

quant="nvfp4" (see dsv4_model/quant/quantize_model.py for which layers): the model is converted to NVFP4 on the
meta device BEFORE allocation, so the float weights of converted layers never exist in full; each converted
layer (each expert) is built from its checkpoint tensors as they are read: MXFP4 experts losslessly where
possible, NVFP4 (ModelOpt) experts as stored, FP8 / bf16 tensors quantized per tensor
(dsv4_model/quant/nvfp4_convert.py). A 0731-style checkpoint's DSpark module (`mtp.*`, docs/dspark.md) is built and
filled the same way (its stages' units converted, this rank's experts only under expert parallelism).

The module is built on the meta device; every checkpoint tensor is checked against it from the
safetensors headers alone (names, shapes, dtypes, quantization scales) before any memory is
allocated on the target device. Then each tensor is read lazily (mmap), moved to the device,
dequantized there and copied into its parameter (routed experts into their slot of the stacked
tensor), so no full-size host copy of the model ever exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4_model.checkpoint.io import CheckpointError, TensorInfo, TensorReader, list_tensors, write_sharded
from dsv4_model.checkpoint.hub import display_name
from dsv4_model.checkpoint.memory_plan import GiB, check_fits, memory_plan, meta_dspark
from dsv4_model.checkpoint.tensor_checks import (
    FP8_TAGS, NVFP4_INPUT_SCALE, NVFP4_SCALE, NVFP4_SCALE2, PACKED_FP4_TAGS, check_source, dtype_ok,
    dtype_problem, fmt_shape, source_name,
)
from dsv4_model.checkpoint.tokenizer import TOKENIZER_NAME, load_tokenizer
from dsv4_model.model.checks import check_max_seq_len, check_positive_int, parse_device
from dsv4_model.checkpoint.names import (
    FUSED_W13, checkpoint_key, expert_name, hf_to_official_name, split_expert_name,
)
from dsv4_model.quant.nvfp4_convert import Mxfp4Tensor, Nvfp4Tensor
from dsv4_model.quant.formats import FP4_BLOCK, FP8_BLOCK, dequant_fp8_blocks, dequant_mxfp4
from dsv4_model.quant.quantize_model import (
    ACT_QUANT_MODES, KERNEL_LAYOUT_VERSIONS, QUANT_INFO_KEY, check_modes, convert_structure_, dequantize_model_,
    fill_unit_, upgrade_kernel_layout_,
)

LAYOUTS = ("hf", "official", "dsv4")
DSV4_FORMAT_KEY = "dsv4_format"
DSV4_FORMAT_VERSION = 1

_MAX_LISTED_PROBLEMS = 25


# ---------------------------------------------------------------------------------------------
# Layout and config
# ---------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read config: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: a config must be a JSON object, this one is a {type(d).__name__}")
    return d


def detect_layout(path: str | os.PathLike, tensors: dict[str, TensorInfo] | None = None) -> str:
    """"dsv4" if config.json carries the dsv4 marker, "hf" if tensor names use HF's `model.` prefix or
    `lm_head`, else "official"."""
    root = Path(path)
    cfg = root / "config.json"
    if cfg.is_file() and DSV4_FORMAT_KEY in _read_json(cfg):
        return "dsv4"
    keys = (tensors if tensors is not None else list_tensors(root)).keys()
    if any(k.startswith("model.") or k == "lm_head.weight" for k in keys):
        return "hf"
    return "official"


def config_path_for(path: str | os.PathLike, layout: str) -> Path:
    root = Path(path)
    candidates = [root / "config.json"]
    if layout == "official":
        candidates.insert(0, root / "inference" / "config.json")
    for c in candidates:
        if c.is_file():
            return c
    raise CheckpointError(f"{root}: no config file for layout {layout!r} (looked for {', '.join(map(str, candidates))})")


def refuse_other_architectures(path: str | os.PathLike) -> None:
    """One CheckpointError naming the config file when the checkpoint is a DeepSeek-V4.1 one (docs/v41.md): read
    from the config files alone, before any tensor header."""
    from dsv4_model.model.v41 import v41_refusal

    root = Path(path)
    for cfg_path in (root / "config.json", root / "inference" / "config.json"):
        if cfg_path.is_file():
            refusal = v41_refusal(_read_json(cfg_path))
            if refusal:
                raise CheckpointError(f"{cfg_path}: {refusal}")


def load_config(path: str | os.PathLike, layout: str | None = None):
    """`ModelConfig` of the checkpoint directory `path`."""
    from dsv4_model.model.config import REQUIRED_FIELDS, REQUIRED_INDEXER_FIELDS, ModelConfig

    refuse_other_architectures(path)
    layout = layout or detect_layout(path)
    cfg_path = config_path_for(path, layout)
    raw = _read_json(cfg_path)
    version = raw.get(DSV4_FORMAT_KEY)
    if version is not None and version != DSV4_FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: field {DSV4_FORMAT_KEY!r} is {version!r}, this loader reads version {DSV4_FORMAT_VERSION}")
    try:
        config = ModelConfig.from_dict(raw)
        if (Path(path) / TOKENIZER_NAME).is_file():  # a model with its tokenizer, not a random test one
            config.check_eos_in_vocab()
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid config: {e}") from e
    if cfg_path.parent.name == "inference":
        _warn_config_disagreement(config, cfg_path, Path(path) / "config.json")
    return config


def _warn_config_disagreement(config, used: Path, other: Path) -> None:
    """One warning naming each field where `other` (the top-level config.json beside inference/config.json) gives
    a different value than the config the model is built from; silent when `other` is absent or unreadable."""
    from dsv4_model.model.config import REQUIRED_FIELDS, REQUIRED_INDEXER_FIELDS, ModelConfig
    from dsv4_model.model.dspark_config import DSPARK_KEYS

    if not other.is_file():
        return
    try:  # require=True: a field the other file leaves to its default is not compared against a real value
        theirs = ModelConfig.from_dict(_read_json(other))
    except (CheckpointError, KeyError, TypeError, ValueError):
        return

    def value(cfg, f):  # compress_ratios: the official list also covers the MTP layers, the HF one does not
        v = getattr(cfg, f)
        return list(v[: cfg.n_layers]) if f == "compress_ratios" else v

    # the fields every checkpoint must give (they shape a tensor or the forward); n_mtp_layers is left out: a
    # DSpark release counts its stages in one file and keeps V4-Flash's 1 in the other
    fields = [*REQUIRED_FIELDS, *REQUIRED_INDEXER_FIELDS]
    diffs = [f"{f} {value(config, f)!r} there, {value(theirs, f)!r} in config.json" for f in fields
             if value(config, f) != value(theirs, f)]
    if config.dspark is not None and theirs.dspark is not None:  # the drafter's keys, where both files give them
        for key, f in DSPARK_KEYS.items():
            a, b = getattr(config.dspark, f), getattr(theirs.dspark, f)
            if a != b:
                diffs.append(f"{key} {a!r} there, {b!r} in config.json")
    if diffs:
        warnings.warn(f"{other} disagrees with {used}, which the model is built from: {'; '.join(diffs)}",
                      stacklevel=3)


# ---------------------------------------------------------------------------------------------
# Load plan: which checkpoint tensor goes where, validated from the headers only
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorLoad:
    """One copy: checkpoint tensor `weight` (+ `scale` if quantized) -> `target` parameter, into slot
    `index` of a stacked expert tensor if not None, after the `narrow`s ((dim, start, length) each) in order.
    kind "nvfp4" (ModelOpt): `scale` is `.weight_scale` (E4M3 per 16), `scale2` `.weight_scale_2` (fp32)."""

    target: str
    index: int | None
    weight: TensorInfo
    scale: TensorInfo | None
    kind: str  # "plain" | "fp8" | "fp4" | "nvfp4"
    narrow: tuple[tuple[int, int, int], ...] = ()
    scale2: TensorInfo | None = None


def build_load_plan(tensors: dict[str, TensorInfo], expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    layout: str, *, skip_prefixes: tuple[str, ...] = (), subject: str = "the model") -> list[TensorLoad]:
    """Map checkpoint tensors onto the model's state_dict entries `expected` ({name: (shape, dtype)}) and
    check names, shapes, dtypes and scales. Raises CheckpointError listing every problem."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    to_official = hf_to_official_name if layout == "hf" else (lambda k: k)
    problems: list[str] = []

    official: dict[str, TensorInfo] = {}
    for key, info in tensors.items():
        name = to_official(key)
        if name in official:
            problems.append(f"duplicate tensor: {key!r} and {official[name].key!r} both map to {name!r}")
            continue
        official[name] = info

    # pair `X.scale` (FP8 / MXFP4) or `X.weight_scale` + `X.weight_scale_2` (NVFP4) with `X.weight`
    scales: dict[str, TensorInfo] = {}
    nvfp4_scales: dict[str, dict[str, TensorInfo]] = {}
    weights: dict[str, TensorInfo] = {}
    # scales whose weight is missing (and would be a model tensor): the weight is reported missing, not the scale
    # as unexpected
    orphans: dict[str, TensorInfo] = {}
    for name, info in official.items():
        base, _, leaf = name.rpartition(".")
        wname = base + ".weight"
        split = split_expert_name(wname)
        if leaf == "scale" and wname in official:
            scales[wname] = info
        elif leaf in (NVFP4_SCALE, NVFP4_SCALE2, NVFP4_INPUT_SCALE) and wname in official:
            nvfp4_scales.setdefault(wname, {})[leaf] = info
        elif (leaf in ("scale", NVFP4_SCALE, NVFP4_SCALE2, NVFP4_INPUT_SCALE) and name not in expected
              and (split[0] if split else wname) in expected):
            orphans.setdefault(wname, info)
        else:
            weights[name] = info

    plan: list[TensorLoad] = []
    covered: dict[str, set[int] | None] = {}
    # targets whose tensor is present but wrong: reported once, not again as missing
    rejected: set[tuple[str, int | None]] = set()

    def cover(target: str, index: int | None, what: str) -> bool:
        slots = covered.setdefault(target, set())
        if index is None:
            if slots is None or slots:
                problems.append(f"{what}: {target!r} is provided more than once")
                return False
            covered[target] = None
            return True
        if slots is None or index in slots:
            problems.append(f"{what}: expert {index} of {target!r} is provided more than once")
            return False
        slots.add(index)
        return True

    for name, info in sorted(weights.items()):
        if any(name.startswith(p) for p in skip_prefixes):
            continue
        scale = scales.get(name)
        scale2 = None
        where = source_name(info, name)
        nv = nvfp4_scales.get(name)
        # quantization kind from the stored dtype
        if nv is not None:
            base = name[: -len("weight")]
            missing = [leaf for leaf in (NVFP4_SCALE, NVFP4_SCALE2) if leaf not in nv]
            if scale is not None or missing or info.dtype not in PACKED_FP4_TAGS:
                why = (f"has both {base + 'scale'!r} and NVFP4 scales" if scale is not None else
                       f"NVFP4 scale tensor {base + missing[0]!r} is missing" if missing else
                       f"has NVFP4 scales but dtype {info.dtype} is not packed FP4 (U8/I8)")
                problems.append(f"{where}: {why}")
                rejected.add(split_expert_name(name) or (name, None))
                continue
            kind, scale, scale2 = "nvfp4", nv[NVFP4_SCALE], nv[NVFP4_SCALE2]
        elif scale is None:
            kind = "plain"
            if info.dtype in FP8_TAGS or (layout == "official" and info.dtype in PACKED_FP4_TAGS
                                            and split_expert_name(name)):
                problems.append(f"{where}: dtype {info.dtype} needs a scale tensor {name[:-len('weight')] + 'scale'!r}, which is missing")
                rejected.add(split_expert_name(name) or (name, None))
                continue
        elif info.dtype in FP8_TAGS:
            kind = "fp8"
        elif info.dtype in PACKED_FP4_TAGS:
            kind = "fp4"
        else:
            problems.append(f"{where}: has a scale tensor but dtype {info.dtype} is neither FP8 (F8_E4M3) nor packed FP4 (I8)")
            rejected.add(split_expert_name(name) or (name, None))
            continue

        split = split_expert_name(name)
        if name.endswith("." + FUSED_W13):
            prefix = name[: -len("w13")]
            ok = True
            for part in ("w1", "w3"):
                if prefix + part not in expected:
                    problems.append(f"unexpected tensor {where}: the model has no {prefix + part!r}")
                    ok = False
            if not ok:
                continue
            (e, inter, dim), dtype = expected[prefix + "w1"]
            if kind != "plain":
                problems.append(f"{where}: quantized fused gate_up tensors are not supported")
                continue
            if info.shape != (e, 2 * inter, dim):
                problems.append(f"{where}: shape mismatch: expected {fmt_shape((e, 2 * inter, dim))} (w1 and w3 of "
                                f"{prefix[:-1]!r} concatenated), got {fmt_shape(info.shape)}")
                rejected.update({(prefix + "w1", None), (prefix + "w3", None)})
                continue
            if not dtype_ok(info.dtype, dtype):
                problems.append(dtype_problem(where, dtype, info.dtype))
                rejected.update({(prefix + "w1", None), (prefix + "w3", None)})
                continue
            for i, part in enumerate(("w1", "w3")):
                if cover(prefix + part, None, where):
                    plan.append(TensorLoad(prefix + part, None, info, None, "plain", ((1, i * inter, inter),)))
            continue

        if split is not None:
            target, index = split
            if target not in expected:
                problems.append(f"unexpected tensor {where} (shape {fmt_shape(info.shape)}, dtype {info.dtype}): "
                                f"the model has no {target!r}")
                continue
            full_shape, dtype = expected[target]
            if index >= full_shape[0]:
                problems.append(f"unexpected tensor {where}: expert index {index} out of range, {target!r} holds "
                                f"{full_shape[0]} experts")
                continue
            shape = full_shape[1:]
        else:
            target, index = name, None
            if target not in expected:
                problems.append(f"unexpected tensor {where} (shape {fmt_shape(info.shape)}, dtype {info.dtype}): "
                                f"not a parameter or buffer of the model")
                continue
            shape, dtype = expected[target]

        problem = check_source(where, name, info, scale, kind, shape, dtype, scale2)
        if problem:
            problems.append(problem)
            rejected.add((target, index))
            continue
        if cover(target, index, where):
            plan.append(TensorLoad(target, index, info, scale, kind, scale2=scale2))

    for target, (shape, dtype) in expected.items():
        if any(target.startswith(p) for p in skip_prefixes):
            continue
        slots = covered.get(target, set())
        if slots is None or (target, None) in rejected:
            continue
        if _is_stacked(target, shape):
            missing = [i for i in range(shape[0]) if i not in slots and (target, i) not in rejected]
            keys = _expert_keys(target, missing, layout)
            if missing and len(missing) == shape[0]:
                problems.append(f"missing tensor: {target!r} (expected shape {fmt_shape(shape)}, dtype {dtype}; "
                                f"neither the stacked tensor nor any per-expert tensor ({keys}) is in the checkpoint)")
            elif missing:
                problems.append(f"missing tensor: experts {_fmt_list(missing)} of {target!r} (checkpoint keys "
                                f"{keys}; each expected shape {fmt_shape(shape[1:])}, dtype {dtype}) are not in the "
                                "checkpoint")
        elif not slots:
            key = checkpoint_key(target, layout)
            where = f"{target!r}" if key == target else f"{target!r} (checkpoint key {key!r})"
            orphan = orphans.get(target)
            problems.append(f"missing tensor: {where} (expected shape {fmt_shape(shape)}, dtype {dtype}) is not in the "
                            "checkpoint" + ("" if orphan is None else f", though its scale {orphan.key!r} is"))

    if problems:
        shown = problems[:_MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown)
        msg = f"checkpoint does not match {subject} ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  " + "\n  ".join(shown)
        if more:
            msg += f"\n  ... and {more} more"
        raise CheckpointError(msg)
    return plan


def _is_stacked(target: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 3 and target.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".ffn.experts." in target + "."


def _expert_keys(target: str, experts: list[int], layout: str) -> str:
    """The per-expert checkpoint keys of stacked `target`'s `experts`, for messages: the first, the last."""
    if not experts:
        return ""
    first, last = (checkpoint_key(expert_name(target, i), layout) for i in (experts[0], experts[-1]))
    return repr(first) if first == last else f"{first!r} ... {last!r}"


def _fmt_list(xs: list[int]) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 12 else ", ".join(map(str, xs[:12])) + f", ... ({len(xs)} in all)"


def _check_tid2eid(plan: list[TensorLoad], n_experts: int | None) -> None:
    """Out-of-range hash-routing entries would index past the expert table on the GPU; check them on
    the host (the tables are small) before any device work."""
    if not n_experts:
        return
    problems = []
    with TensorReader("cpu") as reader:
        for load in plan:
            if not load.target.endswith("ffn.gate.tid2eid"):
                continue
            t = reader.read(load.weight).to(torch.int64)
            bad = (t < 0) | (t >= n_experts)
            if bad.any():
                row = int(bad.any(dim=-1).nonzero()[0, 0])
                problems.append(f"{load.weight.key!r}: expert ids must lie in [0, {n_experts}); row {row} is {t[row].tolist()}")
                continue
            srt = t.sort(dim=-1).values
            dup = (srt[:, 1:] == srt[:, :-1]).any(dim=-1)
            if dup.any():
                row = int(dup.nonzero()[0, 0])
                problems.append(f"{load.weight.key!r}: each token must route to distinct experts; row {row} is {t[row].tolist()}")
    if problems:
        raise CheckpointError("invalid hash-routing table:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def _is_expert_stacked(target: str) -> bool:
    """A state_dict entry whose dim 0 runs over the routed experts (float `ffn.experts.w*`, NVFP4 `ffn.nvfp4.w13_*`
    / `w2_*`; not the shared expert's `shared_*`)."""
    parent, _, leaf = target.rpartition(".")
    return (parent.endswith(".ffn.experts") and leaf in ("w1", "w2", "w3")) or \
        (parent.endswith(".ffn.nvfp4") and leaf.startswith(("w13_", "w2_")))


def shard_plan(plan: list[TensorLoad], start: int, count: int) -> list[TensorLoad]:
    """The loads of a rank holding routed experts [start, start + count) (expert parallelism), from the plan of
    the whole model (so every expert was validated): per-expert tensors of other experts are dropped, the rest
    renumbered; stacked ones are narrowed to the rank's rows."""
    out = []
    for load in plan:
        if load.index is not None:
            if start <= load.index < start + count:
                out.append(dataclasses.replace(load, index=load.index - start))
        elif _is_expert_stacked(load.target):
            out.append(dataclasses.replace(load, narrow=((0, start, count),) + load.narrow))
        else:
            out.append(load)
    return out


def _decode(load: TensorLoad, reader: TensorReader, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    w = reader.read(load.weight).to(device)
    if load.kind == "fp8":
        w = dequant_fp8_blocks(w, reader.read(load.scale).to(device), dtype, FP8_BLOCK)
    elif load.kind == "fp4":
        w = dequant_mxfp4(w, reader.read(load.scale).to(device), dtype, FP4_BLOCK)
    elif load.kind == "nvfp4":
        w = _read_nvfp4(load, reader, device).dequantize(dtype)
    for dim, start, length in load.narrow:
        w = w.narrow(dim, start, length)
    return w


def _read_nvfp4(load: TensorLoad, reader: TensorReader, device: torch.device) -> Nvfp4Tensor:
    scale = reader.read(load.scale).to(device)
    return Nvfp4Tensor(reader.read(load.weight).to(device).view(torch.uint8),
                       scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale,
                       reader.read(load.scale2).to(device=device, dtype=torch.float32).reshape(()))


def _source(load: TensorLoad, reader: TensorReader, device: torch.device):
    """A checkpoint tensor for NVFP4 conversion: MXFP4 / NVFP4 kept encoded, everything else as fp32 values
    (FP8 dequantized exactly)."""
    if load.kind == "fp4":
        return Mxfp4Tensor(reader.read(load.weight).to(device), reader.read(load.scale).to(device))
    if load.kind == "nvfp4":
        return _read_nvfp4(load, reader, device)
    return _decode(load, reader, device, torch.float32)


def _free_device_bytes(device: torch.device) -> int | None:
    """Free bytes of the GPU the model is loaded onto, or the host's available memory (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from dsv4_model.checkpoint.memory_plan import available_host_bytes

    return available_host_bytes()


def _unit_getter(plan_by_target: dict, reader: TensorReader, device: torch.device):
    """get(name, index) for `fill_unit_`: per-expert checkpoint tensors directly, stacked ones (dsv4 / HF
    layouts) read once per unit and indexed."""
    cache: dict[str, object] = {}

    def get(name: str, index: int | None):
        load = plan_by_target.get((name, index))
        if load is not None:
            return _source(load, reader, device)
        if name not in cache:
            cache[name] = _source(plan_by_target[(name, None)], reader, device)
        t = cache[name]
        return t if index is None else t[index]

    return get, cache.clear


def _has_mtp(names) -> bool:
    return any(n.startswith("mtp.") or n.startswith("model.mtp.") for n in names)


def _check_dspark(root: Path, tensors: dict[str, TensorInfo], layout: str, config, dtype: torch.dtype, *,
                  load: bool | None, speculate_mtp: bool, spare: bool,
                  stored_act_quant: str | None = None) -> tuple[int, int, list | None]:
    """A DSpark checkpoint (docs/dspark.md): refuse MTP speculation on it, check its `mtp.*` tensors from the
    headers against dsv4's DSpark module (one CheckpointError naming each wrong tensor). Returns (the stage count,
    the DSpark tensors found, the module's load plan, of every expert, or None where it is not loaded: load=False,
    no `mtp.*` tensors)."""
    from dsv4_model.checkpoint.dspark import DSPARK_PREFIX, dspark_expected, stage_count

    to_official = hf_to_official_name if layout == "hf" else (lambda k: k)
    found = {k: info for k, info in tensors.items() if to_official(k).startswith(DSPARK_PREFIX)}
    n_stages = stage_count(config, map(to_official, found))
    if speculate_mtp:
        raise CheckpointError(
            f"{root}: MTP speculation (load_mtp=True) needs an MTP block, and this checkpoint has none: its mtp.* "
            f"tensors are a DSpark speculative module ({n_stages} stages, dspark_* config keys), not MTP "
            "(docs/dspark.md)")
    if load and not found:
        raise CheckpointError(f"{root}: load_dspark=True, and the checkpoint has no DSpark tensors (mtp.*): its "
                              "config names a DSpark module its tensors do not carry (docs/dspark.md)")
    plan = None
    if found:
        try:
            plan = build_load_plan(found, dspark_expected(config, n_stages, dtype, stored_act_quant), layout,
                                   subject=f"the DSpark module its config describes ({n_stages} stages)")
        except CheckpointError as e:
            raise CheckpointError(f"{root}: {e}") from None
    if load is False:
        plan = None
    if spare and plan is None:
        raise CheckpointError(
            f"{root}: spare_window_slots > 0 is for speculative decoding, which on this checkpoint drafts with its "
            f"DSpark module ({n_stages} stages), not loaded here: "
            + ("no mtp.* tensors" if not found else "load_dspark=False") + " (docs/dspark.md)")
    return n_stages, len(found), plan


def _dspark_note(root: Path, n_stages: int, n_tensors: int, loaded: bool, load: bool | None) -> str:
    why = "loaded" if loaded else "not loaded (load_dspark=False; the CLI and serve load it with --speculate)"
    return f"[dsv4] {root}: DSpark speculative module ({n_stages} stages, {n_tensors} tensors) {why} (docs/dspark.md)"


def _load_dspark(plan: list, config, n_stages: int, reader: "TensorReader", *, device: torch.device,
                 dtype: torch.dtype, max_batch_size: int, simulate_quant: bool, quant: str, act_quant: str,
                 expert_shard=None, stored: dict | None = None):
    """dsv4's DSpark module with the checkpoint's tensors, held as the main model's are: float (FP8 / MXFP4
    dequantized) or NVFP4 (each unit built from its checkpoint tensors, no float copy; a converted dsv4
    checkpoint's `stored` NVFP4 buffers read as they are), this rank's experts only."""
    module, units = meta_dspark(config, n_stages, dtype=dtype, max_batch_size=max_batch_size,
                                simulate_quant=simulate_quant, quant="nvfp4" if stored else quant,
                                act_quant=act_quant, expert_shard=expert_shard)
    if expert_shard is not None:
        plan = shard_plan(plan, *expert_shard.bounds(config.n_routed_experts))
    module.to_empty(device=device)
    _fill_(module, plan, [] if stored else units, reader, device)
    if stored:
        upgrade_kernel_layout_(module, stored["kernel_layout"])
    module.setup_runtime(device)
    return module.eval()


def _fill_(module, plan: list, units: list, reader: TensorReader, device: torch.device, *, progress: bool = False,
           name: str = "") -> None:
    """Copy the plan's tensors into `module` (built and moved to `device`): the converted units' sources through
    fill_unit_, the rest decoded into their parameters, in shard order (each shard mapped once)."""
    from tqdm.auto import tqdm

    unit_sources = {src for u in units for src in u.sources.values()}
    params = module.state_dict(keep_vars=True)
    direct = sorted((load for load in plan if load.target not in unit_sources), key=lambda ld: str(ld.weight.file))
    by_target = {(load.target, load.index): load for load in plan if load.target in unit_sources}
    for load in tqdm(direct, desc=f"loading {name}", unit="tensor", disable=not progress):
        dst = params[load.target]
        if load.index is not None:
            dst = dst[load.index]
        dst.copy_(_decode(load, reader, device, dst.dtype))
    get, clear = _unit_getter(by_target, reader, device)
    for unit in tqdm(units, desc=f"NVFP4 {name}", unit="layer", disable=not (progress and units)):
        fill_unit_(module, unit, get)
        clear()


def load_drafter(path: str | os.PathLike, config, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16, max_batch_size: int = 1, simulate_quant: bool = True,
                 quant: str = "none", act_quant: str = "none"):
    """The DSpark module of drafter directory `path` (checkpoint/drafter.py) for a model of `config` (the main
    model's, loaded apart), checked and built as load_model(drafter=) builds it; give it to a model with
    dsv4_model.model.dspark.attach (e.g. to compare it with the model's own MTP block)."""
    from dsv4_model.checkpoint.drafter import with_drafter

    device = parse_device(device)
    check_modes(quant, act_quant)
    config = with_drafter(config, path)
    n_stages, _, plan = _check_dspark(Path(path), list_tensors(path), "dsv4", config, dtype, load=True,
                                      speculate_mtp=False, spare=False)
    with torch.no_grad(), TensorReader("cpu") as reader:
        return _load_dspark(plan, config, n_stages, reader, device=device, dtype=dtype,
                            max_batch_size=max_batch_size, simulate_quant=simulate_quant, quant=quant,
                            act_quant=act_quant)


def _build_meta_model(config, *, max_batch_size: int, max_seq_len: int, dtype: torch.dtype, simulate_quant: bool,
                      allow_beyond_max_position: bool = False, spare_window_slots: int = 0):
    from dsv4_model.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(config, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype,
                           device="meta", simulate_quant=simulate_quant,
                           allow_beyond_max_position=allow_beyond_max_position,
                           spare_window_slots=spare_window_slots)


def _stored_quant(root: Path, layout: str) -> dict | None:
    """The `dsv4_quant` marker of a converted dsv4 checkpoint (validated), else None."""
    if layout != "dsv4":
        return None
    cfg_path = config_path_for(root, layout)
    info = _read_json(cfg_path).get(QUANT_INFO_KEY)
    if info is None:
        return None
    if not isinstance(info, dict) or info.get("method") != "nvfp4" or info.get("act_quant") not in ACT_QUANT_MODES:
        raise CheckpointError(f"{cfg_path}: invalid {QUANT_INFO_KEY!r} field {info!r}")
    if info.get("kernel_layout") not in KERNEL_LAYOUT_VERSIONS:
        raise CheckpointError(f"{cfg_path}: NVFP4 kernel layout version {info.get('kernel_layout')!r}, this build "
                              f"reads versions {KERNEL_LAYOUT_VERSIONS}; re-convert from the original checkpoint")
    return info


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               max_batch_size: int = 1, max_seq_len: int = 4096, simulate_quant: bool = True, progress: bool = True,
               layout: str | None = None, load_mtp: bool | None = None, quant: str | None = None,
               act_quant: str | None = None, allow_beyond_max_position: bool = False, expert_shard=None,
               spare_window_slots: int = 0, load_dspark: bool | None = None,
               drafter: str | os.PathLike | None = None):
    """Build `Transformer` from the checkpoint directory `path` and return `(model, config)`.

    `layout`: "hf" | "official" | "dsv4" | None (auto). `load_mtp`: None loads the MTP block if the
    checkpoint has one (HF checkpoints never do) and otherwise builds the model without it; True
    requires it; False ignores it. Raises `CheckpointError` (a ValueError) before allocating any device
    memory if the checkpoint does not match the config. A DSpark release (V4-Flash-0731; docs/dspark.md) has no
    MTP block: its `mtp.*` DSpark tensors are checked and, with `load_dspark` None (when present) or True
    (required), loaded into a `dsv4_model.model.dspark.DSpark` given to the model as `model.dspark` (None
    otherwise; not part of its state dict); one stderr note when `progress`. load_mtp=True is refused there, and
    spare_window_slots > 0 unless DSpark is loaded. A DeepSeek-V4.1 config is refused (docs/v41.md).

    `quant`: "none" (float weights; NVFP4 checkpoint tensors are dequantized) | "nvfp4" (convert at load,
    see the module docstring) | None (= "nvfp4" for an NVFP4-converted dsv4 checkpoint, else "none").
    `act_quant`: "none" (W4A16) | "nvfp4" (W4A4, needs quant="nvfp4") | None (= what a converted checkpoint
    was saved with, else "none"). `allow_beyond_max_position`: max_seq_len may exceed the config's
    max_position_embeddings (positions the model was not trained for). `expert_shard`: a
    `dsv4_model.model.parallel.ExpertShard`: this rank's slice of the routed experts (the DSpark stages' too) only
    is read (every expert's header is still checked), the rest of the model replicated. `spare_window_slots`: K spare cache slots for
    speculative decoding with up to K drafts (Transformer; docs/speculation.md).
    """
    t_start = time.perf_counter()
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    device = parse_device(device)
    check_positive_int(max_batch_size, "max_batch_size")
    refuse_other_architectures(root)
    tensors = list_tensors(root)
    layout = layout or detect_layout(root, tensors)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    config = load_config(root, layout)
    if (root / TOKENIZER_NAME).is_file():  # one that cannot serve this model fails here, not after the load
        load_tokenizer(root, config)
    dspark_root, dspark_tensors, dspark_layout = root, tensors, layout
    if drafter is not None:
        from dsv4_model.checkpoint.drafter import with_drafter

        if load_dspark is False or load_mtp:
            raise ValueError("drafter: a DSpark drafter directory is loaded as the model's drafter; it cannot go "
                             "with load_dspark=False or load_mtp=True")
        config = with_drafter(config, drafter)
        dspark_root, dspark_layout, load_dspark = Path(drafter), "dsv4", True
        dspark_tensors = list_tensors(dspark_root)
    stored = _stored_quant(root, layout)
    quant = quant or ("nvfp4" if stored else "none")
    act_quant = act_quant or (stored["act_quant"] if stored and quant == "nvfp4" else "none")
    check_modes(quant, act_quant)

    n_mtp = int(getattr(config, "n_mtp_layers", 0) or 0)
    has_mtp = _has_mtp(tensors)
    skip: tuple[str, ...] = ()
    dspark_plan = None
    if getattr(config, "dspark", None) is not None:  # mtp.* is a DSpark module: checked, loaded apart
        n_stages, n_dspark, dspark_plan = _check_dspark(
            dspark_root, dspark_tensors, dspark_layout, config, dtype, load=load_dspark,
            speculate_mtp=bool(load_mtp), spare=bool(spare_window_slots),
            stored_act_quant=stored["act_quant"] if stored and drafter is None else None)
        skip = ("mtp.",)
    elif load_mtp is False or (load_mtp is None and n_mtp > 0 and not has_mtp):
        if load_mtp is None:
            warnings.warn(f"{root}: checkpoint has no MTP tensors; building the model without the MTP block", stacklevel=2)
        if n_mtp:
            ratios = list(config.compress_ratios)[: config.n_layers]
            config = dataclasses.replace(config, n_mtp_layers=0, compress_ratios=ratios)
        skip = ("mtp.",)

    check_max_seq_len(max_seq_len, config, allow_beyond_max_position)
    model = _build_meta_model(config, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype,
                              simulate_quant=simulate_quant, allow_beyond_max_position=allow_beyond_max_position,
                              spare_window_slots=spare_window_slots)
    units = []
    if stored:  # the checkpoint holds the NVFP4 buffers themselves: convert the structure first
        convert_structure_(model, act_quant)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    plan = build_load_plan(tensors, expected, layout, skip_prefixes=skip)
    _check_tid2eid(plan, getattr(config, "n_routed_experts", None))
    if expert_shard is not None:
        plan = shard_plan(plan, *expert_shard.bounds(config.n_routed_experts))
        model.shard_experts_(expert_shard)
    if quant == "nvfp4" and not stored:
        units = convert_structure_(model, act_quant)

    free = _free_device_bytes(device)
    if free is not None:  # before any device memory is taken: a clear error instead of an out-of-memory
        needs = memory_plan(config, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, quant=quant,
                            act_quant=act_quant, simulate_quant=simulate_quant,
                            allow_beyond_max_position=allow_beyond_max_position,
                            spare_window_slots=spare_window_slots,
                            ep=expert_shard.world if expert_shard is not None else 1,
                            dspark_stages=n_stages if dspark_plan is not None else 0)
        check_fits(needs, free, str(device))
        if progress:
            print(f"[dsv4] memory on {device}: {needs.describe('per GPU' if device.type == 'cuda' else '')}",
                  file=sys.stderr)
    model.to_empty(device=device)
    with torch.no_grad(), TensorReader("cpu") as reader:  # (TensorReader keeps only a few shards open)
        _fill_(model, plan, units, reader, device, progress=progress, name=display_name(root))
        dspark = None if dspark_plan is None else _load_dspark(
            dspark_plan, config, n_stages, reader, device=device, dtype=dtype, max_batch_size=max_batch_size,
            simulate_quant=simulate_quant, quant=quant, act_quant=act_quant,
            expert_shard=expert_shard, stored=stored if drafter is None else None)
    from dsv4_model.model.dspark import attach

    attach(model, dspark)  # before a dequantization, which converts it with the model
    if stored:
        upgrade_kernel_layout_(model, stored["kernel_layout"])
    if stored and quant == "none":
        dequantize_model_(model)
    model.narrow_weights_()
    model.setup_runtime(device)
    model.eval()
    if progress and getattr(config, "dspark", None) is not None and n_dspark:
        print(_dspark_note(dspark_root, n_stages, n_dspark, dspark is not None, load_dspark), file=sys.stderr)
    if progress:
        print(f"[dsv4] loaded {root.name} in {time.perf_counter() - t_start:.1f} s; host memory peak "
              f"{peak_host_bytes() / GiB:.1f} GiB (resident set)", file=sys.stderr)
    return model, config


def peak_host_bytes() -> int:
    """The process's peak resident set so far (Linux: ru_maxrss in KiB; macOS: bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def save_model(model, config, path: str | os.PathLike, *, num_shards: int | None = None,
               max_shard_bytes: int | None = 5 * 2**30) -> None:
    """Write `model` in the dsv4 layout: its state_dict (stacked experts) as safetensors (sharded with an
    index above `max_shard_bytes`, or into exactly `num_shards` files) + `config.json`. An NVFP4-converted
    model is written with its NVFP4 buffers and the `dsv4_quant` marker (loads back without re-quantizing). An
    attached DSpark module (`model.dspark`, a 0731-style checkpoint's) is written under its `mtp.*` names, held as
    the model is (NVFP4 or float)."""
    from dsv4_model.quant.nvfp4_modules import is_nvfp4

    head = getattr(model, "head", None)  # (a state-dict holder, e.g. the training script's, has none)
    if head is not None and is_nvfp4(head):  # before anything is written: no loader reads a head stored that way
        raise ValueError("save_model: the head is NVFP4 (head_quant): save the model as loaded, with its stored head; "
                         "head_quant converts it again at load")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    quant_info = getattr(model, "quant_info", None)
    dspark = getattr(model, "dspark", None)
    if dspark is not None:
        if bool(getattr(dspark, "quant_info", None)) != bool(quant_info):
            raise ValueError("save_model: the attached DSpark module is held unlike the model (NVFP4 / float): "
                             "convert both with quantize_model_(model)")
        state.update(dspark.state_dict())
    meta = {DSV4_FORMAT_KEY: str(DSV4_FORMAT_VERSION)}
    if quant_info:
        meta[QUANT_INFO_KEY] = json.dumps(quant_info)
    write_sharded(list(state.items()), out, num_shards=num_shards, max_shard_bytes=max_shard_bytes, metadata=meta)
    cfg = {**config.to_dict(), DSV4_FORMAT_KEY: DSV4_FORMAT_VERSION}
    if quant_info:
        cfg[QUANT_INFO_KEY] = dict(quant_info)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

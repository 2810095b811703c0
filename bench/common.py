"""What the model-level benchmarks share: the model configs they time, the byte floor of a decode step, the
published peer figures they compare against, and table printing.

The configs, by the names the benchmarks use:
  micro    3 tiny layers (SWA, CSA, HCA: ratios [0, 4, 16]), one hash layer, 4 routed experts
  flash2   V4-Flash widths, 2 layers (CSA + HCA: ratios [4, 128]), no hash layer, all 256 experts
  flashN   V4-Flash widths, N layers: N = 43 is V4-Flash's own layer plan (ratios and hash layers), fewer are the
           [4, 128, 0] slice without hash layers
  microN   flashN's layer plan at tiny widths (ratios capped at 16), 4 routed experts: a CPU dry run of flashN
A benchmark that times other widths builds them with `micro(...)` / `flash(...)` here.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, NamedTuple

import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG, make_config
from dsv4_model.model.config import ModelConfig

HBM_BYTES_PER_S = 4.26e12  # the H200's measured HBM copy bandwidth (NVIDIA publishes 4.8 TB/s): the floors' denominator


# ------------------------------------------------------------------------------------------ model configs
def micro(ratios: list[int], *, hash_layers: int = 0, experts: int = 4) -> ModelConfig:
    """TINY_CONFIG widths with these layers (compress ratios capped at the tiny window's 16), no MTP block."""
    return ModelConfig(**{**TINY_CONFIG, "n_layers": len(ratios), "compress_ratios": [min(r, 16) for r in ratios],
                          "n_mtp_layers": 0, "n_hash_layers": hash_layers, "n_routed_experts": experts}).validate()


def flash(ratios: list[int], *, hash_layers: int = 0, experts: int | None = None,
          vocab: int | None = None) -> ModelConfig:
    """V4-Flash widths with these layers, no MTP block; experts / vocab: the preset's unless given."""
    c = ModelConfig.v4_flash()
    c.n_layers, c.compress_ratios, c.n_mtp_layers, c.n_hash_layers = len(ratios), list(ratios), 0, hash_layers
    if experts is not None:
        c.n_routed_experts = experts
    if vocab is not None:
        c.vocab_size = vocab
    return c.validate()


def flash_plan(depth: int) -> tuple[list[int], int]:
    """(compress ratios, hash layers) of a depth-layer V4-Flash-width model: V4-Flash's own at its full depth,
    else the CSA + HCA (+ SWA) slice that flash2 times."""
    full = ModelConfig.v4_flash()
    if depth == full.n_layers:
        return list(full.compress_ratios[:depth]), full.n_hash_layers
    return [4, 128, 0][:depth], 0


def preset(name: str, *, experts: int | None = None) -> ModelConfig:
    """The named configs of this module's docstring; experts: routed experts of a flashN model (default all)."""
    if name == "micro":
        return micro([0, 4, 16], hash_layers=1)
    for prefix in ("flash", "micro"):
        depth = name.removeprefix(prefix)
        if name.startswith(prefix) and depth.isdigit():
            ratios, hashed = flash_plan(int(depth))
            if prefix == "micro":
                return micro(ratios, hash_layers=hashed)
            return flash(ratios, hash_layers=hashed, experts=experts)
    raise ValueError(f"unknown model {name!r}")


DRAFTERS = ("mtp", "dspark")


def with_drafter(cfg: ModelConfig, drafter: str | None) -> ModelConfig:
    """cfg with a drafter for the speculative benchmarks: "mtp" one MTP block (V4-Flash's), "dspark" a DSpark module
    as V4-Flash-0731's (docs/dspark.md: 3 window-only stages fed by the last three layers, blocks of 5, Markov rank
    256; fewer targets on a shallower model), None: cfg as it is. Random weights, so drafts are rarely accepted: what
    these runs measure is the cost of a speculative step."""
    if drafter is None:
        return cfg
    if drafter == "mtp":
        return dataclasses.replace(cfg, n_mtp_layers=1, compress_ratios=list(cfg.compress_ratios) + [0]).validate()
    if drafter != "dspark":
        raise ValueError(f"drafter must be one of {DRAFTERS} or None, got {drafter!r}")
    from dsv4_model.model.dspark_config import DSparkConfig

    targets = tuple(range(max(0, cfg.n_layers - 3), cfg.n_layers))
    sp = DSparkConfig(block_size=5, markov_rank=256 if cfg.dim >= 1024 else 16, target_layer_ids=targets,
                      noise_token_id=min(128799, cfg.vocab_size - 1), stage_ratios=(0, 0, 0))
    return dataclasses.replace(cfg, n_mtp_layers=0, dspark=sp).validate()


# Whole published models, for the benchmarks that slice them (ModelConfig.sliced).
FULL_MODELS = {"flash": ModelConfig.v4_flash, "pro": ModelConfig.v4_pro, "tiny": make_config}


# ------------------------------------------------------------------------------------------ byte floor
# Routed experts' weights: bf16 `ffn.experts.w1/2/3`, NVFP4 `ffn.nvfp4.w13_* / w2_*` (the shared expert's are
# `ffn.nvfp4.shared_*`: read every step).
ROUTED = re.compile(r"\.ffn\.(experts\.w[123]|nvfp4\.w(13|2)_\w+)$")


def step_weight_bytes(tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, batch: int = 1,
                      world: int = 1) -> float:
    """Weight bytes one decode step of `batch` rows reads on one of `world` expert-parallel ranks: every tensor
    given (the MTP block's left out), of the embedding only `batch` rows, of the routed experts (each rank holding
    E / world) this rank's share of the distinct experts batch x top-k tokens touch under uniform routing:
    E (1 - (1 - k / E)^B). KV-cache reads are left out: next to the weights they are small at short context."""
    fixed, routed = 0.0, 0.0
    for name, t in tensors:
        if name.startswith("mtp."):
            continue
        if ROUTED.search(name):
            routed += t.numel() * t.element_size()
        elif name == "embed.weight":
            fixed += batch * t.shape[1] * t.element_size()
        else:
            fixed += t.numel() * t.element_size()
    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    distinct = E * (1.0 - (1.0 - k / E) ** batch)
    return fixed + distinct / world * routed / (E // world)


def floor_seconds(tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, batch: int = 1,
                  world: int = 1) -> float:
    """step_weight_bytes at the H200's HBM bandwidth: no decode step can be faster."""
    return step_weight_bytes(tensors, cfg, batch, world) / HBM_BYTES_PER_S


# ------------------------------------------------------------------------------------------ peers
class Published(NamedTuple):
    """A peer's figure as its authors published it (not run here): value, unit, setting, where it is cited."""
    value: float
    unit: str
    what: str
    source: str

    def cite(self) -> str:
        return f"{self.value:g} {self.unit} ({self.what}): published, not run here ({self.source})"


SGLANG_4XH200_FLASH_TPOT_MS = Published(
    3.37, "ms/token", "SGLang 0.5.15, V4-Flash FP4 on 4x H200, TP4 + MTP 3-1-4, concurrency 1",
    "SGLang cookbook; /work/shared/docs/peers-and-limits.md")


# ------------------------------------------------------------------------------------------ tables and runs
def print_header(header: str) -> None:
    """A table's column line and its rule."""
    print(header)
    print("-" * len(header))


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile of xs (nearest rank; nan when empty)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def cuda_missing(bench: str, hint: str = "") -> bool:
    """True (after one 'skipped' line) when there is no GPU to time on."""
    if torch.cuda.is_available():
        return False
    print(f"{bench}: needs a CUDA GPU (skipped{hint})")
    return True


# ------------------------------------------------------------------------------------------ model set-up
def preset_engine(name: str, *, experts: int | None, rows: int, max_seq_len: int, device: torch.device,
                  spare_window_slots: int = 0, drafter: str | None = None, regional: bool = False, log=None):
    """An Engine on a random NVFP4 model of preset `name` built on `device`, compiled + captured on CUDA (the
    served benchmarks' model when no checkpoint of that size is on disk); spare_window_slots: K for speculation;
    drafter: a random MTP block or DSpark module with it (`with_drafter`); regional: one decoder layer compiled
    at a time (RunnerOptions); log: the runner's progress lines."""
    from dsv4_model.model.dspark import attach
    from dsv4_model.quant.random_model import random_nvfp4_dspark, random_nvfp4_model
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime.session import RunnerOptions

    cfg = with_drafter(preset(name, experts=experts), drafter)
    cuda = device.type == "cuda"
    model = random_nvfp4_model(cfg, device=device, max_batch_size=rows, max_seq_len=max_seq_len,
                               spare_window_slots=spare_window_slots)
    if cfg.dspark is not None:
        attach(model, random_nvfp4_dspark(cfg, device=device, max_batch_size=rows))
    return Engine(model, cfg, device, runner_options=RunnerOptions(compile=cuda, cuda_graphs=cuda,
                                                                   regional=regional and cuda, log=log))


def build_models(cfg: ModelConfig, max_batch: int, max_seq: int, with_hf: bool = True):
    """(ours, HF's or None, note) on the GPU, random bf16 weights: HF is built first and its weights copied into
    ours when the names map, so both run the same model."""
    from dsv4_model.model.transformer import Transformer
    from dsv4_model.quant.random_model import randomize_floats_

    ours = Transformer(cfg, max_batch_size=max_batch, max_seq_len=max_seq, dtype=torch.bfloat16, device="meta")
    ours.to_empty(device="cuda")
    randomize_floats_(ours, 0, cfg.n_routed_experts)
    hf, note = (None, "no HF model asked for") if not with_hf else _build_hf(cfg, ours)
    # the fp32-math weights (compressor projections, head) in bf16 as the released checkpoints hold them and the
    # loader keeps them (without HF's bf16 weights copied in, the random fp32 values are rounded: else their
    # products run as fp32 SIMT GEMMs no real checkpoint sees, 8% of a 128K prefill: bench/RESULTS.md, session 34)
    ours.narrow_weights_(lossless=None if hf is not None else True)
    ours.setup_runtime(torch.device("cuda"))
    ours.eval()
    return ours, hf, note


def _build_hf(cfg: ModelConfig, ours):
    """(HF's model or None, note), its random weights copied into ours when the names map."""
    from dsv4_model.quant.random_model import randomize_floats_

    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        hf_cfg = DeepseekV4Config.from_dict(cfg.to_hf_dict())
        hf_cfg._attn_implementation = "eager"
        with torch.device("cuda"):
            hf = DeepseekV4ForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16).eval()
        randomize_floats_(hf, 1, cfg.n_routed_experts)
        try:
            _tests_on_path()
            from hf_utils import hf_to_official_state_dict

            missing, unexpected = ours.load_state_dict(hf_to_official_state_dict(hf.state_dict()), strict=False)
            note = "same weights" if not unexpected else f"weights copied, unexpected {unexpected[:3]}"
        except Exception as e:  # names differ in this transformers version: same shapes, own weights
            note = f"HF weight names did not map ({type(e).__name__}: {e}); HF uses its own random weights"
    except Exception as e:
        hf, note = None, f"HF model unavailable: {type(e).__name__}: {e}"
    return hf, note


def _tests_on_path() -> None:
    """tests/hf_utils.py maps HF's weight names to ours (the parity tests' mapping)."""
    import os
    import sys

    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)

"""What a model needs per GPU before anything is allocated: weights, decode caches, runtime tables.

The figures come from the model itself built on the meta device (the NVFP4 structure swapped in, weights
narrowed, caches sized for max_batch_size x max_seq_len, as the loader does), so they are the bytes the engine
allocates for these tensors, not a formula to keep in step with the model. Not counted: CUDA graph pools,
activations and workspaces of a step (small at decode sizes; prefill's grow with the prompt).
With expert parallelism over `ep` ranks each rank holds ceil(E / ep) routed experts; the rest is replicated.
A DSpark module (`dspark_stages` > 0: a V4-Flash-0731-style checkpoint's, docs/dspark.md) is counted apart, in the
form the loader holds it (`meta_dspark`: NVFP4 or float, this rank's experts, its window rings).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from dsv4_model.model.config import ModelConfig
from dsv4_model.model.dspark import DSpark
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.quantize_model import check_modes, convert_structure_

GiB = 2**30
_ROUTED = (".ffn.nvfp4.w13_", ".ffn.nvfp4.w2_", ".ffn.experts.")


@dataclass(frozen=True)
class MemoryPlan:
    weights: int  # bytes per rank: every parameter and stored buffer (routed experts: this rank's share)
    routed_experts: int  # of which routed experts
    caches: int  # KV / indexer caches and compressor states for max_batch_size x max_seq_len
    runtime: int  # RoPE tables and per-step scratch buffers
    ep: int
    dspark: int = 0  # the DSpark module: its weights (routed experts: this rank's share) and window rings

    @property
    def total(self) -> int:
        return self.weights + self.caches + self.runtime + self.dspark

    def describe(self, per: str = "per GPU") -> str:
        share = f", {self.ep}-way expert parallel" if self.ep > 1 else ""
        dspark = f" + DSpark {size(self.dspark)}" if self.dspark else ""
        return (f"weights {size(self.weights)} (routed experts {size(self.routed_experts)}{share}) + caches "
                f"{size(self.caches)} + runtime {size(self.runtime)}{dspark} = {size(self.total)}"
                + (f" {per}" if per else ""))


def size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_plan(cfg: ModelConfig, *, max_batch_size: int = 1, max_seq_len: int = 4096,
                dtype: torch.dtype = torch.bfloat16, quant: str = "nvfp4", act_quant: str = "none", ep: int = 1,
                simulate_quant: bool = True, allow_beyond_max_position: bool = False,
                spare_window_slots: int = 0, dspark_stages: int = 0) -> MemoryPlan:
    """The per-rank bytes of `cfg` served with these limits (see the module docstring); dspark_stages: the DSpark
    module's stage count where it is loaded (0: not counted)."""
    check_modes(quant, act_quant)
    if not isinstance(ep, int) or ep < 1 or ep > cfg.n_routed_experts:
        raise ValueError(f"ep must be an int in [1, n_routed_experts={cfg.n_routed_experts}], got {ep!r}")
    model = Transformer(cfg, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, device="meta",
                        simulate_quant=simulate_quant, allow_beyond_max_position=allow_beyond_max_position,
                        spare_window_slots=spare_window_slots)
    if quant == "nvfp4":
        for unit in convert_structure_(model, act_quant):
            unit.old = None
    model.narrow_weights_(lossless=True)  # the compressors' weights as the released checkpoints store them
    model.setup_runtime(torch.device("meta"))
    state = model.state_dict()
    weights, routed_here = _stored_bytes(model, cfg.n_routed_experts, ep)
    caches = model.cache_nbytes()
    all_held = sum(_nbytes(t) for t in (*model.parameters(), *model.buffers()))
    dspark = 0
    if dspark_stages:
        if cfg.dspark is None:
            raise ValueError(f"dspark_stages={dspark_stages}: the config has no DSpark module (dspark_* keys)")
        module, _ = meta_dspark(cfg, dspark_stages, dtype=dtype, max_batch_size=max_batch_size,
                                simulate_quant=simulate_quant, quant=quant, act_quant=act_quant)
        module.setup_runtime(torch.device("meta"))  # its rings
        held = sum(_nbytes(t) for t in (*module.parameters(), *module.buffers()))
        stored, routed = _stored_bytes(module, cfg.n_routed_experts, ep)
        dspark = held - sum(_nbytes(t) for t in module.state_dict().values()) + stored
    return MemoryPlan(weights=weights, routed_experts=routed_here, caches=caches,
                      runtime=all_held - sum(_nbytes(t) for t in state.values()) - caches, ep=ep,
                      dspark=dspark)


def _stored_bytes(module, n_experts: int, ep: int) -> tuple[int, int]:
    """(the state dict's bytes with this rank's share of the routed experts, that share) under ep ranks."""
    state = module.state_dict()
    routed = sum(_nbytes(t) for k, t in state.items() if any(p in k for p in _ROUTED))
    routed_here = routed * math.ceil(n_experts / ep) // n_experts
    return sum(_nbytes(t) for t in state.values()) - routed + routed_here, routed_here


def meta_dspark(cfg: ModelConfig, n_stages: int, *, dtype: torch.dtype, max_batch_size: int, simulate_quant: bool,
                quant: str, act_quant: str, expert_shard=None):
    """dsv4's DSpark module on the meta device in the form the loader holds it: this rank's routed experts
    (expert_shard), the main layers' NVFP4 structure (quant="nvfp4"). Returns (module, its NVFP4 units)."""
    with torch.device("meta"):
        module = DSpark(cfg, n_stages, dtype=dtype, max_batch_size=max_batch_size, simulate_quant=simulate_quant,
                        device="meta")
    if expert_shard is not None:
        module.shard_experts_(expert_shard)
    return module, (convert_structure_(module, act_quant) if quant == "nvfp4" else [])


def check_fits(plan: MemoryPlan, free_bytes: int, device: str) -> None:
    """Raises ValueError naming what does not fit when the plan needs more than `free_bytes` of `device`."""
    if plan.total > free_bytes:
        where = "in host memory" if device.startswith("cpu") else "per GPU"
        what = "free (available host memory)" if device.startswith("cpu") else "free"
        raise ValueError(f"the model needs {plan.describe(where)}, {device} has {size(free_bytes)} {what}: lower "
                         "--max-seq-len / --max-batch-size, or use a smaller model")


def available_host_bytes() -> int | None:
    """Host memory a new allocation can get without swapping: Linux MemAvailable (free + reclaimable caches),
    within a cgroup v2 memory limit; else free pages; None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")), None)
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    try:  # a container's limit (killed past it, whatever the host has free)
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                avail = min(avail, int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return avail

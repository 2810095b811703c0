"""dsv4_model.checkpoint.memory_plan: the per-GPU bytes worked out on the meta device are what a real model of the
same config holds (weights, caches, runtime tables), and expert parallelism divides only the routed experts."""
import gc
import math
import os

import pytest
import torch

import dsv4_ops  # noqa: F401  (the model's ops)
from dsv4_model.checkpoint.writer import make_config
from dsv4_model.model.config import ModelConfig
from dsv4_model.quant.random_model import random_nvfp4_model
from dsv4_model.checkpoint.loader import load_model
from dsv4_model.checkpoint.memory_plan import check_fits, memory_plan


def _held(model):
    stored = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return stored, model.cache_nbytes(), held - stored - model.cache_nbytes()


@pytest.mark.parametrize("batch,seq", [(1, 64), (3, 128)])
def test_plan_is_what_a_built_model_holds(batch, seq):
    cfg = make_config("tiny")
    model = random_nvfp4_model(cfg, device="cpu", max_batch_size=batch, max_seq_len=seq)
    plan = memory_plan(cfg, max_batch_size=batch, max_seq_len=seq)
    assert (plan.weights, plan.caches, plan.runtime) == _held(model)
    assert plan.caches > 0 and plan.runtime > 0 and 0 < plan.routed_experts < plan.weights
    assert plan.total == plan.weights + plan.caches + plan.runtime


def test_caches_grow_with_rows_and_expert_parallel_splits_only_the_experts():
    cfg = ModelConfig.v4_flash().validate()
    one = memory_plan(cfg, max_batch_size=1, max_seq_len=8192)
    two = memory_plan(cfg, max_batch_size=2, max_seq_len=8192)
    assert two.caches == 2 * one.caches and two.weights == one.weights
    E = cfg.n_routed_experts
    for ep in (2, 3, 8):
        p = memory_plan(cfg, max_seq_len=8192, ep=ep)
        assert p.routed_experts == one.routed_experts * math.ceil(E / ep) // E
        assert p.weights - p.routed_experts == one.weights - one.routed_experts  # the rest replicated
        assert p.caches == one.caches
    assert "4-way expert parallel" in memory_plan(cfg, ep=4).describe()
    # a float (bf16) model of the same config: 4-bit experts are ~3.6x smaller
    bf16 = memory_plan(cfg, quant="none")
    assert 3.3 < bf16.routed_experts / one.routed_experts < 3.7


@pytest.mark.parametrize("ep", [0, 10**6, 1.5])
def test_bad_expert_parallel_degree_is_named(ep):
    with pytest.raises(ValueError, match="ep must be"):
        memory_plan(make_config("tiny"), ep=ep)


def test_check_fits_names_the_shortfall():
    plan = memory_plan(make_config("tiny"))
    check_fits(plan, plan.total, "cuda:0")
    with pytest.raises(ValueError, match=r"needs weights .* MiB per GPU, cuda:0 has .* MiB free"):
        check_fits(plan, plan.total - 1, "cuda:0")


DEFAULT = os.path.join(os.path.dirname(__file__), "..", "dsv4_model", "assets", "default")


@pytest.mark.parametrize("free_mib", [1, 2**17])
def test_the_loader_checks_free_memory_then_loads(monkeypatch, capsys, free_mib):
    # The same check a GPU load runs (on the CPU against available host memory), with the free bytes faked.
    from dsv4_model.checkpoint import loader
    monkeypatch.setattr(loader, "_free_device_bytes", lambda device: free_mib * 2**20)
    if free_mib == 1:
        with pytest.raises(ValueError, match=r"cpu has 1\.0 MiB free"):
            load_model(DEFAULT, device="cpu", max_seq_len=256)
        return
    model, _ = load_model(DEFAULT, device="cpu", max_seq_len=256, progress=True)
    assert "[dsv4] memory on cpu: weights" in capsys.readouterr().err
    assert model.cache_nbytes() > 0


@pytest.mark.cuda
def test_loading_onto_a_gpu_too_small_is_refused_before_allocating(monkeypatch):
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 2**37))
    with pytest.raises(ValueError, match="MiB free"):
        load_model(DEFAULT, device="cuda", max_seq_len=1024)
    assert torch.cuda.memory_allocated() == before

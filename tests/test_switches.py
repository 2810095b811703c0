"""The fused decode ops' switch rule (dsv4_model.layers.opt_in): on for CPU tensors, off elsewhere until the op is
listed as verified on the GPU, and the environment variable forcing either way."""
import torch

from dsv4_model import layers


def test_opt_in_rule(monkeypatch):
    cpu, other = torch.empty(2), torch.empty(2, device="meta")  # "meta" stands for a device that is not the CPU
    env = "DSV4_FUSED_TEST_SWITCH"
    monkeypatch.delenv(env, raising=False)
    assert layers.opt_in(env, cpu) and not layers.opt_in(env, other)
    monkeypatch.setattr(layers, "CUDA_VERIFIED", {env})
    assert layers.opt_in(env, other)
    monkeypatch.setenv(env, "0")
    assert not layers.opt_in(env, cpu) and not layers.opt_in(env, other)
    monkeypatch.setenv(env, "1")
    monkeypatch.setattr(layers, "CUDA_VERIFIED", set())
    assert layers.opt_in(env, cpu) and layers.opt_in(env, other)

"""dsv4_model.quant.random_model: a random NVFP4 model built directly (no float copy of a converted weight) has exactly
the structure the quantizer gives a float model, weights of the intended scale, and decodes finite, O(1) logits."""
import math

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.writer import make_config
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant import random_model
from dsv4_model.quant.nvfp4 import dequantize_kernel_layout, padded_k, repack_weight, unrepack_weight
from dsv4_model.model.layers import Linear
from dsv4_model.quant.nvfp4_modules import is_nvfp4
from dsv4_model.quant.quantize_model import quantize_model_
from dsv4_model.quant.random_model import bf16_released_values_, init_random_weights, random_nvfp4_model


def _cfg():
    return make_config("tiny")


def test_structure_is_what_the_quantizer_makes():
    cfg = _cfg()
    got = random_nvfp4_model(cfg, device="cpu", max_batch_size=2, max_seq_len=64, dtype=torch.float32)
    ref = quantize_model_(init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=64, dtype=torch.float32),
                                              0))
    bf16_released_values_(ref)  # as checkpoints store them, then narrowed as the loader does
    ref.narrow_weights_()
    g, r = got.state_dict(), ref.state_dict()
    assert g.keys() == r.keys()
    for k in r:
        assert (g[k].shape, g[k].dtype) == (r[k].shape, r[k].dtype), k
    assert got.quant_info == ref.quant_info
    assert {type(m) for m in got.modules()} == {type(m) for m in ref.modules()}


def test_weights_have_the_intended_scale_and_the_seed_decides_them():
    cfg = _cfg()
    a = random_nvfp4_model(cfg, device="cpu", max_seq_len=64, seed=3)
    b = random_nvfp4_model(cfg, device="cpu", max_seq_len=64, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    lins = [m for m in a.modules() if isinstance(m, Linear) and is_nvfp4(m)]
    assert lins
    for m in lins:
        w = dequantize_kernel_layout(m.weight_packed, m.weight_scale, m.weight_global_scale, m.in_features)
        assert w.shape == (m.out_features, m.in_features)
        rms = float(w.float().pow(2).mean().sqrt())
        assert abs(rms * math.sqrt(m.in_features) - 1) < 0.15, (m.in_features, rms)
    moe = a.layers[0].ffn.nvfp4
    for name, k in (("w13", moe.dim), ("w2", moe.inter), ("shared_w13", moe.dim), ("shared_w2", moe.shared_inter)):
        w = dequantize_kernel_layout(getattr(moe, f"{name}_packed"), getattr(moe, f"{name}_scale"),
                                     getattr(moe, f"{name}_global_scale"), k)
        assert abs(float(w.pow(2).mean().sqrt()) * math.sqrt(k) - 1) < 0.15, name


def test_an_expert_parallel_build_holds_the_single_process_models_slice():
    """Each rank of an expert-parallel build (ExpertShard rank r of 2) holds exactly experts [r E/2, (r+1) E/2) of
    the one-process build with the same seed, code for code, and every other weight equal: a 2-GPU run and a
    1-GPU run of the same preset are the same model (issue #32's cross-GPU check). Experts differ from each other
    and from one MoE layer to the next."""
    from dsv4_model.model.parallel import ExpertShard

    cfg = _cfg()
    full = random_nvfp4_model(cfg, device="cpu", max_seq_len=64, seed=4).state_dict()
    E, half = cfg.n_routed_experts, cfg.n_routed_experts // 2
    routed = ("w13_packed", "w13_scale", "w13_global_scale", "w2_packed", "w2_scale", "w2_global_scale")
    for rank in range(2):
        part = random_nvfp4_model(cfg, device="cpu", max_seq_len=64, seed=4,
                                  expert_shard=ExpertShard(rank, 2)).state_dict()
        assert part.keys() == full.keys()
        for k, v in part.items():
            want = full[k]
            if k.rsplit(".", 1)[-1] in routed and ".ffn.nvfp4." in k:
                assert want.shape[0] == E and v.shape[0] == half, k
                want = want[rank * half:(rank + 1) * half]
            assert torch.equal(v, want), k
    w = full["layers.0.ffn.nvfp4.w13_packed"]
    assert not torch.equal(w[0], w[1])
    assert not torch.equal(w, full["layers.1.ffn.nvfp4.w13_packed"])


@pytest.mark.parametrize("n", [100, 48])
def test_row_blocks_give_the_whole_matrix_layout(monkeypatch, n):
    # Filled 16 rows at a time (the last tile partial for n = 100): the kernel-layout bytes are what repacking
    # the whole canonical matrix gives.
    k = 64
    monkeypatch.setattr(random_model, "BLOCK_ELEMS", 16 * k)
    packed = torch.zeros(2, n, padded_k(k) // 2, dtype=torch.uint8)
    scale = torch.zeros(2, n, padded_k(k) // 16, dtype=torch.uint8)
    gs = torch.zeros(2)
    random_model._random_nvfp4_(packed, scale, gs, k, torch.Generator().manual_seed(0))
    for i in range(2):
        codes, s = unrepack_weight(packed[i], scale[i], k)
        assert torch.equal(s.float(), torch.ones(n, k // 16))
        kp, ks = repack_weight(codes, s)
        assert torch.equal(kp, packed[i]) and torch.equal(ks, scale[i])
    assert not torch.equal(packed[0], packed[1])  # each slice drew its own codes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_prefill_and_decode_are_finite_and_order_one(device):
    cfg = _cfg()
    model = random_nvfp4_model(cfg, device=device, max_batch_size=2, max_seq_len=64)
    ids = torch.randint(2, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    logits = model.prefill(ids)
    nxt = logits.argmax(-1)
    step = model.decode_step(nxt, torch.full((2,), 12, device=device))
    for t in (logits, step):
        assert torch.isfinite(t).all()
        assert 0.05 < float(t.float().std()) < 50, float(t.float().std())


@pytest.mark.cuda
def test_full_width_layers_never_hold_a_float_copy():
    # Two V4-Flash-width layers with 32 experts: peak device memory stays within the NVFP4 model plus one
    # expert stack's canonical intermediate; a float copy of the experts alone would be ~1.6 GB.
    cfg = ModelConfig.v4_flash()
    cfg.n_layers, cfg.compress_ratios, cfg.n_mtp_layers, cfg.n_hash_layers = 2, [4, 128], 0, 0
    cfg.n_routed_experts = 32
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = random_nvfp4_model(cfg.validate(), device="cuda", max_seq_len=256)
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < held + 512 * 2**20, (held / 2**20, peak / 2**20)
    del model


def test_expert_shards_share_every_replicated_weight():
    from dsv4_model.model.parallel import ExpertShard

    cfg = _cfg()
    parts = [random_nvfp4_model(cfg, device="cpu", max_seq_len=64, seed=1, expert_shard=ExpertShard(r, 2))
             for r in range(2)]
    a, b = (p.state_dict() for p in parts)
    routed = [k for k in a if ".ffn.nvfp4.w13_" in k or ".ffn.nvfp4.w2_" in k]
    assert routed and all(a[k].shape[0] == cfg.n_routed_experts // 2 for k in routed)
    assert all(torch.equal(a[k], b[k]) for k in a if k not in routed)  # replicated: the same on both ranks
    assert not all(torch.equal(a[k], b[k]) for k in routed)  # each rank its own experts


def test_a_random_dspark_is_what_the_quantizer_makes_and_speculates_exactly():
    """random_nvfp4_dspark (the benchmarks' full-size DSpark): the structure the quantizer gives a float DSpark, and
    greedy speculation with it on a random NVFP4 main model gives that model's plain greedy tokens."""
    from dsv4_model.model.dspark import DSpark, attach
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime.generate import generate
    from tests.test_release_0731 import _dspark_cfg

    cfg = _dspark_cfg()
    got = random_model.random_nvfp4_dspark(cfg, device="cpu", max_batch_size=2, dtype=torch.float32)
    ref = quantize_model_(DSpark(cfg, dtype=torch.float32, max_batch_size=2).init_random_weights())
    g, r = got.state_dict(), ref.state_dict()
    assert g.keys() == r.keys() and any(".nvfp4." in k for k in g)
    for k in r:
        assert (g[k].shape, g[k].dtype) == (r[k].shape, r[k].dtype), k
    assert {type(m) for m in got.modules()} == {type(m) for m in ref.modules()}

    model = random_nvfp4_model(cfg, device="cpu", max_batch_size=2, max_seq_len=96, dtype=torch.float32,
                               spare_window_slots=3)
    attach(model, got)
    eng = Engine(model, cfg, torch.device("cpu"))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5]]
    plain = generate(eng, prompts, max_new_tokens=24, stop_token_ids=[])
    spec = generate(eng, prompts, max_new_tokens=24, speculate=3, stop_token_ids=[])
    assert spec.token_ids == plain.token_ids and "DSpark speculate 3" in spec.mode
    assert len({t for row in plain.token_ids for t in row}) > 5

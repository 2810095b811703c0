"""The DSpark module of a tiny 0731-layout checkpoint held as the main model is: NVFP4 (quant="nvfp4": its stages'
attention projections and MoE converted from the checkpoint's tensors, MXFP4 experts losslessly), sharded under
expert parallelism, and counted by the memory plan (docs/dspark.md)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from dsv4_model.checkpoint.loader import load_model
from dsv4_model.checkpoint.memory_plan import memory_plan
from dsv4_model.checkpoint.writer import canonical_weights, write_checkpoint
from dsv4_model.model.layers import FLOAT
from dsv4_model.model.parallel import ExpertShard
from dsv4_model.quant.nvfp4_modules import Nvfp4MoE, is_nvfp4
from dsv4_model.quant.quantize_model import dequantize_model_, quantize_model_
from dsv4_model.runtime.dspark_speculative import prefill_taps
from tests.test_release_0731 import PROMPT, _dspark_cfg

PROJ = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("d0731q")
    cfg = _dspark_cfg()
    weights = canonical_weights(cfg, seed=5)
    return {layout: write_checkpoint(weights, cfg, root / layout, layout) for layout in ("official", "modelopt")}


def _load(path, **kw):
    kw = {"dtype": torch.float32, "max_seq_len": 64, "progress": False, **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tiny random experts: every MXFP4 -> NVFP4 conversion lossless
        return load_model(path, **kw)[0]


@pytest.fixture(scope="module")
def float_model(ckpts):
    return _load(ckpts["official"])


@pytest.fixture(scope="module")
def nvfp4_model(ckpts):
    return _load(ckpts["official"], quant="nvfp4")


def _held_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


# ----------------------------------------------------------------------------------------------- conversion
def test_the_loaded_dspark_is_nvfp4_with_lossless_experts(ckpts, float_model, nvfp4_model):
    fd, qd = float_model.dspark, nvfp4_model.dspark
    assert qd.quant_info["method"] == "nvfp4" and "dspark" not in dict(nvfp4_model.named_children())
    for fs, qs in zip(fd.mtp, qd.mtp):
        assert all(is_nvfp4(getattr(qs.attn, p)) for p in PROJ)
        assert qs.ffn.backend.quantized and not hasattr(qs.ffn, "experts")
        # the MXFP4 experts converted losslessly: their NVFP4 values are the float module's exactly
        for got, want in zip(qs.ffn.nvfp4.dequantized_experts(), (fs.ffn.experts.w1, fs.ffn.experts.w2,
                                                                  fs.ffn.experts.w3)):
            assert torch.equal(got, want.float())
    assert qd.mtp[0].main_proj.form is FLOAT  # kept in float, as the MTP block's projections are
    # ModelOpt's release keeps the DSpark experts MXFP4: the same NVFP4 module
    mo = _load(ckpts["modelopt"], quant="nvfp4").dspark.state_dict()
    assert mo.keys() == qd.state_dict().keys()
    assert all(torch.equal(v, qd.state_dict()[k]) for k, v in mo.items())


def test_quantize_model_converts_the_attached_dspark(float_model, nvfp4_model):
    model = quantize_model_(copy.deepcopy(float_model))
    assert model.dspark.quant_info and "dspark" not in dict(model.named_children())
    qa, qb = model.dspark.state_dict(), nvfp4_model.dspark.state_dict()
    assert qa.keys() == qb.keys()
    moe = [k for k in qa if ".ffn.nvfp4." in k]  # from float experts (per-tensor amax) vs lossless MXFP4
    assert moe and all(torch.equal(qa[k], qb[k]) for k in qa if k not in moe)
    for a, f in zip(model.dspark.mtp, float_model.dspark.mtp):  # the float experts to 4 bits
        for got, want in zip(a.ffn.nvfp4.dequantized_experts(), (f.ffn.experts.w1, f.ffn.experts.w2,
                                                                 f.ffn.experts.w3)):
            assert float((got - want).abs().mean() / want.abs().mean()) < 0.1
    back = dequantize_model_(model)
    assert back.dspark.quant_info is None and not back.dspark.mtp[0].ffn.backend.quantized


def _draft(model, dspark):
    """The DSpark block after two prompts (rings committed by the same main model) -> DSparkDraft."""
    ids, lengths = torch.tensor([PROMPT, PROMPT[::-1]]), torch.tensor([12, 9])
    anchor = prefill_taps(model, dspark, ids, lengths).argmax(-1)
    return dspark.draft(model, anchor, lengths - 1)


def test_nvfp4_draft_matches_its_dequantized_twin(ckpts):
    """The NVFP4 DSpark against a float DSpark holding exactly its values (the same main model, simulate_quant off):
    only the NVFP4 ops' bf16 activations differ. Measured: max |d logit| ~0.03, mean ~4e-3 (logits' std ~1); a
    twin with two experts of a stage exchanged is far off."""
    q = _load(ckpts["official"], quant="nvfp4", simulate_quant=False, max_batch_size=2)
    twin = dequantize_model_(copy.deepcopy(q.dspark))
    assert not any(is_nvfp4(m) or isinstance(m, Nvfp4MoE) for m in twin.modules())
    got, want = _draft(q, q.dspark), _draft(q, twin)

    def off(a, b):
        return float((a.logits - b.logits).abs().max()), float((a.confidence - b.confidence).abs().max())

    assert want.logits.std() > 0.5 and off(got, want) < (0.1, 0.1)
    assert torch.equal(got.tokens, want.tokens)
    # the bound's power: a wrong expert order breaks it
    ex = twin.mtp[1].ffn.experts
    with torch.no_grad():
        for w in (ex.w1, ex.w2, ex.w3):
            w[[0, 1]] = w[[1, 0]].clone()
    assert max(off(got, _draft(q, twin))) > 0.1


def test_nvfp4_draft_keeping_its_first_drafts(ckpts):
    """The NVFP4 module's draft(keep=k): the whole block's first k drafts (its last stage's NVFP4 MoE over k
    positions instead of the block's)."""
    q = _load(ckpts["official"], quant="nvfp4", simulate_quant=False, max_batch_size=2)
    ids, lengths = torch.tensor([PROMPT, PROMPT[::-1]]), torch.tensor([12, 9])
    anchor = prefill_taps(q, q.dspark, ids, lengths).argmax(-1)
    whole = q.dspark.draft(q, anchor, lengths - 1)
    for k in (1, 3):
        got = q.dspark.draft(q, anchor, lengths - 1, keep=k)
        assert torch.equal(got.tokens, whole.tokens[:, :k])
        torch.testing.assert_close(got.logits, whole.logits[:, :k], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.confidence, whole.confidence[:, :k], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- speculation
PROMPTS = [PROMPT, PROMPT[:5], [3, 14, 15, 92, 65, 35, 89, 79]]


def _engine(path, **kw):
    from dsv4_model.runtime.engine import Engine

    return Engine.from_pretrained(path, device="cpu", dtype=torch.bfloat16, max_batch_size=2, max_seq_len=128,
                                  progress=False, quant="nvfp4", **kw)


@pytest.fixture(scope="module")
def plain(ckpts):
    from dsv4_model.runtime.generate import generate

    res = generate(_engine(ckpts["official"], load_dspark=False), PROMPTS, max_new_tokens=60, stop_token_ids=[])
    assert all(len(set(t)) > 5 for t in res.token_ids)
    return res.token_ids


def test_nvfp4_dspark_speculation_gives_plain_greedy_tokens(ckpts, plain):
    """bf16 NVFP4 model (the NVFP4 MoE rows path in the verification) drafting with its NVFP4 DSpark."""
    from dsv4_model.runtime.generate import generate

    eng = _engine(ckpts["official"], spare_window_slots=3)
    assert isinstance(eng.model.dspark.mtp[0].ffn.nvfp4, Nvfp4MoE)
    res = generate(eng, PROMPTS, max_new_tokens=60, stop_token_ids=[], speculate=3)
    assert res.token_ids == plain


def test_nvfp4_dspark_every_acceptance_count(ckpts, plain, monkeypatch):
    """The NVFP4 DSpark still drafts (its rings are read), its tokens replaced by the plain continuation with the
    j-th of each block wrong (j = 0..K by turns): every acceptance count, the plain tokens."""
    from dsv4_model.runtime.generate import generate

    eng = _engine(ckpts["official"], spare_window_slots=3)
    dspark, K, seq = eng.model.dspark, 3, PROMPTS[0] + plain[0]
    real, calls = dspark.draft, []

    def oracle(model, anchor, last, stage_out=None, pick=None, keep=None):
        out = real(model, anchor, last, stage_out, pick, keep=keep)
        j, toks = len(calls) % (K + 1), out.tokens.clone()
        for b in range(toks.shape[0]):
            p = int(last[b]) + 2
            want = torch.tensor((seq + [0] * 64)[p:p + toks.shape[1]])
            if j < K:
                want[j] = (want[j] + 1) % model.config.vocab_size
            toks[b] = want
        calls.append(j)
        return out._replace(tokens=toks)

    monkeypatch.setattr(dspark, "draft", oracle)
    res = generate(eng, PROMPTS[:1], max_new_tokens=60, stop_token_ids=[], speculate=K)
    assert res.token_ids == plain[:1]
    acc = res.extra["speculation"].acceptance()
    assert all(0 < a < 1 for a in acc), acc


# ----------------------------------------------------------------------------------------------- parallel, memory
@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_expert_parallel_dspark_holds_its_slice(ckpts, quant, float_model, nvfp4_model):
    whole = (nvfp4_model if quant == "nvfp4" else float_model).dspark.state_dict()
    E = float_model.config.n_routed_experts
    for rank in (0, 1):
        shard = ExpertShard(rank, 2)
        model = _load(ckpts["official"], quant=quant, expert_shard=shard)
        state = model.dspark.state_dict()
        assert state.keys() == whole.keys()
        for k, v in state.items():
            routed = ".ffn.experts.w" in k or ".ffn.nvfp4.w" in k
            want = whole[k][rank * E // 2:(rank + 1) * E // 2] if routed else whole[k]
            assert torch.equal(v, want), k
        assert all(st.ffn.shard is shard for st in model.dspark.mtp)


@pytest.mark.parametrize("quant,ep", [("none", 1), ("nvfp4", 1), ("nvfp4", 2)])
def test_memory_plan_counts_the_loaded_dspark(ckpts, quant, ep):
    kw = dict(quant=quant, max_batch_size=2, dtype=torch.bfloat16)
    model = _load(ckpts["official"], expert_shard=ExpertShard(1, ep) if ep > 1 else None, **kw)
    cfg = model.config
    plan = memory_plan(cfg, max_seq_len=64, ep=ep, dspark_stages=3, **kw)
    assert plan.dspark == _held_bytes(model.dspark) > 0
    bare = memory_plan(cfg, max_seq_len=64, ep=ep, **kw)
    assert bare.dspark == 0 and plan.total == bare.total + plan.dspark
    assert "+ DSpark" in plan.describe() and "DSpark" not in bare.describe()


def test_the_loader_plans_the_dspark_bytes(ckpts, monkeypatch, capsys):
    from dsv4_model.checkpoint import loader

    model = _load(ckpts["official"], quant="nvfp4", progress=True)
    line = [ln for ln in capsys.readouterr().err.splitlines() if "memory on cpu" in ln]
    assert line and "+ DSpark" in line[0]
    need = memory_plan(model.config, max_seq_len=64, dtype=torch.float32, dspark_stages=3)
    monkeypatch.setattr(loader, "_free_device_bytes", lambda device: need.total - 1)  # the DSpark does not fit
    with pytest.raises(ValueError, match=r"\+ DSpark .* cpu has"):
        _load(ckpts["official"], quant="nvfp4")
    _load(ckpts["official"], quant="nvfp4", load_dspark=False)  # without it the model fits


# ----------------------------------------------------------------------------------------------- saving
@pytest.mark.parametrize("quant", ["nvfp4", "none"])
def test_a_dsv4_save_keeps_the_dspark_module(ckpts, float_model, nvfp4_model, tmp_path, quant):
    """save_model writes the attached DSpark under its mtp.* names as the model holds it (a converted checkpoint:
    its NVFP4 buffers), and the dsv4 checkpoint loads it back, every tensor equal; a mixed save is refused."""
    from dsv4_model.checkpoint.loader import save_model

    src = nvfp4_model if quant == "nvfp4" else float_model
    save_model(src, src.config, tmp_path / "saved")
    back = _load(tmp_path / "saved")
    assert back.dspark is not None and bool(getattr(back.dspark, "quant_info", None)) == (quant == "nvfp4")
    want, got = src.dspark.state_dict(), back.dspark.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    if quant == "nvfp4":  # read back as float: the dequantized values of the same module
        deq = _load(tmp_path / "saved", quant="none").dspark
        ref = dequantize_model_(copy.deepcopy(src.dspark))
        assert all(torch.equal(v, deq.state_dict()[k]) for k, v in ref.state_dict().items())
        mixed = copy.copy(float_model)
        object.__setattr__(mixed, "dspark", src.dspark)
        with pytest.raises(ValueError, match="DSpark module is held unlike the model"):
            save_model(mixed, float_model.config, tmp_path / "mixed")

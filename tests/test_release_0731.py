"""DeepSeek-V4-Flash-0731 (and V4-Pro-0813): the main model of a checkpoint that carries a DSpark speculative module
under `mtp.*` loads and generates exactly what the same main model without it does; the DSpark tensors are checked
and loaded into dsv4's DSpark module beside the main model (or left out: load_dspark=False), with one note, never
taken for an MTP block. DeepSeek-V4.1 is refused in one line (docs/dspark.md,
docs/v41.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4_model.checkpoint.io import CheckpointError, list_tensors
from dsv4_model.checkpoint.loader import load_config, load_model
from dsv4_model.checkpoint.memory_plan import memory_plan
from dsv4_model.checkpoint.writer import canonical_weights, make_config, write_checkpoint
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.dspark_config import DSparkConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLASH_0731_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]
DSPARK_KEYS = {"dspark_block_size": 5, "dspark_markov_rank": 256, "dspark_target_layer_ids": [40, 41, 42],
               "dspark_noise_token_id": 128799}
PROMPT = [0, 17, 42, 5, 88, 23, 61, 9, 30, 71, 2, 55]


def _dspark_cfg(noise_token_id: int = 95, **overrides):
    # the tiny main model without its MTP block, plus 3 window-only DSpark stages fed by its last 3 layers
    return make_config(n_mtp_layers=0, compress_ratios=[0, 4, 16, 4, 16],
                       dspark=DSparkConfig(block_size=5, markov_rank=8, target_layer_ids=(2, 3, 4),
                                           noise_token_id=noise_token_id, stage_ratios=(0, 0, 0)), **overrides)


def _write_hf_with_mtp(weights, cfg, out):
    """HF names for the main model and, as a converter that kept them would write, `model.mtp.*` for DSpark."""
    write_checkpoint(weights, cfg, out, "hf")  # (the HF writer leaves mtp.* out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update({"model." + n: w.contiguous() for n, w in weights.items() if n.startswith("mtp.")})
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("r0731")
    cfg = _dspark_cfg()
    weights = canonical_weights(cfg, seed=5)
    main = {n: w for n, w in weights.items() if not n.startswith("mtp.")}
    return {
        "official": write_checkpoint(weights, cfg, root / "official", "official"),
        "modelopt": write_checkpoint(weights, cfg, root / "modelopt", "modelopt"),
        "hf+mtp": _write_hf_with_mtp(weights, cfg, root / "hf"),
        # the same main model as V4-Flash minus MTP would ship it: no mtp.* tensors, no dspark_* keys
        "plain": write_checkpoint(main, dataclasses.replace(cfg, dspark=None), root / "plain", "official"),
    }


def _greedy(path, **kw):
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime.generate import generate

    eng = Engine.from_pretrained(path, max_seq_len=64, dtype=torch.float32, **kw)
    return eng, generate(eng, [PROMPT], max_new_tokens=10, temperature=0.0).token_ids[0]


@pytest.fixture(scope="module")
def plain_tokens(ckpts):
    eng, ids = _greedy(ckpts["plain"], progress=False)
    assert len(set(ids)) > 1  # a real continuation, not one token repeated
    return eng.model.state_dict(), ids


# ----------------------------------------------------------------------------------------------- config
def _official_0731(**extra):
    d = ModelConfig.v4_flash().to_dict()
    d.update({"compress_ratios": FLASH_0731_RATIOS, "n_mtp_layers": 3, **DSPARK_KEYS, **extra})
    return d


def test_0731_configs_give_the_flash_main_model_and_the_dspark_fields():
    flash = ModelConfig.v4_flash()
    hf = {**flash.to_hf_dict(), "compress_ratios": FLASH_0731_RATIOS, "num_nextn_predict_layers": 1, **DSPARK_KEYS}
    for d in (_official_0731(), hf):
        cfg = ModelConfig.from_dict(d)
        assert cfg.n_layers == 43 and cfg.compress_ratios == FLASH_0731_RATIOS[:43]
        assert cfg.n_mtp_layers == 0  # the mtp.* stages are DSpark's, whatever the MTP count keys say
        assert cfg.dspark == DSparkConfig(5, 256, (40, 41, 42), 128799, (0, 0, 0)) and cfg.dspark.n_stages == 3
        assert dataclasses.replace(cfg, dspark=None, n_mtp_layers=1, compress_ratios=flash.compress_ratios,
                                   expert_dtype=None, quantization_config=None) == \
            dataclasses.replace(flash, expert_dtype=None, quantization_config=None)
        # round trips, in the release's own key layout
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
        assert cfg.to_dict()["compress_ratios"] == FLASH_0731_RATIOS
        assert {k: cfg.to_dict()[k] for k in DSPARK_KEYS} == DSPARK_KEYS
        back = ModelConfig.from_dict(cfg.to_hf_dict())
        assert back.dspark == cfg.dspark and back.compress_ratios == cfg.compress_ratios
    # layer_types only (one entry per main layer): the stage count is left to the checkpoint
    lt = {k: v for k, v in hf.items() if k != "compress_ratios"}
    cfg = ModelConfig.from_dict(lt)
    assert cfg.dspark.n_stages is None and len(cfg.compress_ratios) == 43 and cfg.n_mtp_layers == 0


def test_0731_official_configs_agree_though_they_count_the_mtp_stages_differently(ckpts):
    # config.json keeps V4-Flash's one MTP layer, inference/config.json counts the three DSpark stages: that is
    # the release's own layout, not a disagreement to warn about
    assert json.loads((ckpts["official"] / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(ckpts["official"]).dspark.n_stages == 3


def test_0731_official_configs_disagreeing_on_a_dspark_key_are_named(ckpts, tmp_path):
    """The drafter's keys are compared too: a config.json whose dspark_block_size / dspark_target_layer_ids differ
    from inference/config.json's (the one read) is named in the warning, the inference file still decides."""
    import shutil

    d = tmp_path / "official"
    shutil.copytree(ckpts["official"], d)
    hf = json.loads((d / "config.json").read_text())
    want = load_config(ckpts["official"]).dspark
    hf["dspark_block_size"] = want.block_size + 2
    hf["dspark_target_layer_ids"] = list(want.target_layer_ids[:-1]) + [0]
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.warns(UserWarning) as rec:
        got = load_config(d)
    assert got.dspark == want
    (msg,) = [str(w.message) for w in rec]
    assert f"dspark_block_size {want.block_size} there, {want.block_size + 2} in config.json" in msg, msg
    assert f"dspark_target_layer_ids {want.target_layer_ids!r} there" in msg, msg


def test_plain_flash_config_still_has_its_mtp_block():
    cfg = ModelConfig.from_dict({k: v for k, v in _official_0731().items() if not k.startswith("dspark_")}
                                | {"n_mtp_layers": 1})
    assert cfg.dspark is None and cfg.n_mtp_layers == 1 and len(cfg.compress_ratios) == 44


@pytest.mark.parametrize("change, want", [
    ({"dspark_markov_rank": None}, "dspark_markov_rank: missing"),
    ({"dspark_block_size": 0}, "dspark_block_size: must be a positive int"),
    ({"dspark_target_layer_ids": [40, 43]}, "dspark_target_layer_ids: must be distinct main-layer ids in [0, n_layers=43)"),
    ({"dspark_target_layer_ids": 40}, "dspark_target_layer_ids: must be a list"),
    ({"dspark_noise_token_id": 129280}, "dspark_noise_token_id: must be a token id in [0, vocab_size=129280)"),
    ({"compress_ratios": FLASH_0731_RATIOS[:-1] + [4]}, "compress_ratios: the entries past n_layers=43 are the DSpark"),
])
def test_bad_dspark_config_names_the_field(change, want):
    d = {k: v for k, v in _official_0731(**change).items() if v is not None}
    with pytest.raises(ValueError, match="^" + re.escape(want)):
        ModelConfig.from_dict(d)


def test_what_reads_the_config_sees_the_main_model_only():
    cfg = _dspark_cfg()
    assert cfg.sliced(3).dspark is None  # a cut model: the target layers no longer exist
    plain = dataclasses.replace(cfg, dspark=None)
    kw = dict(max_seq_len=64, quant="none", dtype=torch.float32)
    assert memory_plan(cfg, **kw) == memory_plan(plain, **kw)


# ----------------------------------------------------------------------------------------------- the layout
def test_writer_writes_the_release_layout(ckpts):
    official = ckpts["official"]
    inf = json.loads((official / "inference" / "config.json").read_text())
    hf = json.loads((official / "config.json").read_text())
    assert inf["compress_ratios"] == [0, 4, 16, 4, 16, 0, 0, 0] and inf["n_mtp_layers"] == 3
    assert hf["compress_ratios"] == inf["compress_ratios"] and hf["num_nextn_predict_layers"] == 1
    assert inf["dspark_target_layer_ids"] == hf["dspark_target_layer_ids"] == [2, 3, 4]
    t = list_tensors(official)
    d, rank, vocab = 64, 8, 96
    want = {  # name: (dtype, shape), written from the release's description (docs/dspark.md)
        "mtp.0.main_proj.weight": ("F8_E4M3", (d, 3 * d)), "mtp.0.main_norm.weight": ("BF16", (d,)),
        "mtp.2.markov_head.markov_w1.weight": ("BF16", (vocab, rank)),
        "mtp.2.markov_head.markov_w2.weight": ("F32", (vocab, rank)),
        "mtp.2.confidence_head.proj.weight": ("F32", (1, d + rank)), "mtp.2.hc_head_fn": ("F32", (4, 4 * d)),
        "mtp.1.ffn.gate.bias": ("F32", (8,)), "mtp.1.attn.wkv.weight": ("F8_E4M3", (80, d)),
        "mtp.1.ffn.experts.3.w2.weight": ("I8", (d, 16)),
    }
    for name, (dtype, shape) in want.items():
        assert (t[name].dtype, t[name].shape) == (dtype, shape), name
    assert "mtp.0.main_proj.scale" in t
    assert not any(k.startswith(("mtp.0.norm.", "mtp.1.markov", "mtp.0.hc_head", "mtp.0.e_proj")) for k in t)
    assert not any(k.startswith("mtp.") and ("compressor" in k or "indexer" in k or "tid2eid" in k) for k in t)
    mo = list_tensors(ckpts["modelopt"])
    assert "layers.3.ffn.experts.0.w1.weight_scale_2" in mo and "mtp.1.ffn.experts.0.w1.scale" in mo


# ----------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("layout", ["official", "modelopt", "hf+mtp"])
def test_0731_loads_and_generates_what_the_plain_main_model_does(ckpts, plain_tokens, layout, capfd):
    ref_state, ref_ids = plain_tokens
    capfd.readouterr()
    eng, ids = _greedy(ckpts[layout], progress=True)
    err = capfd.readouterr().err
    assert ids == ref_ids
    assert eng.config.n_mtp_layers == 0 and len(eng.model.mtp) == 0
    state = eng.model.state_dict()
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)
    n = sum(k.startswith(("mtp.", "model.mtp.")) for k in list_tensors(ckpts[layout]))
    notes = [ln for ln in err.splitlines() if "DSpark speculative module" in ln]  # (not the memory line)
    assert notes == [f"[dsv4] {ckpts[layout]}: DSpark speculative module (3 stages, {n} tensors) loaded "
                     "(docs/dspark.md)"], err
    # the stages hold the checkpoint's values (FP8 / MXFP4 dequantized), beside the main model
    dspark = eng.model.dspark
    assert dspark.n_stages == 3 and not any(k.startswith("dspark") for k in state)
    got = dspark.state_dict()
    want = canonical_weights(_dspark_cfg(), seed=5)
    for name, w in want.items():
        if name.startswith("mtp."):
            m = re.match(r"(mtp\.\d+\.ffn\.experts)\.(\d+)\.(w\d)\.weight$", name)
            mine = got[f"{m[1]}.{m[3]}"][int(m[2])] if m else got[name]
            assert torch.equal(mine, w.to(mine.dtype)), name


def test_load_dspark_false_leaves_it_out(ckpts, capfd):
    capfd.readouterr()
    model, _ = load_model(ckpts["official"], progress=True, max_seq_len=64, load_dspark=False)
    assert model.dspark is None
    n = sum(k.startswith("mtp.") for k in list_tensors(ckpts["official"]))
    notes = [ln for ln in capfd.readouterr().err.splitlines() if "DSpark" in ln]
    assert notes == [f"[dsv4] {ckpts['official']}: DSpark speculative module (3 stages, {n} tensors) not loaded "
                     "(load_dspark=False; the CLI and serve load it with --speculate) (docs/dspark.md)"]


def test_no_note_when_progress_is_off_or_the_tensors_are_absent(ckpts, tmp_path, capfd):
    _, cfg = load_model(ckpts["official"], progress=False, max_seq_len=64)
    assert cfg.dspark is not None
    # an HF conversion that dropped mtp.* but kept the config keys
    cfg = _dspark_cfg()
    write_checkpoint({n: w for n, w in canonical_weights(cfg, seed=5).items() if not n.startswith("mtp.")}, cfg,
                     tmp_path, "hf")
    model, cfg2 = load_model(tmp_path, progress=True, max_seq_len=64)
    assert cfg2.dspark.n_stages == 3 and model.dspark is None
    assert "DSpark" not in capfd.readouterr().err
    with pytest.raises(CheckpointError, match="load_dspark=True, and the checkpoint has no DSpark tensors"):
        load_model(tmp_path, progress=False, max_seq_len=64, load_dspark=True)


@pytest.fixture
def no_device_work(monkeypatch):
    def forbidden(self, *a, **k):
        raise AssertionError("to_empty called before the checkpoint was validated")

    monkeypatch.setattr(torch.nn.Module, "to_empty", forbidden)


def _edited_copy(src, dst, edit):
    """A copy of the official checkpoint `src` (one shard) with `edit(tensors)` applied to its tensors."""
    import shutil

    shutil.copytree(src, dst)
    shard = next(dst.glob("*.safetensors"))
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    return dst


@pytest.mark.parametrize("edit, want", [
    (lambda t: t.update({"mtp.2.markov_head.markov_w1.weight": torch.zeros(96, 9, dtype=torch.bfloat16)}),
     "'mtp.2.markov_head.markov_w1.weight': shape mismatch: expected [96, 8], got [96, 9]"),
    (lambda t: t.update({"mtp.0.main_proj.weight": torch.zeros(64, 128).to(torch.float8_e4m3fn)}),
     "'mtp.0.main_proj.weight': shape mismatch: expected [64, 192]"),
    (lambda t: t.pop("mtp.2.confidence_head.proj.weight"),
     "missing tensor: 'mtp.2.confidence_head.proj.weight' (expected shape [1, 72]"),
    (lambda t: t.update({"mtp.3.attn_norm.weight": torch.ones(64, dtype=torch.bfloat16)}),
     "unexpected tensor 'mtp.3.attn_norm.weight'"),
])
def test_a_wrong_dspark_tensor_is_refused_naming_it(ckpts, tmp_path, no_device_work, edit, want):
    bad = _edited_copy(ckpts["official"], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        load_model(bad, progress=False, max_seq_len=64)
    msg = str(e.value)
    assert msg.startswith(f"{bad}: checkpoint does not match the DSpark module its config describes (3 stages)")
    assert want in msg and msg.count("\n") == 1, msg


def test_mtp_speculation_on_a_dspark_checkpoint_says_it_has_dspark(ckpts, no_device_work):
    with pytest.raises(CheckpointError) as e:
        load_model(ckpts["official"], progress=False, max_seq_len=64, load_mtp=True)
    msg = str(e.value)
    assert "\n" not in msg and str(ckpts["official"]) in msg
    assert "DSpark speculative module (3 stages" in msg and "not MTP" in msg and "docs/dspark.md" in msg


def test_spare_slots_need_the_dspark_module_loaded(ckpts, no_device_work):
    with pytest.raises(CheckpointError) as e:
        load_model(ckpts["official"], progress=False, max_seq_len=64, spare_window_slots=2, load_dspark=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{ckpts['official']}: spare_window_slots > 0 is for speculative")
    assert "DSpark module (3 stages), not loaded here: load_dspark=False (docs/dspark.md)" in msg


# ----------------------------------------------------------------------------------------------- V4.1
def _v41_variants(flash):
    return {
        "model_type": {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                       "text_config": {"hidden_size": 5120, "num_hidden_layers": 40}, "vision_config": {}},
        "nested": {"model_type": "deepseek_v41_vl", "text_config": {"model_type": "deepseek_v41"}},
        "kv_reuse": {**flash, "kv_source_layer_ids": [1, 2]},
        "engram": {**flash, "engram_layer_ids": [0], "engram_num_embeddings": [100]},
    }


@pytest.mark.parametrize("variant", ["model_type", "nested", "kv_reuse", "engram"])
def test_v41_config_is_refused_before_any_tensor_is_read(tmp_path, variant, no_device_work):
    d = _v41_variants(ModelConfig.v4_flash().to_hf_dict())[variant]
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail otherwise
    for call in (load_config, lambda p: load_model(p, progress=False)):
        with pytest.raises(CheckpointError) as e:
            call(tmp_path)
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / 'config.json'}: DeepSeek-V4.1 (") and "\n" not in msg
        assert "is a different architecture" in msg and "docs/v41.md" in msg
    with pytest.raises(ValueError, match="^DeepSeek-V4.1 "):
        ModelConfig.from_dict(d)


def test_v41_refusal_through_the_cli_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_v41_variants({})["model_type"]))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "dsv4_model", "generate", "--model", str(tmp_path), "--prompt", "x"],
                       cwd=ROOT, env=env, capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b"" and "Traceback" not in err, err
    assert err.splitlines() == [f"error: {tmp_path / 'config.json'}: DeepSeek-V4.1 (model_type deepseek_v41) is a "
                                "different architecture (Engram tables, CSA2 with cross-layer KV reuse) that dsv4 "
                                "does not run yet; see docs/v41.md"]

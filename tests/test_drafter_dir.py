"""A DSpark drafter directory (checkpoint/drafter.py: scripts/train_dspark.py's output) loaded with a main checkpoint
that has none, or in place of the one it has: the module equals the directory's tensors, held float or NVFP4 as
the model is, drafts greedy output identical to plain decoding, and every malformed directory is one clear error
before any weight is read (docs/dspark.md)."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

from dsv4_model.checkpoint.builtin import default_model_path
from dsv4_model.checkpoint.drafter import CONFIG_NAME, WEIGHTS_NAME
from dsv4_model.checkpoint.io import CheckpointError
from dsv4_model.checkpoint.loader import load_config, load_drafter, load_model
from dsv4_model.checkpoint.writer import canonical_weights, write_checkpoint
from dsv4_model.model.dspark import DSpark
from dsv4_model.model.dspark_config import DSparkConfig
from dsv4_model.quant.quantize_model import quantize_model_
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from tests.test_release_0731 import _dspark_cfg


def write_drafter(out, cfg, dspark: DSpark, n_stages: int, **config_overrides):
    """A drafter directory as scripts/train_dspark.py writes it (fp32 tensors, the release's dspark_* keys)."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in dspark.state_dict().items()}, str(out / WEIGHTS_NAME))
    keys = {**cfg.dspark.config_keys(), "n_stages": n_stages, **config_overrides}
    (out / CONFIG_NAME).write_text(json.dumps(keys))
    return out


def _random_dspark(cfg, seed: int) -> DSpark:
    return DSpark(cfg, 3, dtype=torch.float32, simulate_quant=False).init_random_weights(seed)


def _load(path, **kw):
    return load_model(path, **{"dtype": torch.float32, "max_seq_len": 64, "progress": False, **kw})[0]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny 0731-layout checkpoint, and a drafter directory holding another (random) DSpark for it."""
    root = tmp_path_factory.mktemp("drafter")
    cfg = _dspark_cfg()
    ckpt = write_checkpoint(canonical_weights(cfg, seed=5), cfg, root / "official", "official")
    other = _random_dspark(cfg, seed=11)
    return cfg, ckpt, write_drafter(root / "other", cfg, other, 3), other


@pytest.fixture(scope="module")
def builtin_drafter(tmp_path_factory):
    """A random DSpark for the built-in model (no DSpark of its own: it carries an MTP block)."""
    path, _ = default_model_path()
    base = load_config(path)
    cfg = DSparkConfig(5, 16, tuple(range(base.n_layers - 3, base.n_layers)), 0, stage_ratios=(0, 0, 0))
    import dataclasses

    cfg = dataclasses.replace(base, dspark=cfg.validate(base.n_layers, base.vocab_size), n_mtp_layers=0,
                              compress_ratios=list(base.compress_ratios)[: base.n_layers])
    d = _random_dspark(cfg, seed=3)
    return path, write_drafter(tmp_path_factory.mktemp("builtin_drafter") / "d", cfg, d, 3), d


def test_a_drafter_replaces_the_checkpoints_own(release):
    cfg, ckpt, drafter, other = release
    own = _load(ckpt).dspark
    model = _load(ckpt, drafter=drafter)
    got, want = model.dspark.state_dict(), other.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(v, own.state_dict()[k]) for k, v in got.items())  # not the checkpoint's
    # the main model is the checkpoint's either way
    base = _load(ckpt).state_dict()
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())


def test_load_drafter_builds_the_same_module_apart(release):
    cfg, ckpt, drafter, other = release
    d = load_drafter(drafter, load_config(ckpt), dtype=torch.float32, simulate_quant=False)
    assert d.state_dict().keys() == other.state_dict().keys()
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in d.state_dict().items())


def test_a_drafter_is_held_nvfp4_with_the_model(release):
    _, ckpt, drafter, _ = release
    float_model = _load(ckpt, drafter=drafter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = _load(ckpt, drafter=drafter, quant="nvfp4").dspark
        want = quantize_model_(copy.deepcopy(float_model)).dspark  # the same float tensors converted after loading
    assert q.quant_info["method"] == "nvfp4"
    sq, sw = q.state_dict(), want.state_dict()
    assert sq.keys() == sw.keys() and all(torch.equal(sq[k], sw[k]) for k in sw)


def test_a_drafter_with_a_converted_nvfp4_checkpoint(release, tmp_path):
    """A dsv4 save of the NVFP4 model (stored NVFP4 buffers, its own DSpark inside): the drafter replaces that
    DSpark, converted at load as on the original checkpoint; quant="none" keeps it float."""
    from dsv4_model.checkpoint.loader import save_model

    _, ckpt, drafter, other = release
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, cfg = load_model(ckpt, dtype=torch.float32, max_seq_len=64, progress=False, quant="nvfp4")
        save_model(model, cfg, tmp_path / "saved")
        want = _load(ckpt, drafter=drafter, quant="nvfp4").dspark.state_dict()
        got = _load(tmp_path / "saved", drafter=drafter).dspark.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    floats = _load(tmp_path / "saved", drafter=drafter, quant="none").dspark.state_dict()
    assert all(torch.equal(floats[k], v) for k, v in other.state_dict().items())


def test_a_drafter_on_a_model_with_an_mtp_block_speculates_as_plain_greedy(builtin_drafter):
    path, drafter, d = builtin_drafter
    torch.manual_seed(0)
    eng = Engine.from_pretrained(path, dtype=torch.float32, max_seq_len=256, drafter=drafter,
                                 spare_window_slots=4, progress=False)
    assert eng.model.mtp is None or len(eng.model.mtp) == 0  # the checkpoint's MTP block is not read
    assert eng.config.dspark.block_size == 5
    ids = [[int(t) for t in torch.randint(3, eng.config.vocab_size, (12,))]]
    plain = generate(eng, ids, max_new_tokens=40)
    spec = generate(eng, ids, max_new_tokens=40, speculate=4)
    assert spec.token_ids == plain.token_ids
    assert spec.extra["speculation"].steps < 40  # drafts were verified, not one token per step


@pytest.mark.parametrize("case", [
    ("no directory", lambda p: p / "nowhere", "not a directory"),
    ("no config", lambda p: (p / CONFIG_NAME).unlink() or p, f"no {CONFIG_NAME}"),
    ("no weights", lambda p: (p / WEIGHTS_NAME).unlink() or p, f"no {WEIGHTS_NAME}"),
    ("a key missing", lambda p: _edit(p, drop="dspark_markov_rank"), "dspark_markov_rank: missing"),
    ("n_stages not an int", lambda p: _edit(p, n_stages="3"), "n_stages: must be a positive int"),
    ("a target layer past the model", lambda p: _edit(p, dspark_target_layer_ids=[2, 3, 9]),
     "dspark_target_layer_ids: must be distinct main-layer ids"),
    ("a rank unlike the tensors'", lambda p: _edit(p, dspark_markov_rank=4), "markov_head.markov_w1.weight"),
    ("more stages than the tensors", lambda p: _edit(p, n_stages=4), "mtp.3."),
], ids=lambda c: c[0])
def test_a_bad_drafter_is_one_error_before_any_weight_is_read(case, release, tmp_path):
    import shutil

    _, ckpt, drafter, _ = release
    _, make, want = case
    copy_ = tmp_path / "d"
    shutil.copytree(drafter, copy_)
    with pytest.raises(CheckpointError, match=want.replace(".", r"\.")):
        _load(ckpt, drafter=make(copy_))


def _edit(path, drop: str | None = None, **set_):
    keys = json.loads((path / CONFIG_NAME).read_text())
    keys.pop(drop, None)
    keys.update(set_)
    (path / CONFIG_NAME).write_text(json.dumps(keys))
    return path


def test_drafter_with_load_dspark_false_is_refused(release):
    _, ckpt, drafter, _ = release
    with pytest.raises(ValueError, match="load_dspark=False"):
        _load(ckpt, drafter=drafter, load_dspark=False)


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_generate_with_a_drafter_prints_plain_greedy_ids(builtin_drafter, capfd):
    from dsv4_model.runtime.cli import main

    _, drafter, _ = builtin_drafter
    common = ["generate", "--prompt", "The city", "--max-new-tokens", "24",
              "--json", "--device", "cpu", "--dtype", "float32"]
    assert main(common) == 0
    plain = json.loads(capfd.readouterr().out)
    assert main([*common, "--speculate", "3", "--drafter", str(drafter)]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["ids"] == plain["ids"]
    assert "speculation:" in err and str(drafter) in err  # the loader's note names the drafter it loaded


@pytest.mark.parametrize("extra, want", [
    ([], "--drafter: the DSpark module drafts for speculative decoding: it needs --speculate K"),
    (["--speculate", "2", "--speculate-method", "mtp"], "it contradicts --speculate-method mtp"),
])
def test_cli_drafter_refusals_are_one_line_exit_2(extra, want, tmp_path, capfd):
    from dsv4_model.runtime.cli import main

    rc = main(["generate", "--prompt", "x", "--drafter", str(tmp_path), *extra])
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], err

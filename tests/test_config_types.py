"""A config number of the wrong type (a string, a bool, inf / nan, a non-integer where an integer goes, a scalar where
a list goes) is refused in one CheckpointError naming its key and value, before any weight is read: not passed on,
not cut to an int, not a traceback or a message without the key."""

import json
import re
import shutil

import pytest

from dsv4_model.checkpoint.io import CheckpointError
from dsv4_model.checkpoint.loader import load_config
from dsv4_model.checkpoint.writer import make_config, write_tiny_checkpoint
from dsv4_model.model.config import ModelConfig

from test_model_config import HF_LEGACY_FLASH, OFFICIAL_FLASH

INF = float("inf")
NAN = float("nan")

# (key as the official / dsv4 config.json spells it, bad value)
OFFICIAL_CASES = [
    ("rope_theta", "10000"), ("route_scale", "1.5"), ("norm_eps", "1e-6"), ("beta_fast", "x"),
    ("rope_factor", "16"), ("rope_theta", INF), ("rope_theta", NAN), ("compress_rope_theta", -INF),
    ("route_scale", True), ("hc_eps", "1e-6"), ("beta_slow", None), ("swiglu_limit", "x"),
    ("n_layers", "abc"), ("n_layers", "4"), ("n_layers", 4.0), ("n_layers", 4.5), ("dim", True),
    ("n_mtp_layers", "1"), ("hc_sinkhorn_iters", 20.5), ("original_seq_len", 65536.5),
    ("compress_ratios", 5), ("compress_ratios", "0,4"),
]
# (key as the HF config.json spells it, bad value)
HF_CASES = [
    ("rope_theta", "10000"), ("routed_scaling_factor", "1.5"), ("rms_norm_eps", "1e-6"), ("rope_theta", INF),
    ("compress_rope_theta", "160000"), ("hc_eps", NAN), ("swiglu_limit", "x"), ("swiglu_limit", INF),
    ("partial_rotary_factor", "x"), ("partial_rotary_factor", True),
    ("num_hidden_layers", 5.9), ("num_hidden_layers", "5"), ("num_hidden_layers", "abc"), ("head_dim", 80.9),
    ("hidden_size", "64"), ("num_nextn_predict_layers", 1.5), ("sliding_window", 8.0), ("bos_token_id", "0"),
    ("compress_ratios", 5), ("layer_types", 5), ("layer_types", "sliding_attention"), ("compress_rates", 5),
    ("compress_rates", [4, 8]), ("mlp_layer_types", 5), ("num_hash_layers", 2.5),
]
# (path into the HF config's rope_parameters, bad value): named by that dotted path
HF_ROPE_CASES = [
    ("rope_parameters.main.rope_theta", "10000"), ("rope_parameters.main.rope_theta", INF),
    ("rope_parameters.compress.factor", "16"), ("rope_parameters.compress.beta_fast", "x"),
    ("rope_parameters.compress.original_max_position_embeddings", 65536.9),
    ("rope_parameters.main.partial_rotary_factor", NAN),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """layout -> a tiny checkpoint directory (written once; each test copies it)."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for layout in ("dsv4", "hf"):
        write_tiny_checkpoint(root / layout, layout, seed=0)
        dirs[layout] = root / layout
    return dirs


def _edited(tiny, tmp_path, layout, edit):
    out = tmp_path / layout
    shutil.copytree(tiny[layout], out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))  # (inf / nan as JSON's Infinity / NaN, as Python reads them)
    return out


def _set(path, value):
    def edit(cfg):
        *parents, last = path.split(".")
        d = cfg
        for p in parents:
            d = d[p]
        d[last] = value
    return edit


def _refused(path, key, value, layout):
    with pytest.raises(CheckpointError) as e:
        load_config(path, layout)
    msg = str(e.value)
    assert f"{key}:" in msg and repr(value) in msg, msg
    assert msg.count("\n") == 0
    for noise in ("invalid literal", "could not convert", "not supported between", "__round__", "not iterable"):
        assert noise not in msg, msg


@pytest.mark.parametrize("key, value", OFFICIAL_CASES, ids=lambda v: repr(v))
def test_official_config_bad_number_is_refused_by_key(tiny, tmp_path, key, value):
    path = _edited(tiny, tmp_path, "dsv4", _set(key, value))
    _refused(path, key, value, "dsv4")


@pytest.mark.parametrize("key, value", HF_CASES + HF_ROPE_CASES, ids=lambda v: repr(v))
def test_hf_config_bad_number_is_refused_by_key(tiny, tmp_path, key, value):
    def edit(cfg):
        _set(key, value)(cfg)
        if key == "compress_ratios":  # read before layer_types
            cfg.pop("layer_types")
    path = _edited(tiny, tmp_path, "hf", edit)
    _refused(path, key, value, "hf")


def test_compress_ratio_entry_is_not_truncated(tiny, tmp_path):
    def edit(cfg):
        cfg["compress_ratios"][1] = 4.9
    _refused(_edited(tiny, tmp_path, "dsv4", edit), "compress_ratios", 4.9, "dsv4")

    def edit_hf(cfg):
        cfg["compress_ratios"] = [0, 4.9, 8, 4, 0]
        cfg.pop("layer_types")
    with pytest.raises(CheckpointError, match=r"compress_ratios: .*4\.9"):
        load_config(_edited(tiny, tmp_path / "hf2", "hf", edit_hf), "hf")


def test_hf_compress_rate_is_not_truncated(tiny, tmp_path):
    def edit(cfg):
        cfg["compress_rates"]["heavily_compressed_attention"] = 8.5
    with pytest.raises(CheckpointError, match=r"compress_rates\.heavily_compressed_attention: .*8\.5"):
        load_config(_edited(tiny, tmp_path, "hf", edit), "hf")


def test_partial_rotary_factor_giving_no_whole_dim_count_is_refused(tiny, tmp_path):
    def edit(cfg):  # x head_dim 80 = 16.8 (was rounded to 17, then refused as odd; 0.1875 -> 15 likewise)
        cfg["partial_rotary_factor"] = cfg["rope_parameters"]["main"]["partial_rotary_factor"] = 0.21
    with pytest.raises(CheckpointError, match=r"partial_rotary_factor: .*whole number.*0\.21"):
        load_config(_edited(tiny, tmp_path, "hf", edit), "hf")

    def nested_only(cfg):
        del cfg["partial_rotary_factor"]
        cfg["rope_parameters"]["main"]["partial_rotary_factor"] = 0.21
    with pytest.raises(CheckpointError, match=r"rope_parameters\.main\.partial_rotary_factor: .*whole number"):
        load_config(_edited(tiny, tmp_path / "nested", "hf", nested_only), "hf")


@pytest.mark.parametrize("layout", ["dsv4", "hf"])
def test_valid_numbers_still_load(tiny, layout):
    """Unedited tiny configs load, and an integral real (rope_theta 10000 as a JSON int) is still a real."""
    cfg, written = load_config(tiny[layout], layout), make_config("tiny")
    assert (cfg.n_layers, cfg.compress_ratios, cfg.rope_head_dim, cfg.rope_theta, cfg.route_scale) == (
        written.n_layers, written.compress_ratios, written.rope_head_dim, written.rope_theta, written.route_scale)
    d = dict(OFFICIAL_FLASH, rope_theta=10000, rope_factor=16, beta_fast=32)
    assert ModelConfig.from_dict(d).rope_theta == 10000
    assert ModelConfig.from_dict(HF_LEGACY_FLASH).n_layers == 43


@pytest.mark.parametrize("name, value", [("rope_theta", "10000"), ("swiglu_limit", "x"), ("norm_eps", INF),
                                         ("rope_factor", NAN), ("beta_fast", True)])
def test_validate_refuses_a_mistyped_real(name, value):
    """A config built in code (not read from a file) gets the same check from validate()."""
    with pytest.raises(ValueError, match=re.escape(f"ModelConfig.{name}: must be a finite number")):
        ModelConfig(**{name: value}).validate()


@pytest.mark.parametrize("alias, key, value", [
    ("n_layers", "num_hidden_layers", None), ("dim", "hidden_size", None), ("norm_eps", "rms_norm_eps", None),
    ("num_local_experts", "n_routed_experts", None), ("score_func", "scoring_func", "softmax"),
])
def test_hf_config_two_names_of_a_field_must_agree(tiny, tmp_path, alias, key, value):
    """An HF config giving a field under two of the names the reader accepts (its own and the official one) with
    different values is refused naming both; the same value under both still loads."""
    base = json.loads((tiny["hf"] / "config.json").read_text())
    same = base[key]
    path = _edited(tiny, tmp_path / "same", "hf", _set(alias, same))
    assert getattr(load_config(path, "hf"), {"num_local_experts": "n_routed_experts"}.get(alias, alias)) == same
    other = value if value is not None else (same * 2 if isinstance(same, int) else same * 10)
    with pytest.raises(CheckpointError) as e:
        load_config(_edited(tiny, tmp_path / "differ", "hf", _set(alias, other)), "hf")
    msg = str(e.value)
    assert f"{key} and {alias}: two names of one field" in msg and repr(same) in msg and repr(other) in msg, msg

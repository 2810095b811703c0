"""A bad checkpoint is one CheckpointError naming the file / tensor / field, raised before any weight is read (the
CLI: one line, exit 2): a corrupt, oversized or missing tokenizer.json, a shard whose header leaves a hole or
overlaps two tensors, rope_parameters that is not an object, bos / eos ids outside the vocabulary, a foreign
model_type, and a missing tensor named by its checkpoint key (an orphaned `.scale` reported as its missing weight)."""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dsv4_model.checkpoint import io as ckpt_io
from dsv4_model.checkpoint.io import SINGLE_NAME, CheckpointError, list_tensors, read_header
from dsv4_model.checkpoint.loader import load_config, load_model
from dsv4_model.checkpoint.tokenizer import BYTE_FALLBACK_MAX_VOCAB, ByteTokenizer, HFTokenizer, load_tokenizer
from dsv4_model.checkpoint.writer import make_config, write_tiny_checkpoint
from dsv4_model.model.config import ModelConfig
from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Any tensor read fails the test: the error must come from the headers, config and tokenizer alone."""
    def read(self, info):
        raise AssertionError(f"weight {info.key!r} read before the error")

    monkeypatch.setattr(ckpt_io.TensorReader, "read", read)


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, progress=False, max_seq_len=64)


def _copy_default(tmp_path, name="m") -> Path:
    d = tmp_path / name
    shutil.copytree(DEFAULT_MODEL_DIR, d)
    return d


def _edit_config(d: Path, **changes) -> None:
    p = d / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


def _cli_one_line(capfd, argv) -> str:
    from dsv4_model.runtime.cli import main

    rc = main(argv)
    out, err = capfd.readouterr()
    lines = [ln for ln in err.splitlines() if not ln.startswith("[dsv4] ")]
    assert rc == 2, err
    assert out == "" and "Traceback" not in err and "loading " not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ------------------------------------------------------------------ tokenizer.json

def test_a_corrupt_tokenizer_is_one_error_naming_the_file(tmp_path, no_weight_reads, capfd):
    d = _copy_default(tmp_path)
    (d / "tokenizer.json").write_text("{not json")
    want = f"{d / 'tokenizer.json'}: cannot read the tokenizer: "
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(d, load_config(d))
    assert str(e.value).startswith(want) and "key must be a string" in str(e.value)
    with pytest.raises(CheckpointError, match="cannot read the tokenizer"):
        _load(d)  # the loader checks it before any weight is read
    assert want in _cli_one_line(capfd, ["generate", "--model", str(d), "--prompt", "x"])


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_the_load(tmp_path, no_weight_reads, capfd):
    d = tmp_path / "tiny"
    write_tiny_checkpoint(d, "official")  # vocab_size 96
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", d)  # 4096 ids
    want = f"{d / 'tokenizer.json'}: the tokenizer has 4096 token ids (added tokens included), more than the model's " \
           "vocab_size 96"
    with pytest.raises(CheckpointError) as e:
        _load(d)
    assert str(e.value).startswith(want)
    assert want in _cli_one_line(capfd, ["generate", "--model", str(d), "--prompt", "x"])


def test_a_missing_tokenizer_is_refused_where_bytes_would_be_meaningless(tmp_path, no_weight_reads, capfd):
    d = _copy_default(tmp_path)  # vocab_size 4096: trained with its own tokenizer
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(d, load_config(d))
    msg = str(e.value)
    assert msg.startswith(f"{d / 'tokenizer.json'}: missing: a model with vocab_size 4096 needs its own tokenizer")
    assert "hf download" in msg
    assert "tokenizer.json: missing" in _cli_one_line(capfd, ["generate", "--model", str(d), "--prompt", "x"])


def test_the_byte_fallback_stays_for_byte_sized_vocabularies_and_no_checkpoint(tmp_path):
    d = tmp_path / "tiny"
    cfg = write_tiny_checkpoint(d, "dsv4")  # random tiny checkpoints ship no tokenizer
    assert isinstance(load_tokenizer(d, cfg), ByteTokenizer)
    big = make_config(vocab_size=BYTE_FALLBACK_MAX_VOCAB + 1)
    assert isinstance(load_tokenizer(None, big), ByteTokenizer)  # no checkpoint directory: asked for
    assert isinstance(load_tokenizer(d, make_config(vocab_size=BYTE_FALLBACK_MAX_VOCAB)), ByteTokenizer)
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        load_tokenizer(d, big)
    # the Python API's engine (token-id prompts on a random full-size checkpoint): the fallback, said once
    with pytest.warns(UserWarning, match="tokenizer.json is missing: byte-level fallback"):
        assert isinstance(load_tokenizer(d, big, require=False), ByteTokenizer)
    tok = load_tokenizer(DEFAULT_MODEL_DIR, load_config(DEFAULT_MODEL_DIR))  # the built-in model's own
    assert isinstance(tok, HFTokenizer) and tok.n_ids == 4096


def test_a_random_checkpoint_without_a_tokenizer_still_loads(tmp_path):
    d = tmp_path / "big_vocab"
    write_tiny_checkpoint(d, "official", config=make_config(vocab_size=1024))  # weights only: no tokenizer needed
    model, cfg = _load(d)
    assert cfg.vocab_size == 1024


# ------------------------------------------------------------------ shard headers

def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    header, data = edit(header, data)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def _by_offset(header):
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])


def _hole(header, data, at=5, pad=8):
    """`pad` zero bytes before the at-th tensor's data, the later offsets shifted: sizes and the end still agree."""
    items = _by_offset(header)
    begin = items[at][1]["data_offsets"][0]
    for _, v in items[at:]:
        v["data_offsets"] = [o + pad for o in v["data_offsets"]]
    return header, data[:begin] + bytes(pad) + data[begin:]


def _overlap(header, data, at=5):
    """The at-th tensor starts 2 bytes into its predecessor and ends 2 bytes early: sizes and the end still agree."""
    v = _by_offset(header)[at][1]
    v["data_offsets"] = [o - 2 for o in v["data_offsets"]]
    return header, data


@pytest.mark.parametrize("edit, what", [(_hole, "a hole of 8 bytes after tensor"), (_overlap, "overlaps tensor")])
def test_a_shard_with_a_hole_or_an_overlap_is_refused_from_its_header(tmp_path, no_weight_reads, capfd, edit, what):
    d = tmp_path / "ckpt"
    write_tiny_checkpoint(d, "official")
    shard = d / SINGLE_NAME
    header = json.loads(shard.read_bytes()[8:8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]])
    items = _by_offset(header)
    prev, key = items[4][0], items[5][0]
    _rewrite_header(shard, edit)
    with pytest.raises(CheckpointError) as e:
        read_header(shard)
    msg = str(e.value)
    assert msg.startswith(f"{shard}: tensor {key!r} (") and what in msg and repr(prev) in msg, msg
    with pytest.raises(CheckpointError, match="safetensors needs"):
        list_tensors(d)
    line = _cli_one_line(capfd, ["generate", "--model", str(d), "--prompt", "x"])
    assert f"{shard}: tensor {key!r}" in line and what in line


def test_a_hole_before_the_first_tensor_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    write_tiny_checkpoint(d, "official")
    shard = d / SINGLE_NAME
    _rewrite_header(shard, lambda h, data: _hole(h, data, at=0))
    with pytest.raises(CheckpointError, match="a hole of 8 bytes at the start of the data"):
        read_header(shard)


def test_non_int_data_offsets_are_a_malformed_entry(tmp_path):
    d = tmp_path / "ckpt"
    write_tiny_checkpoint(d, "official")
    shard = d / SINGLE_NAME

    def edit(header, data):
        k, v = _by_offset(header)[0]
        v["data_offsets"] = [str(o) for o in v["data_offsets"]]
        return header, data

    _rewrite_header(shard, edit)
    with pytest.raises(CheckpointError, match="malformed header entry"):
        read_header(shard)


# ------------------------------------------------------------------ config.json

def _hf_config() -> dict:
    return make_config().to_hf_dict()


@pytest.mark.parametrize("change, named", [
    ({"rope_parameters": "yarn"}, "rope_parameters: must be an object"),
    ({"rope_parameters": {"main": {"rope_theta": 1e4}, "compress": "yarn"}}, "rope_parameters.compress: must be an object"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "16"}}, "rope_parameters.factor: must be a finite number, got '16'"),
    ({"rope_parameters": None, "rope_scaling": ["yarn"]}, "rope_scaling: must be an object"),
    ({"bos_token_id": 96}, "ModelConfig.bos_token_id: must be a token id in [0, vocab_size=96) (got 96)"),
    ({"bos_token_id": -1}, "ModelConfig.bos_token_id: must be a token id in [0, vocab_size=96)"),
    ({"eos_token_id": -1}, "ModelConfig.eos_token_id: must be a token id (an int >= 0)"),
    ({"eos_token_id": []}, "eos_token_id: an empty list"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id: must be a token id or a list of them (ints >= 0), got [1, '2']"),
    ({"model_type": "llama"}, "model_type 'llama' is not a DeepSeek-V4 model"),
])
def test_a_bad_config_field_is_refused_by_name(tmp_path, no_weight_reads, change, named):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict({**_hf_config(), **change})
    assert named in str(e.value)
    d = tmp_path / "ckpt"
    write_tiny_checkpoint(d, "hf")
    _edit_config(d, **change)
    with pytest.raises(CheckpointError) as e:
        _load(d)
    assert str(e.value).startswith(f"{d / 'config.json'}: invalid config: ") and named in str(e.value)


def test_a_config_error_is_one_cli_line(tmp_path, capfd):
    d = _copy_default(tmp_path)
    _edit_config(d, rope_parameters="yarn")
    line = _cli_one_line(capfd, ["generate", "--model", str(d), "--prompt", "x"])
    assert f"{d / 'config.json'}: invalid config: rope_parameters: must be an object" in line


def test_an_eos_outside_the_vocabulary_is_refused_where_the_checkpoint_ships_its_tokenizer(tmp_path, capfd):
    d = _copy_default(tmp_path)
    _edit_config(d, eos_token_id=4096)
    want = "invalid config: eos_token_id: must be a token id in [0, vocab_size=4096) (got 4096)"
    with pytest.raises(CheckpointError, match=r"invalid config: eos_token_id: must"):
        load_config(d)
    assert want in _cli_one_line(capfd, ["generate", "--model", str(d), "--prompt", "x"])
    _edit_config(d, eos_token_id=[1, 5000])
    with pytest.raises(CheckpointError, match=r"eos_token_id: must be a token id in \[0, vocab_size=4096\) \(got \[1, 5000\]\)"):
        load_config(d)
    # a random test model without a tokenizer may park eos past its vocabulary (so that no row stops)
    e = tmp_path / "tiny"
    write_tiny_checkpoint(e, "hf")
    _edit_config(e, eos_token_id=10_000)
    assert load_config(e).eos_token_id == 10_000


def test_an_eos_list_is_kept_whole():
    cfg = ModelConfig.from_dict({**_hf_config(), "eos_token_id": [1, 7, 9]})
    assert cfg.eos_token_id == 1 and cfg.eos_token_ids == (1, 7, 9)
    assert ModelConfig.from_dict(cfg.to_dict()).eos_token_ids == (1, 7, 9)  # dsv4 layout's config.json
    assert cfg.to_hf_dict()["eos_token_id"] == [1, 7, 9]
    one = ModelConfig.from_dict({**_hf_config(), "eos_token_id": [2]})
    assert one.eos_token_id == 2 and one.eos_token_ids == ()
    assert "eos_token_ids" not in make_config().to_dict()  # configs without a list are written as before


def test_the_layouts_model_types_are_accepted():
    assert ModelConfig.from_dict({**_hf_config(), "model_type": "deepseek_v4"}).vocab_size == 96
    assert "model_type" not in make_config().to_dict()  # official / dsv4 configs carry none


# ------------------------------------------------------------------ tensors

def _drop(d: Path, keys, layout: str) -> None:
    tensors = load_file(str(d / SINGLE_NAME))
    for k in keys:
        del tensors[k]
    meta = {"format": "pt", **({"dsv4_format": "1"} if layout == "dsv4" else {})}
    save_file(tensors, str(d / SINGLE_NAME), metadata=meta)


@pytest.mark.parametrize("layout, drop, want", [
    ("hf", ["model.hc_head.hc_scale"],
     "missing tensor: 'hc_head_scale' (checkpoint key 'model.hc_head.hc_scale') (expected shape [1], dtype "
     "torch.float32) is not in the checkpoint"),
    ("official", ["layers.0.attn.wkv.weight"],
     "missing tensor: 'layers.0.attn.wkv.weight' (expected shape [80, 64], dtype torch.bfloat16) is not in the "
     "checkpoint, though its scale 'layers.0.attn.wkv.scale' is"),
    ("hf", [f"model.layers.2.ffn.experts.{i}.w1.weight" for i in range(8)],
     "any per-expert tensor ('model.layers.2.ffn.experts.0.w1.weight' ... 'model.layers.2.ffn.experts.7.w1.weight')"),
    ("official", ["layers.2.ffn.experts.3.w1.weight", "layers.2.ffn.experts.5.w1.weight"],
     "missing tensor: experts 3, 5 of 'layers.2.ffn.experts.w1' (checkpoint keys 'layers.2.ffn.experts.3.w1.weight' "
     "... 'layers.2.ffn.experts.5.w1.weight'"),
])
def test_a_missing_tensor_names_its_checkpoint_key(tmp_path, no_weight_reads, layout, drop, want):
    d = tmp_path / layout
    write_tiny_checkpoint(d, layout)
    _drop(d, drop, layout)
    with pytest.raises(CheckpointError) as e:
        _load(d)
    msg = str(e.value)
    assert "(1 problem)" in msg and want in msg, msg
    assert "not a parameter" not in msg  # an orphaned scale is not reported as unexpected


def test_the_two_config_files_of_an_official_checkpoint_are_compared(tmp_path):
    """An official checkpoint carries inference/config.json (the one read) and an HF config.json: a shape field on
    which they disagree is named in a warning; agreeing files (the writer's, a DSpark release's stage count
    included) stay silent."""
    d = tmp_path / "ck"
    cfg = write_tiny_checkpoint(d, "official")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(d).dim == cfg.dim
    hf = json.loads((d / "config.json").read_text())
    hf["hidden_size"] = cfg.dim * 2
    hf["num_experts_per_tok"] = cfg.n_activated_experts + 1
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.warns(UserWarning) as rec:
        got = load_config(d)
    assert got.dim == cfg.dim  # the inference config still decides
    (msg,) = [str(w.message) for w in rec]
    assert "which the model is built from" in msg and str(d / "inference" / "config.json") in msg
    assert f"dim {cfg.dim} there, {cfg.dim * 2} in config.json" in msg
    assert f"n_activated_experts {cfg.n_activated_experts} there" in msg
    hf["hidden_size"] = "wide"  # an unreadable HF file is not compared (the inference config is the one read)
    (d / "config.json").write_text(json.dumps(hf))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(d)

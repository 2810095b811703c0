"""write_random_checkpoint: a random checkpoint streamed tensor by tensor into shards of bounded size loads to
exactly the model of the in-memory writer (same config and seed), in every streamed layout; each shard holds at
most max_shard_bytes (or one larger tensor); the index covers every tensor once."""
import json

import pytest
import torch

from dsv4_model.checkpoint import io
from dsv4_model.checkpoint.loader import load_model
from dsv4_model.checkpoint.writer import make_config, official_tensor_specs, write_random_checkpoint, \
    write_tiny_checkpoint

KW = dict(device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=32, progress=False)


def _state(path):
    model, _ = load_model(path, **KW)  # layout detected (modelopt is the official layout with NVFP4 experts)
    return model.state_dict()


@pytest.mark.parametrize("layout", ["official", "modelopt", "hf"])
def test_streamed_checkpoint_loads_to_the_in_memory_writers_model(tmp_path, layout):
    cfg = make_config()
    write_tiny_checkpoint(tmp_path / "ref", layout, seed=3, config=cfg)
    names = write_random_checkpoint(cfg, tmp_path / "stream", layout, seed=3, max_shard_bytes=48 << 10)
    assert len(names) > 3  # really sharded
    ref, got = _state(tmp_path / "ref"), _state(tmp_path / "stream")
    assert ref.keys() == got.keys()
    diff = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert diff == [], diff[:5]


def test_shards_are_bounded_and_indexed(tmp_path, monkeypatch):
    cfg = make_config()
    limit = 40 << 10
    sizes = []
    real = io.save_file

    def spy(tensors, path, metadata=None):
        sizes.append((sum(t.numel() * t.element_size() for t in tensors.values()),
                      max(t.numel() * t.element_size() for t in tensors.values())))
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(io, "save_file", spy)
    names = write_random_checkpoint(cfg, tmp_path, "official", max_shard_bytes=limit)
    assert len(names) == len(sizes) > 1
    assert all(total <= limit or total == largest for total, largest in sizes)  # one larger tensor stands alone
    index = json.loads((tmp_path / io.INDEX_NAME).read_text())
    listed = io.list_tensors(tmp_path)
    assert set(index["weight_map"]) == set(listed)
    assert set(index["weight_map"].values()) == set(names)
    assert not list(tmp_path.glob(".shard-*"))  # temporaries renamed
    # every spec tensor (and a scale for each quantized one) is there
    for name, (_, storage) in official_tensor_specs(cfg).items():
        assert name in listed, name
        if storage in ("fp8", "fp4"):
            assert name[: -len("weight")] + "scale" in listed, name


def test_one_shard_is_model_safetensors(tmp_path):
    assert write_random_checkpoint(make_config(), tmp_path, "hf", max_shard_bytes=1 << 30) == [io.SINGLE_NAME]
    assert not (tmp_path / io.INDEX_NAME).exists()


def test_refuses_the_stacked_layout(tmp_path):
    with pytest.raises(ValueError, match="layout must be one of"):
        write_random_checkpoint(make_config(), tmp_path, "dsv4")

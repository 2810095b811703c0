"""Loading with an expert shard (expert parallelism): each rank reads only its slice of the routed experts and
gets exactly the whole model's weights with the other ranks' experts left out, in every checkpoint layout, with
NVFP4 conversion at load and from a stored NVFP4 checkpoint; every expert's header is still checked."""
import copy

import pytest
import torch

from dsv4_model.checkpoint import io
from dsv4_model.checkpoint.io import CheckpointError
from dsv4_model.checkpoint.loader import load_model, save_model
from dsv4_model.checkpoint.names import split_expert_name
from dsv4_model.checkpoint.writer import write_tiny_checkpoint
from dsv4_model.model.parallel import ExpertShard

KW = dict(device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=32, progress=False)
WORLD = 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for layout in ("hf", "official", "dsv4", "modelopt"):
        write_tiny_checkpoint(root / layout, layout, seed=2, num_shards=3)
        out[layout] = root / layout
    return out


def _assert_same(got, want):
    g, w = got.state_dict(), want.state_dict()
    assert g.keys() == w.keys()
    bad = [k for k in w if g[k].shape != w[k].shape or not torch.equal(g[k], w[k])]
    assert bad == [], bad[:5]


@pytest.mark.parametrize("layout", ["hf", "official", "dsv4", "modelopt"])
@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_each_rank_loads_its_experts(ckpts, layout, quant):
    full, _ = load_model(ckpts[layout], quant=quant, **KW)
    for rank in range(WORLD):
        shard = ExpertShard(rank, WORLD)
        part, _ = load_model(ckpts[layout], quant=quant, expert_shard=shard, **KW)
        _assert_same(part, copy.deepcopy(full).shard_experts_(shard))


def test_a_stored_nvfp4_checkpoint_loads_sharded(ckpts, tmp_path):
    q, cfg = load_model(ckpts["official"], quant="nvfp4", **KW)
    save_model(q, cfg, tmp_path / "q")
    full, _ = load_model(tmp_path / "q", **KW)
    shard = ExpertShard(1, WORLD)
    _assert_same(load_model(tmp_path / "q", expert_shard=shard, **KW)[0], copy.deepcopy(full).shard_experts_(shard))


def test_a_rank_reads_only_its_experts(ckpts, monkeypatch):
    read = []
    real = io.TensorReader.read
    monkeypatch.setattr(io.TensorReader, "read", lambda self, info: read.append(info.key) or real(self, info))
    load_model(ckpts["official"], expert_shard=ExpertShard(1, WORLD), **KW)
    experts = {split_expert_name(k)[1] for k in read if split_expert_name(k)}
    assert experts == {4, 5, 6, 7}


def test_other_ranks_experts_are_still_checked(ckpts, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpts["official"], bad)
    shard0 = sorted(bad.glob("model-*.safetensors"))
    for f in shard0:
        t = load_file(str(f))
        if "layers.2.ffn.experts.6.w2.weight" in t:
            t["layers.2.ffn.experts.6.w2.weight"] = t["layers.2.ffn.experts.6.w2.weight"][:, :-1].contiguous()
            save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.6.w2"):
        load_model(bad, expert_shard=ExpertShard(0, WORLD), **KW)  # expert 6 belongs to rank 1


def test_the_reader_keeps_few_shards_mapped_and_loads_in_shard_order(ckpts, monkeypatch, capsys):
    """A load maps each shard once, in order, and keeps at most two mapped at a time (the host memory a load touches
    is bounded by a few shards, not the checkpoint), then reports its time and peak host memory in one line."""
    opened, real = [], io.safe_open
    monkeypatch.setattr(io, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    reader = io.TensorReader("cpu")
    infos = io.list_tensors(ckpts["official"])
    by_file = {}
    for info in infos.values():
        by_file.setdefault(info.file, info)
    assert len(by_file) == 3
    for info in [*by_file.values(), *by_file.values()]:
        assert reader.read(info).shape == info.shape
        assert len(reader._handles) <= 2
    assert len(opened) == 6  # round robin over 3 shards with room for 2: every read reopens
    opened.clear()
    model, _ = load_model(ckpts["official"], **{**KW, "progress": True})
    # (a check before the copies reads the hash-routing table) then the copies in shard order, each shard once
    assert opened[-3:] == sorted(set(opened)) and len(opened) <= 4, opened
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[dsv4] loaded")]
    assert len(lines) == 1 and "host memory peak" in lines[0]

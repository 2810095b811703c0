"""Checkpoint loading: three layouts, FP8 / MXFP4 decoding, HF save_pretrained output, error reporting."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4_model.checkpoint.io import CheckpointError, list_tensors
from dsv4_model.checkpoint.names import split_expert_name
from dsv4_model.checkpoint.writer import canonical_weights, make_config, write_checkpoint
from dsv4_model.checkpoint.loader import detect_layout, load_model, save_model
from dsv4_model.quant.formats import dequant_fp8_blocks, dequant_mxfp4, quant_fp8_blocks, quant_mxfp4

SEQ = 40  # > window (16) and > the HCA ratio (16): exercises window, CSA top-k and HCA pooling


def _load(path, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("max_seq_len", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, **kw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    cfg = make_config()
    weights = canonical_weights(cfg, seed=3)
    out = {}
    for layout in ("official", "hf", "dsv4"):
        out[layout] = write_checkpoint(weights, cfg, root / layout, layout)
    out["official-sharded"] = write_checkpoint(weights, cfg, root / "official-sharded", "official", num_shards=3)
    out["dsv4-sharded"] = write_checkpoint(weights, cfg, root / "dsv4-sharded", "dsv4", num_shards=2)
    return out


@pytest.fixture(scope="module")
def official_model(ckpts):
    return _load(ckpts["official"])


@pytest.fixture
def no_device_work(monkeypatch):
    """Validation must fail before the model is materialized on the device."""
    def forbidden(self, *a, **k):
        raise AssertionError("to_empty called before the checkpoint was validated")

    monkeypatch.setattr(torch.nn.Module, "to_empty", forbidden)


def _arch(cfg):
    """Config without the informational storage fields (expert_dtype, quantization_config)."""
    return dataclasses.replace(cfg, expert_dtype=None, quantization_config=None)


def _tokens(seed=1, vocab=96):
    return torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------- format decoding
def _e4m3_by_hand(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * 2.0 ** -6 * (man / 8)
    return sign * 2.0 ** (exp - 7) * (1 + man / 8)


def test_fp8_block_dequant_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    out_f, in_f = 150, 260  # partial last blocks in both dims -> scale [2, 3]
    raw = torch.randint(0, 256, (out_f, in_f), generator=g, dtype=torch.int32)
    raw[(raw & 0x7F) == 0x7F] = 0x38  # e4m3 NaN codes -> 1.0
    weight = raw.to(torch.uint8).view(torch.float8_e4m3fn)
    exps = [[127 + 3, 127 - 2, 127], [127 - 9, 127 + 7, 127 + 1]]
    scale = torch.tensor(exps, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequant_fp8_blocks(weight, scale, torch.float32)
    rawl = raw.tolist()
    for i in range(0, out_f, 7):
        for j in range(in_f):
            want = _e4m3_by_hand(rawl[i][j]) * 2.0 ** (exps[i // 128][j // 128] - 127)
            assert got[i, j].item() == want, (i, j, rawl[i][j])
    # bf16 output is exact
    assert torch.equal(dequant_fp8_blocks(weight, scale, torch.bfloat16).float(), got)


def test_mxfp4_dequant_matches_hand_computation():
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    g = torch.Generator().manual_seed(0)
    out_f, in_f = 5, 96  # 3 scale blocks of 32 per row
    raw = torch.randint(0, 256, (out_f, in_f // 2), generator=g, dtype=torch.int32)
    raw[0, 0] = 0x2F  # low nibble 0xF -> -6 (element 0), high nibble 0x2 -> +1 (element 1)
    packed = raw.to(torch.uint8).view(torch.int8)
    exps = [[127 + (r - c) for c in range(3)] for r in range(out_f)]
    exps[0][0] = 128  # x2
    scale = torch.tensor(exps, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequant_mxfp4(packed, scale, torch.float32)
    assert got[0, 0].item() == -12.0 and got[0, 1].item() == 2.0
    rawl = raw.tolist()
    for r in range(out_f):
        for k in range(in_f):
            byte = rawl[r][k // 2]
            nib = byte & 0xF if k % 2 == 0 else byte >> 4
            want = (-1.0 if nib & 8 else 1.0) * table[nib & 7] * 2.0 ** (exps[r][k // 32] - 127)
            assert got[r, k].item() == want, (r, k)


def test_quantizers_round_trip_and_bound_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 192, generator=g)
    d8 = dequant_fp8_blocks(*quant_fp8_blocks(w), dtype=torch.float32)
    assert torch.equal(dequant_fp8_blocks(*quant_fp8_blocks(d8), dtype=torch.float32), d8)
    assert ((d8 - w).abs() <= w.abs() / 16 + 2.0 ** -9 * d8.abs().max()).all()
    d4 = dequant_mxfp4(*quant_mxfp4(w), dtype=torch.float32)
    assert torch.equal(dequant_mxfp4(*quant_mxfp4(d4), dtype=torch.float32), d4)
    # per 32-block: error <= half the coarsest e2m1 step (1.0) times the block scale
    blk_scale = 2.0 ** torch.ceil(torch.log2(w.abs().view(200, 6, 32).amax(-1) / 6))
    assert ((d4 - w).abs().view(200, 6, 32) <= blk_scale.unsqueeze(-1) + 1e-12).all()


# ----------------------------------------------------------------------------------- layouts
def test_layout_detection(ckpts):
    assert detect_layout(ckpts["official"]) == "official"
    assert detect_layout(ckpts["hf"]) == "hf"
    assert detect_layout(ckpts["dsv4"]) == "dsv4"
    index = json.loads((ckpts["official-sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3


def test_cli_writes_same_weights(tmp_path, ckpts):
    spec = importlib.util.spec_from_file_location(
        "make_tiny_checkpoint", Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_checkpoint.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--layout", "official", "--out", str(tmp_path / "cli"), "--seed", "3", "--shards", "2"]) == 0
    a = {k: v for f in (tmp_path / "cli").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    b = load_file(str(ckpts["official"] / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert json.loads((tmp_path / "cli" / "inference" / "config.json").read_text())["n_layers"] == 5


def test_official_load_equals_canonical_weights(ckpts, official_model):
    model, cfg = official_model
    state = model.state_dict()
    canon = canonical_weights(make_config(), seed=3)
    seen = set()
    for name, want in canon.items():
        split = split_expert_name(name)
        target, idx = split if split else (name, None)
        got = state[target] if idx is None else state[target][idx]
        assert torch.equal(got, want.to(got.dtype)), name
        seen.add(target)
    assert seen == set(state), set(state) ^ seen


@pytest.mark.parametrize("layout", ["official-sharded", "dsv4", "hf"])
def test_all_layouts_load_identically(ckpts, official_model, layout):
    ref, ref_cfg = official_model
    model, cfg = _load(ckpts[layout])
    a, b = ref.state_dict(), model.state_dict()
    if layout == "hf":  # HF checkpoints carry no MTP block
        assert cfg.n_mtp_layers == 0 and not any(k.startswith("mtp.") for k in b)
        a = {k: v for k, v in a.items() if not k.startswith("mtp.")}
    else:
        assert _arch(cfg) == _arch(ref_cfg)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    toks = _tokens()
    assert torch.equal(ref.prefill(toks), model.prefill(toks))


def test_engine_from_pretrained_layouts_agree(ckpts):
    from dsv4_model.runtime.engine import Engine

    toks = _tokens(seed=4)
    outs = []
    for layout in ("official", "hf", "dsv4"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng = Engine.from_pretrained(ckpts[layout], max_seq_len=64)
        steps = [eng.prefill(toks)]
        for _ in range(2):
            steps.append(eng.decode(steps[-1].argmax(-1)))
        outs.append(torch.stack(steps))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_save_model_round_trip(tmp_path, official_model):
    ref, cfg = official_model
    save_model(ref, cfg, tmp_path / "saved", num_shards=2)
    assert detect_layout(tmp_path / "saved") == "dsv4"
    model, cfg2 = _load(tmp_path / "saved")
    assert _arch(cfg2) == _arch(cfg)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    toks = _tokens(seed=2)
    logits = model.prefill(toks)
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(ref.prefill(toks), logits)


@pytest.mark.cuda
def test_load_to_cuda_matches_cpu(ckpts, official_model):
    ref, _ = official_model
    model, _ = _load(ckpts["official-sharded"], device="cuda")
    assert model.embed.weight.device.type == "cuda"
    for k, v in ref.state_dict().items():
        got = model.state_dict()[k]
        assert got.is_cuda and torch.equal(got.cpu(), v), k
    logits = model.prefill(_tokens().cuda())
    assert torch.isfinite(logits).all()


# ----------------------------------------------------------------------------------- real transformers output
def _hf_model(cfg):
    transformers = pytest.importorskip("transformers")
    hd = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hd)).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("tid2eid"):  # HF initialises it to zeros; real tables route to distinct experts
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: buf.shape[1]] for _ in range(buf.shape[0])]
                buf.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    return hf


def _check_against_hf(model, hf, cfg):
    ours = model.state_dict()
    theirs = hf.state_dict()
    inter = cfg.moe_inter_dim

    def same(our_name, hf_tensor):
        assert torch.equal(ours[our_name], hf_tensor.to(ours[our_name].dtype)), our_name

    # top level, and a hand-written correspondence for every kind of per-layer tensor
    same("embed.weight", theirs["model.embed_tokens.weight"])
    same("head.weight", theirs["lm_head.weight"])
    same("norm.weight", theirs["model.norm.weight"])
    for s in ("fn", "base", "scale"):
        same(f"hc_head_{s}", theirs[f"model.hc_head.hc_{s}"])
    n = 0
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        pairs = {
            "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
            "attn.attn_sink": "self_attn.sinks", "attn.wq_a.weight": "self_attn.q_a_proj.weight",
            "attn.q_norm.weight": "self_attn.q_a_norm.weight", "attn.wq_b.weight": "self_attn.q_b_proj.weight",
            "attn.wkv.weight": "self_attn.kv_proj.weight", "attn.kv_norm.weight": "self_attn.kv_norm.weight",
            "attn.wo_a.weight": "self_attn.o_a_proj.weight", "attn.wo_b.weight": "self_attn.o_b_proj.weight",
            "ffn.gate.weight": "mlp.gate.weight",
            "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
            "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
            "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
            "ffn.experts.w2": "mlp.experts.down_proj",
        }
        for site in ("attn", "ffn"):
            for s in ("fn", "base", "scale"):
                pairs[f"hc_{site}_{s}"] = f"{site}_hc.{s}"
        if cfg.compress_ratios[i]:
            pairs.update({"attn.compressor.ape": "self_attn.compressor.position_bias",
                          "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
                          "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
                          "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight"})
        if cfg.compress_ratios[i] == 4:
            ix = "self_attn.compressor.indexer."
            pairs.update({"attn.indexer.wq_b.weight": ix + "q_b_proj.weight",
                          "attn.indexer.weights_proj.weight": ix + "scorer.weights_proj.weight",
                          "attn.indexer.compressor.ape": ix + "position_bias",
                          "attn.indexer.compressor.wkv.weight": ix + "kv_proj.weight",
                          "attn.indexer.compressor.wgate.weight": ix + "gate_proj.weight",
                          "attn.indexer.compressor.norm.weight": ix + "kv_norm.weight"})
        if i < cfg.n_hash_layers:
            pairs["ffn.gate.tid2eid"] = "mlp.gate.tid2eid"
        else:
            pairs["ffn.gate.bias"] = "mlp.gate.e_score_correction_bias"
        for o, t in pairs.items():
            same(p + o, theirs[h + t])
        gate_up = theirs[h + "mlp.experts.gate_up_proj"]
        same(p + "ffn.experts.w1", gate_up[:, :inter])
        same(p + "ffn.experts.w3", gate_up[:, inter:])
        n += len(pairs) + 2
    assert n + 6 == len(ours)  # every tensor of the model was compared


def test_loads_transformers_save_pretrained(tmp_path):
    cfg = make_config()
    hf = _hf_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    assert detect_layout(tmp_path / "hf") == "hf"
    model, cfg2 = _load(tmp_path / "hf", dtype=torch.float32)
    assert cfg2.n_mtp_layers == 0 and cfg2.compress_ratios == cfg.compress_ratios[: cfg.n_layers]
    _check_against_hf(model, hf, cfg)


def test_hf_layout_writer_is_what_transformers_reads(ckpts):
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpts["hf"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    canon = canonical_weights(make_config(), seed=3)
    sd = hf.state_dict()
    assert torch.equal(sd["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"].float(),
                       canon["layers.1.attn.indexer.wq_b.weight"].float())
    assert torch.equal(sd["model.layers.2.mlp.experts.gate_up_proj"][5, 32:].float(),
                       canon["layers.2.ffn.experts.5.w3.weight"].float())


def test_loads_transformers_in_memory_names(tmp_path):
    """A raw `state_dict()` dump of HF's module (fused gate_up_proj, self_attn.* / mlp.* names)."""
    cfg = make_config()
    hf = _hf_model(cfg)
    out = tmp_path / "hf-raw"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    model, _ = _load(out, dtype=torch.float32)
    _check_against_hf(model, hf, cfg)


# ----------------------------------------------------------------------------------- errors
def _edit(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


@pytest.fixture
def dsv4_copy(tmp_path, ckpts):
    return Path(shutil.copytree(ckpts["dsv4"], tmp_path / "c"))


@pytest.fixture
def official_copy(tmp_path, ckpts):
    return Path(shutil.copytree(ckpts["official"], tmp_path / "o"))


@pytest.fixture
def sharded_copy(tmp_path, ckpts):
    return Path(shutil.copytree(ckpts["dsv4-sharded"], tmp_path / "s"))


def _raises(path, *fragments):
    with pytest.raises(CheckpointError) as e:
        _load(path)
    msg = str(e.value)
    if msg.startswith("checkpoint does not match"):  # a bad tensor is reported once, not also as missing
        assert "(1 problem)" in msg, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in:\n{msg}"
    return msg


def test_missing_tensor(dsv4_copy, no_device_work):
    _edit(dsv4_copy, lambda t: t.pop("layers.1.attn.wq_a.weight"))
    _raises(dsv4_copy, "missing", "'layers.1.attn.wq_a.weight'", "[32, 64]")


def test_missing_expert(official_copy, no_device_work):
    _edit(official_copy, lambda t: (t.pop("layers.2.ffn.experts.5.w3.weight"), t.pop("layers.2.ffn.experts.5.w3.scale")))
    _raises(official_copy, "missing", "experts 5 of 'layers.2.ffn.experts.w3'", "[32, 64]")


def test_unexpected_tensor(dsv4_copy, no_device_work):
    _edit(dsv4_copy, lambda t: t.__setitem__("layers.0.attn.bogus.weight", torch.zeros(3, 4)))
    _raises(dsv4_copy, "unexpected", "'layers.0.attn.bogus.weight'", "[3, 4]")


def test_expert_index_out_of_range(official_copy, no_device_work):
    def add(t):
        t["layers.3.ffn.experts.8.w1.weight"] = t["layers.3.ffn.experts.0.w1.weight"].clone()
        t["layers.3.ffn.experts.8.w1.scale"] = t["layers.3.ffn.experts.0.w1.scale"].clone()
    _edit(official_copy, add)
    _raises(official_copy, "'layers.3.ffn.experts.8.w1.weight'", "expert index 8 out of range", "8 experts")


def test_wrong_shape(dsv4_copy, no_device_work):
    _edit(dsv4_copy, lambda t: t.__setitem__("layers.2.attn.wkv.weight", torch.zeros(80, 65, dtype=torch.bfloat16)))
    _raises(dsv4_copy, "'layers.2.attn.wkv.weight'", "shape mismatch", "expected [80, 64]", "got [80, 65]")


def test_wrong_dtype(dsv4_copy, no_device_work):
    _edit(dsv4_copy, lambda t: t.__setitem__("layers.0.ffn.gate.tid2eid", t["layers.0.ffn.gate.tid2eid"].float()))
    _raises(dsv4_copy, "'layers.0.ffn.gate.tid2eid'", "dtype mismatch", "integer", "torch.int64", "got F32")


def test_wrong_dtype_float_param(dsv4_copy, no_device_work):
    _edit(dsv4_copy, lambda t: t.__setitem__("layers.4.attn_norm.weight", torch.ones(64, dtype=torch.int32)))
    _raises(dsv4_copy, "'layers.4.attn_norm.weight'", "dtype mismatch", "floating-point", "got I32")


def test_fp8_weight_without_scale(official_copy, no_device_work):
    _edit(official_copy, lambda t: t.pop("layers.0.attn.wq_b.scale"))
    _raises(official_copy, "'layers.0.attn.wq_b.weight'", "F8_E4M3", "'layers.0.attn.wq_b.scale'", "missing")


def test_fp8_scale_wrong_shape(official_copy, no_device_work):
    _edit(official_copy, lambda t: t.__setitem__("layers.0.attn.wq_b.scale", t["layers.0.attn.wq_b.scale"][:2]))
    # wq_b is [320, 32] -> ceil(320/128) x ceil(32/128) = [3, 1] blocks
    _raises(official_copy, "'layers.0.attn.wq_b.scale'", "expected [3, 1]", "got [2, 1]")


def test_mxfp4_wrong_packed_shape(official_copy, no_device_work):
    _edit(official_copy, lambda t: t.__setitem__("layers.1.ffn.experts.2.w2.weight",
                                                 torch.zeros(64, 32, dtype=torch.int8)))
    _raises(official_copy, "'layers.1.ffn.experts.2.w2.weight'", "expected [64, 16]", "MXFP4", "got [64, 32]")


def test_tid2eid_out_of_range_and_duplicates(dsv4_copy, no_device_work):
    def corrupt(t):
        t["layers.0.ffn.gate.tid2eid"][7] = torch.tensor([1, 8])
        t["layers.1.ffn.gate.tid2eid"][3] = torch.tensor([2, 2])
    _edit(dsv4_copy, corrupt)
    _raises(dsv4_copy, "layers.0.ffn.gate.tid2eid", "row 7", "[0, 8)", "layers.1.ffn.gate.tid2eid", "row 3", "distinct")


def test_bad_config_field_is_named(official_copy, no_device_work):
    p = official_copy / "inference" / "config.json"
    cfg = json.loads(p.read_text())
    cfg["o_groups"] = 3
    p.write_text(json.dumps(cfg))
    _raises(official_copy, "o_groups", "inference/config.json")


def test_missing_index_shard(sharded_copy, no_device_work):
    (sharded_copy / "model-00002-of-00002.safetensors").unlink()
    _raises(sharded_copy, "model-00002-of-00002.safetensors", "does not exist")


def test_index_lists_absent_key(sharded_copy, no_device_work):
    idx_path = sharded_copy / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"]["layers.0.attn.ghost.weight"] = "model-00001-of-00002.safetensors"
    idx_path.write_text(json.dumps(idx))
    _raises(sharded_copy, "'layers.0.attn.ghost.weight'", "no such tensor")


def test_header_inventory_reads_no_data(ckpts):
    infos = list_tensors(ckpts["official"])
    w = infos["layers.1.ffn.experts.0.w1.weight"]
    s = infos["layers.1.ffn.experts.0.w1.scale"]
    assert (w.dtype, w.shape, s.dtype, s.shape) == ("I8", (32, 32), "F8_E8M0", (32, 2))
    q = infos["layers.1.attn.wq_b.weight"]
    assert (q.dtype, q.shape, infos["layers.1.attn.wq_b.scale"].shape) == ("F8_E4M3", (320, 32), (3, 1))
    assert math.prod(infos["embed.weight"].shape) == 96 * 64

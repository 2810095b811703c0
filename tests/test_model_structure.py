"""Official checkpoint names / shapes in state_dict, meta-device build, bf16 smoke run."""

import pytest
import torch

from dsv4_model.runtime.engine import Engine
from dsv4_model.model.decode_options import DEFAULT as DEFAULT_OPTIONS
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

from hf_utils import one_thread, tiny_config  # noqa: F401


def _block_keys(p, ratio, hashed):
    keys = [f"{p}hc_{s}_{t}" for s in ("attn", "ffn") for t in ("fn", "base", "scale")]
    keys += [p + k for k in ("attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.wq_a.weight",
                             "attn.q_norm.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.kv_norm.weight",
                             "attn.wo_a.weight", "attn.wo_b.weight", "ffn.gate.weight",
                             "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                             "ffn.shared_experts.w3.weight", "ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3")]
    keys.append(p + ("ffn.gate.tid2eid" if hashed else "ffn.gate.bias"))
    comp = ("ape", "wkv.weight", "wgate.weight", "norm.weight")
    if ratio:
        keys += [f"{p}attn.compressor.{k}" for k in comp]
    if ratio == 4:
        keys += [f"{p}attn.indexer.{k}" for k in ("wq_b.weight", "weights_proj.weight")]
        keys += [f"{p}attn.indexer.compressor.{k}" for k in comp]
    return keys


def test_state_dict_uses_official_names_and_shapes():
    cfg = tiny_config()  # layers: SWA/hash, CSA/hash, HCA/learned, CSA/learned; MTP SWA/learned
    m = Transformer(cfg, max_batch_size=2, max_seq_len=32, dtype=torch.bfloat16, device="meta")
    sd = m.state_dict()
    want = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]
    for i, r in enumerate(cfg.compress_ratios[: cfg.n_layers]):
        want += _block_keys(f"layers.{i}.", r, i < cfg.n_hash_layers)
    want += _block_keys("mtp.0.", 0, False)
    want += [f"mtp.0.{k}" for k in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                                    "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")]
    assert sorted(sd) == sorted(want)
    d, H, D, G, E, I = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.n_routed_experts, cfg.moe_inter_dim
    shapes = {
        "layers.1.attn.wo_a.weight": (G * cfg.o_lora_rank, H * D // G),
        "layers.1.attn.wo_b.weight": (d, G * cfg.o_lora_rank),
        "layers.1.attn.compressor.ape": (4, 2 * D), "layers.1.attn.compressor.wkv.weight": (2 * D, d),
        "layers.2.attn.compressor.ape": (8, D), "layers.2.attn.compressor.wgate.weight": (D, d),
        "layers.1.attn.indexer.compressor.ape": (4, 2 * cfg.index_head_dim),
        "layers.1.attn.indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "layers.0.ffn.gate.tid2eid": (cfg.vocab_size, cfg.n_activated_experts),
        "layers.2.ffn.experts.w1": (E, I, d), "layers.2.ffn.experts.w3": (E, I, d),
        "layers.2.ffn.experts.w2": (E, d, I), "layers.0.hc_attn_fn": ((2 + 4) * 4, 4 * d),
        "hc_head_fn": (4, 4 * d),
    }
    for k, shp in shapes.items():
        assert tuple(sd[k].shape) == shp, k
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert sd["layers.0.hc_attn_fn"].dtype == torch.float32 and sd["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert not any("kv_cache" in k or "state" in k or "rope" in k for k in sd)


def test_meta_build_then_materialize():
    cfg = tiny_config(n_layers=2, compress_ratios=[4, 8, 0], n_hash_layers=1)
    ref = init_random_weights(Transformer(cfg, max_batch_size=1, max_seq_len=32, dtype=torch.float32), 4)
    m = Transformer(cfg, max_batch_size=1, max_seq_len=32, dtype=torch.float32, device="meta")
    m.to_empty(device="cpu")
    m.load_state_dict(ref.state_dict())
    m.setup_runtime("cpu")
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(m.prefill(ids), ref.prefill(ids))
    assert torch.equal(m.decode_step(ids[:, 0], torch.tensor([20])), ref.decode_step(ids[:, 0], torch.tensor([20])))


def test_fp32_math_weights_narrow_to_bf16_only_when_lossless():
    """The compressors' projections and the head: held in bf16 once their values fit, with identical results."""
    from dsv4_model.model.compressor import Compressor

    cfg = tiny_config(n_layers=2, compress_ratios=[4, 8, 0], n_hash_layers=1)
    wide = init_random_weights(Transformer(cfg, max_batch_size=1, max_seq_len=48, dtype=torch.float32), 5)
    comps = [m for m in wide.modules() if isinstance(m, Compressor)]
    assert comps
    wide.narrow_weights_()  # fp32 random values: nothing may change
    assert all(c.wkv.weight.dtype == torch.float32 and c.wgate.weight.dtype == torch.float32 for c in comps)
    assert wide.head.weight.dtype == torch.float32
    with torch.no_grad():  # now bf16 values in fp32 storage, as a released checkpoint's
        for w in [wide.head.weight] + [w for c in comps for w in (c.wkv.weight, c.wgate.weight)]:
            w.copy_(w.to(torch.bfloat16))
    narrow = Transformer(cfg, max_batch_size=1, max_seq_len=48, dtype=torch.float32)
    narrow.load_state_dict(wide.state_dict())
    narrow.narrow_weights_()
    ncomps = [m for m in narrow.modules() if isinstance(m, Compressor)]
    assert all(c.wkv.weight.dtype == torch.bfloat16 and c.wgate.weight.dtype == torch.bfloat16 for c in ncomps)
    assert narrow.head.weight.dtype == torch.bfloat16
    # the head module itself: fp32 math and an fp32 output however its weight is held
    x = torch.randn(3, cfg.dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert narrow.head.fp32 and narrow.head(x).dtype == torch.float32
    assert torch.equal(narrow.head(x), wide.head(x))
    assert torch.allclose(narrow.head(x), x.float() @ wide.head.weight.t(), rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    assert torch.equal(narrow.prefill(ids), wide.prefill(ids))
    for t in range(6):  # across a closed ratio-4 window, both compressors' decode state
        tok, pos = ids[:, t], torch.tensor([21 + t])
        assert torch.equal(narrow.decode_step(tok, pos), wide.decode_step(tok, pos))


@pytest.mark.parametrize("simulate_quant", [False, True])
def test_bf16_runs_close_to_fp32(simulate_quant):
    cfg = tiny_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([30, 21])
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        m = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=64, dtype=dtype,
                                            simulate_quant=simulate_quant), 2)
        eng = Engine(m)
        lg = [eng.prefill(ids, lengths=lens)]
        for i in range(6):
            lg.append(eng.decode(torch.stack([ids[0, 30 + i], ids[1, 21 + i]])))
        outs.append(torch.stack(lg))
    f32, b16 = outs
    assert b16.dtype == torch.float32 and torch.isfinite(b16).all()
    # bf16 rounding (and occasional top-k flips) only: logits stay strongly correlated with fp32
    corr = torch.corrcoef(torch.stack([f32.flatten(), b16.flatten()]))[0, 1]
    assert corr > 0.98, corr


def test_decode_shares_per_step_values_across_layers(monkeypatch):
    """Per-position values that do not depend on the layer are computed once per decode step: the attended rows of
    the layers without an indexer (one per (window, ratio, entries)) and the RoPE rows per table and offset; the
    logits are those of computing them in every layer."""
    from dsv4_model.model import attention
    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.decode_options import DecodeOptions

    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 5,
                         "compress_ratios": [0, 16, 4, 16, 0]}).validate()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    m = Transformer(cfg, max_batch_size=2, max_seq_len=256, dtype=torch.float32, device="cpu")
    init_random_weights(m, 2)
    m.prefill(ids)
    calls = []
    real = attention.Attention._decode_rows
    monkeypatch.setattr(attention.Attention, "_decode_rows",
                        lambda self, *a, **k: calls.append(self.ratio) or real(self, *a, **k))
    fused = DecodeOptions(attention="fused")
    pos = torch.full((2,), 9)
    shared = m.decode_step(ids[:, 0], pos, fused)
    # SWA (0) and HCA (16) once each for their two layers; the CSA layer passes the SWA layers' window rows
    # (the same (window, 0, 0) key) beside its own top-k
    assert sorted(calls) == [0, 16]
    # the shared values sit in the step's scratch buffers, which those layers read in place
    scratch = m.step_scratch
    assert scratch.attn_keys == [(cfg.window_size, 0, 0), (cfg.window_size, 16, 256 // 16)]
    for a in scratch.attn:
        layer = next(b.attn for b in m.layers if (b.attn.ring, b.attn.ratio, b.attn.n_entries) == a.key)
        assert torch.equal(a.rows[0], layer._decode_rows(pos, None, None)), a.key
    assert torch.equal(scratch.n_vis[scratch.vis_ratios.index(4)], (pos + 1) // 4)
    # every RoPE slot (per table and window offset) holds the step's rows
    rows = {"main": scratch.rope_main, "compress": scratch.rope_compress}
    for kind, table in m._rope().items():
        for i, off in enumerate(scratch.rope_offsets[kind]):
            want = table[(pos + 1 - off).clamp(min=0)]
            assert torch.equal(rows[kind][i, :2], want), (kind, off)

    from dsv4_model.model.step_values import DecodeStep, in_slot

    # every layer computes its own
    monkeypatch.setattr(DecodeStep, "shared_rows",
                        lambda self, key, compute: in_slot(self._attn_slots.get(key), key, compute()))
    m2 = Transformer(cfg, max_batch_size=2, max_seq_len=256, dtype=torch.float32, device="cpu")
    init_random_weights(m2, 2)
    m2.prefill(ids)
    calls.clear()
    own = m2.decode_step(ids[:, 0], torch.full((2,), 9), fused)
    assert sorted(calls) == [0, 0, 4, 16, 16]
    assert torch.equal(shared, own)


def test_decode_writes_every_rope_slot_before_the_layers(monkeypatch):
    """A RoPE slot written after a layer read the buffer (the first HCA layer's, after the CSA layers') reached
    its reader as a fresh copy under Inductor: decode_step writes every slot first."""
    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.step_values import DecodeStep

    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 3, "compress_ratios": [4, 16, 4]}).validate()
    m = init_random_weights(Transformer(cfg, max_batch_size=1, max_seq_len=64, dtype=torch.float32, device="cpu"), 0)
    m.prefill(torch.randint(0, cfg.vocab_size, (1, 9)))
    events = []
    real_gather, real_decode = DecodeStep._gather, type(m.layers[0]).decode
    monkeypatch.setattr(DecodeStep, "_gather", lambda s, t, k: events.append(("slot", k)) or real_gather(s, t, k))
    monkeypatch.setattr(type(m.layers[0]), "decode",
                        lambda *a, **k: events.append(("layer",)) or real_decode(*a, **k))
    m.decode_step(torch.tensor([3]), torch.tensor([9]))
    first_layer = events.index(("layer",))
    written = sorted(k for e in events[:first_layer] for k in e[1:])
    assert written == sorted(k for ms in m.step_scratch.rope_offsets.values() for k in ms), events


def test_verification_steps_live_in_the_step_scratch():
    """A verification's T tokens per row (T <= spare window slots + 1) keep their stacked positions and RoPE rows in
    the step scratch, as a decode step does (a plain tensor reached every layer's ops as a fresh copy under
    Inductor: 100 -> 34 Triton launches in flash43's K = 1 step); the MTP block's steps and a multi-token decode
    past the scratch's rows keep tensors of their own; either way the same values."""
    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig

    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 2, "compress_ratios": [4, 0]}).validate()
    m = Transformer(cfg, max_batch_size=2, max_seq_len=64, dtype=torch.float32, device="cpu",
                    spare_window_slots=2)
    sc = m.step_scratch
    assert sc.rows == 2 * 3
    pos = torch.tensor([5, 9])
    want_pos = torch.tensor([5, 9, 6, 10, 7, 11])
    for T, scratch, inside in ((3, True, True), (3, False, False), (4, True, False)):
        st = m._token_steps(pos, T, DEFAULT_OPTIONS, scratch=scratch).stacked
        assert torch.equal(st.positions, torch.cat([pos + t for t in range(T)])), (T, scratch)
        cs = st.cs("main")
        assert torch.equal(cs, m.rope_main[st.positions]), (T, scratch)
        in_buf = (st.positions.untyped_storage().data_ptr() == sc.positions.untyped_storage().data_ptr(),
                  cs.untyped_storage().data_ptr() == sc.rope_main.untyped_storage().data_ptr())
        assert in_buf == (inside, inside), (T, scratch)
    assert torch.equal(sc.positions[0], want_pos)

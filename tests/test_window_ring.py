"""Window rings with spare slots (Transformer(spare_window_slots=K): W + K ring slots, docs/speculation.md): the
same logits as the W-slot ring over many wraps of the window and compression boundaries, and the reason for the
spare slots: tokens written ahead at positions later decoded again (a speculative step's rejected drafts) leave
nothing behind that a later step reads, which a W-slot ring does not give."""
import pytest
import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.decode_options import DecodeOptions
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

PROMPT = 13


def _model(spare: int, ratios=(0, 4, 16), max_seq_len=96):
    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": len(ratios),
                         "compress_ratios": list(ratios)}).validate()
    m = Transformer(cfg, max_batch_size=2, max_seq_len=max_seq_len, dtype=torch.float32, spare_window_slots=spare)
    return init_random_weights(m, 5), cfg


def _ids(cfg, n):
    return torch.randint(0, cfg.vocab_size, (2, n), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("attention", ["fused", "torch"])
@pytest.mark.parametrize("spare", [1, 3])
def test_spare_slots_give_the_logits_of_the_plain_ring(spare, attention):
    """Ragged prefill (13 and 7 tokens), then 70 decode steps (the 16-token window wraps 4 times; ratio-4 and
    ratio-16 windows close): the same logits as without spare slots, fp32, bit for bit through the fused ops (the
    attention lists the window's rows by position, the compressor op pools a position-indexed state in the shifted
    state's order; tests/test_path_consistency.py); the tensor-op attention sums the ring in slot order, so
    there up to that summation order. The same greedy tokens."""
    opts = DecodeOptions(attention=attention)
    out = {}
    for k in (0, spare):
        m, cfg = _model(k)
        ids = _ids(cfg, PROMPT + 70)
        lengths = torch.tensor([PROMPT, 7])
        steps = [m.prefill(ids[:, :PROMPT], lengths)]
        for t in range(70):
            steps.append(m.decode_step(ids[:, PROMPT + t], lengths + t, opts))
        out[k] = torch.stack(steps)
        assert m.layers[0].attn.kv_cache.shape[1] == cfg.window_size + k
    if attention == "fused":
        assert torch.equal(out[spare], out[0])
    torch.testing.assert_close(out[spare], out[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[spare].argmax(-1), out[0].argmax(-1))


@pytest.mark.parametrize("p", [40, 46])
@pytest.mark.parametrize("spare,written_ahead", [(3, 3), (2, 2), (3, 1), (0, 2)])
def test_tokens_written_ahead_leave_nothing_a_later_step_reads(spare, written_ahead, p):
    """Decode to position p, write `written_ahead` junk tokens at p+1.. (as rejected drafts are), then decode the
    true tokens from p+1 again: with spare >= written_ahead - 1 slots the logits are those of a model that never
    saw the junk, bit for bit, in every layer kind (at p = 46 the junk closes ratio-4 windows and at p = 46 + 1 a
    ratio-16 one: the compressors' states are indexed by position too); a plain ring (spare 0) loses rows the
    true steps still read."""
    clean, cfg = _model(spare)  # p = 40: past two wraps of the 16-token window
    dirty, _ = _model(spare)
    ids = _ids(cfg, p + 8)
    junk = torch.randint(0, cfg.vocab_size, (2, written_ahead), generator=torch.Generator().manual_seed(9))
    for m in (clean, dirty):
        m.prefill(ids[:, :PROMPT])
        for t in range(PROMPT, p + 1):
            m.decode_step(ids[:, t], torch.full((2,), t))
    for j in range(written_ahead):
        dirty.decode_step(junk[:, j], torch.full((2,), p + 1 + j))
    got = torch.stack([dirty.decode_step(ids[:, t], torch.full((2,), t)) for t in range(p + 1, p + 6)])
    want = torch.stack([clean.decode_step(ids[:, t], torch.full((2,), t)) for t in range(p + 1, p + 6)])
    if spare >= written_ahead - 1:
        assert torch.equal(got, want)
    else:
        assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_spare_slots_are_refused_unless_a_count():
    cfg = ModelConfig(**TINY_CONFIG).validate()
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="spare_window_slots"):
            Transformer(cfg, max_batch_size=1, max_seq_len=32, dtype=torch.float32, device="meta",
                        spare_window_slots=bad)

"""The DSpark module (dsv4_model/model/dspark.py) against the transcription of the released forward
(tests/dspark_reference.py), fp32 on random weights: every stage's output streams, the head's logits with the
Markov bias, the greedy drafts and the confidence head, through a prompt longer than the window (the ring split)
and decode steps that wrap the ring; rows at different positions; several positions committed at once."""

from __future__ import annotations

import pytest
import torch

from dsv4_model.checkpoint.writer import make_config
from dsv4_model.model.dspark import DSpark, main_hidden_of
from dsv4_model.model.dspark_config import DSparkConfig
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from tests.dspark_reference import RefDSpark

W = 16  # the tiny config's window


def _cfg():
    return make_config(n_mtp_layers=0, compress_ratios=[0, 4, 16, 4, 16],
                       dspark=DSparkConfig(block_size=5, markov_rank=8, target_layer_ids=(2, 3, 4),
                                           noise_token_id=95, stage_ratios=(0, 0, 0)))


@pytest.fixture(scope="module")
def parts():
    cfg = _cfg()
    model = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=128, dtype=torch.float32), 3)
    return cfg, model


def _dspark(cfg, simulate_quant, B=2, seed=4):
    return DSpark(cfg, dtype=torch.float32, max_batch_size=B, simulate_quant=simulate_quant).init_random_weights(seed)


def _close(a, b, what):
    err = (a.float() - b.float()).abs().max().item()
    scale = max(1.0, b.float().abs().max().item())
    assert err <= 1e-5 * scale, f"{what}: max |diff| {err:.3g} (scale {scale:.3g})"


def _ref(cfg, d, model, simulate_quant):
    sd = {k: v.clone() for k, v in d.state_dict().items()}
    return RefDSpark(sd, cfg, d.n_stages, model.embed.weight, model.head.weight, 1, act_quant=simulate_quant)


@pytest.mark.parametrize("simulate_quant", [False, True])
def test_every_stage_and_the_heads_equal_the_reference(parts, simulate_quant):
    cfg, model = parts
    d = _dspark(cfg, simulate_quant)
    g = torch.Generator().manual_seed(0)
    prompt = (7, W + 5)  # row 1's prompt is longer than the window: the seeded ring keeps its last W positions
    steps = 14  # row 0 wraps the ring too
    n_pos = max(prompt) + steps
    hidden = torch.randn(2, n_pos, 3 * cfg.dim, generator=g)
    anchors = torch.randint(0, cfg.vocab_size, (2, n_pos), generator=g)
    refs = [_ref(cfg, d, model, simulate_quant) for _ in range(2)]
    for b, ref in enumerate(refs):
        assert ref.forward_spec(anchors[b, :1], hidden[b:b + 1, :prompt[b]], 0) is None
    S = torch.tensor(prompt)
    d.commit(hidden, torch.zeros(2, dtype=torch.long), S, model.rope_main)
    picked = set()
    for t in range(steps):
        pos = S + t  # the main position each row commits now; its anchor is the token after it
        d.commit(hidden[torch.arange(2), pos].unsqueeze(1), pos, torch.ones(2, dtype=torch.long), model.rope_main)
        anchor = anchors[torch.arange(2), pos]
        stages: list = []
        out = d.draft(model, anchor, pos, stages)
        for b, ref in enumerate(refs):
            p = int(pos[b])
            toks, logits, conf, ref_stages = ref.forward_spec(anchor[b:b + 1], hidden[b:b + 1, p:p + 1], p)
            for i, (s, r) in enumerate(zip(stages, ref_stages)):
                _close(s[b], r[0], f"step {t} row {b} stage {i}")
            _close(out.logits[b], logits[0], f"step {t} row {b} logits (Markov bias in)")
            _close(out.confidence[b], conf[0], f"step {t} row {b} confidence")
            assert torch.equal(out.tokens[b], toks[0]), (t, b)
            picked.update(toks[0].tolist())
    assert len(picked) > 5  # the drafts vary with the context: a real comparison


def test_several_positions_committed_at_once_equal_one_by_one(parts):
    cfg, model = parts
    d = _dspark(cfg, True)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 40, 3 * cfg.dim, generator=g)
    start = torch.tensor([5, 9])
    d.commit(hidden, torch.zeros(2, dtype=torch.long), start, model.rope_main)
    ref = _dspark(cfg, True)
    ref.load_state_dict(d.state_dict())
    ref.commit(hidden, torch.zeros(2, dtype=torch.long), start, model.rope_main)
    # a verification's K + 1 = 6 rows per row, of which 4 and 1 are committed (the rest: rejected drafts)
    rows = torch.stack([hidden[b, int(start[b]):int(start[b]) + 6] for b in range(2)])
    n = torch.tensor([4, 1])
    d.commit(rows, start, n, model.rope_main)
    for t in range(4):
        ref.commit(rows[:, t:t + 1], start + t, (n > t).long(), model.rope_main)
    last, anchor = start + n - 1, torch.tensor([3, 44])
    a, b = d.draft(model, anchor, last), ref.draft(model, anchor, last)
    # (equal to fp32 rounding: a matmul over 6 rows may round otherwise than over 1)
    _close(a.logits, b.logits, "logits")
    assert torch.equal(a.tokens, b.tokens)
    # and the rejected rows were not written: committing them changes the draft
    ref.commit(rows[:, 4:5], start + 4, torch.tensor([1, 0]), model.rope_main)
    assert not torch.equal(ref.draft(model, anchor, last + torch.tensor([1, 0])).logits[0], a.logits[0])


def test_the_markov_head_chains_the_drafts(parts):
    cfg, model = parts
    d = _dspark(cfg, False)
    g = torch.Generator().manual_seed(2)
    d.commit(torch.randn(2, 10, 3 * cfg.dim, generator=g), torch.zeros(2, dtype=torch.long),
             torch.tensor([10, 10]), model.rope_main)
    h = torch.randn(2, 5, cfg.hc_mult, cfg.dim, generator=g)
    anchor = torch.tensor([1, 2])
    base = d.head(model, h, anchor)
    w1 = d.mtp[-1].markov_head.markov_w1.weight
    # a strong bigram table that maps every token v to (v + 1) % V (rank 2: tokens on a circle, w2 row v at the
    # angle of v - 1): the drafts follow it from the anchor, whatever the stages' logits
    V, r = w1.shape
    w2 = d.mtp[-1].markov_head.markov_w2.weight
    ang = 2 * torch.pi * torch.arange(V) / V
    with torch.no_grad():
        saved = w2.clone(), w1.clone()
        w1.zero_()[:, :2] = torch.stack([ang.cos(), ang.sin()], 1)
        w2.zero_()[:, :2] = 1e3 * torch.stack([ang.cos(), ang.sin()], 1).roll(1, 0)
        chained = d.head(model, h, anchor)
        w2.copy_(saved[0])
        w1.copy_(saved[1])
    want = (anchor.unsqueeze(1) + torch.arange(1, 6)) % V
    assert torch.equal(chained.tokens, want) and not torch.equal(base.tokens, want)


def test_main_hidden_is_the_target_inputs_mean_over_hc():
    taps = [torch.randn(2, 3, 4, 8) for _ in range(3)]
    mh = main_hidden_of(taps)
    assert mh.shape == (2, 3, 24)
    assert torch.allclose(mh[..., 8:16], taps[1].mean(-2))


@pytest.mark.parametrize("simulate_quant", [False, True])
def test_keeping_the_first_k_drafts_gives_the_whole_blocks_first_k(parts, simulate_quant):
    """draft(keep=k) (what a step that verifies k drafts asks for: the last stage's MoE, the head and the Markov
    chain skip the positions past k; the attention still reads the whole non-causal block) gives the whole
    block's first k tokens, logits and confidences; and greedy or picked, the same picks."""
    cfg, model = parts
    d = _dspark(cfg, simulate_quant)
    g = torch.Generator().manual_seed(5)
    d.commit(torch.randn(2, 12, 3 * cfg.dim, generator=g), torch.zeros(2, dtype=torch.long),
             torch.tensor([12, 7]), model.rope_main)
    anchor, last = torch.tensor([4, 60]), torch.tensor([11, 6])
    whole = d.draft(model, anchor, last)
    assert len(set(whole.tokens.flatten().tolist())) > 2
    for k in range(1, d.block_size + 1):
        got = d.draft(model, anchor, last, keep=k)
        assert got.tokens.shape == (2, k) and got.logits.shape[:2] == (2, k)
        _close(got.logits, whole.logits[:, :k], f"keep {k} logits")
        _close(got.confidence, whole.confidence[:, :k], f"keep {k} confidence")
        assert torch.equal(got.tokens, whole.tokens[:, :k]), k
    with pytest.raises(ValueError, match="keep: 1 .. block_size=5 drafts, got 6"):
        d.draft(model, anchor, last, keep=6)

"""Greedy speculative decoding with the DSpark module (dsv4_model/runtime/dspark_speculative.py) on a tiny
0731-layout checkpoint: the tokens equal plain greedy decoding over 200+ tokens (crossing the compressors' windows
and the rings many times), with the module's own drafts and with drafts that agree with the main model for 0..K
positions (every acceptance count, several positions committed to the DSpark rings at once)."""

from __future__ import annotations

import pytest
import torch

from dsv4_model.checkpoint.loader import load_model
from dsv4_model.checkpoint.writer import canonical_weights, write_checkpoint
from dsv4_model.runtime.dspark_speculative import check_dspark_model
from tests.helpers.dspark_greedy import dspark_greedy
from tests.test_release_0731 import PROMPT, _dspark_cfg

N = 210


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = _dspark_cfg()
    return write_checkpoint(canonical_weights(cfg, seed=5), cfg, tmp_path_factory.mktemp("d0731"), "official")


def _load(path, **kw):
    return load_model(path, dtype=torch.float32, max_seq_len=256, progress=False, **kw)[0]


@pytest.fixture(scope="module")
def plain(ckpt):
    """Plain greedy: prefill, then one decode step per token (a model without spare ring slots)."""
    model = _load(ckpt, load_dspark=False)
    logits = model.prefill(torch.tensor([PROMPT]))
    out = [int(logits.argmax(-1))]
    for pos in range(len(PROMPT), len(PROMPT) + N + 5):  # K more: the last drafts' truth
        out.append(int(model.decode_step(torch.tensor([out[-1]]), torch.tensor([pos])).argmax(-1)))
    assert len(set(out)) > 10  # a real continuation
    return out


@pytest.fixture(scope="module")
def spec_model(ckpt):
    return _load(ckpt, spare_window_slots=5)


def test_dspark_drafts_give_plain_greedy_tokens(spec_model, plain):
    toks, stats = dspark_greedy(spec_model, torch.tensor([PROMPT]), N)
    assert toks[0] == plain[:N]
    assert stats.emitted + 1 >= N and stats.offered[0] == stats.steps  # (+ 1: the prefill's token)


def test_every_acceptance_count_gives_plain_greedy_tokens(spec_model, plain, monkeypatch):
    """Drafts taken from the plain continuation, the j-th of each block wrong (j = 0..K by turns): the step must
    accept exactly j, emit the main model's token after them and commit j + 1 positions."""
    dspark = check_dspark_model(spec_model)
    K, seq = dspark.block_size, PROMPT + plain
    real = dspark.draft
    calls = []

    def oracle(model, anchor, last, stage_out=None, keep=None):
        out = real(model, anchor, last, stage_out, keep=keep)  # the module still runs (its rings are read)
        p, j = int(last[0]) + 2, len(calls) % (K + 1)
        want = torch.tensor([seq[p:p + out.tokens.shape[1]]])
        if j < K:
            want[0, j] = (want[0, j] + 1) % spec_model.config.vocab_size
        calls.append(j)
        return out._replace(tokens=want)

    monkeypatch.setattr(dspark, "draft", oracle)
    toks, stats = dspark_greedy(spec_model, torch.tensor([PROMPT]), N)
    assert toks[0] == plain[:N]
    # step s verified the drafts of call s, wrong at j = s % (K + 1): it accepted exactly j
    assert stats.accepted == [sum(j > i for j in calls[:stats.steps]) for i in range(K)]
    assert stats.accepted[K - 1] > 0 and stats.emitted / stats.steps > 3


def test_mtp_speculation_on_a_dspark_model_names_dspark(spec_model):
    from dsv4_model.runtime.speculative import check_model

    with pytest.raises(ValueError, match="^speculative decoding here drafts with an MTP block, and this checkpoint "
                                         "carries a DSpark module instead"):
        check_model(spec_model, 2)


class Counted(torch.nn.Module):
    """A module's stand-in that counts the calls reaching it (a drafting copy is read, not just built)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def test_dspark_drafts_from_the_nvfp4_drafters_head_give_plain_greedy_tokens(ckpt, plain):
    """DSpark reads the drafters' head (transformer.draft_head) for its block's logits: with the NVFP4 copy the
    greedy tokens are still plain greedy decoding's (verification reads the stored head)."""
    from dsv4_model.model.transformer import attach_draft_head
    from dsv4_model.quant.nvfp4_modules import nvfp4_draft_head

    model = _load(ckpt, spare_window_slots=5)
    head = Counted(nvfp4_draft_head(model.head))
    attach_draft_head(model, head)
    toks, stats = dspark_greedy(model, torch.tensor([PROMPT]), N)
    assert toks[0] == plain[:N]
    assert head.calls >= stats.steps > 0  # every block drafted through it


def test_the_nvfp4_drafters_head_gives_dspark_an_nvfp4_markov_bias(tmp_path):
    """Engine.set_draft_head("nvfp4") also gives DSpark's Markov head an NVFP4 copy of its fp32 markov_w2 (read
    once per drafted position): the drafts read it (its products are the dequantized weight's), greedy output is
    still plain greedy's, and "stored" gives the projection back."""
    import dataclasses

    from dsv4_model.model.dspark import attach_draft_markov, draft_markov
    from dsv4_model.quant.nvfp4_modules import dequantized_weight, is_nvfp4
    from dsv4_model.runtime.engine import Engine

    base = _dspark_cfg()
    cfg = dataclasses.replace(base, dspark=dataclasses.replace(base.dspark, markov_rank=16))  # whole NVFP4 blocks
    path = write_checkpoint(canonical_weights(cfg, seed=5), cfg, tmp_path / "r16", "official")
    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=256,
                                 progress=False, compile=False, spare_window_slots=5)
    m = eng.model
    mk = m.dspark.mtp[-1].markov_head
    want, _ = dspark_greedy(m, torch.tensor([PROMPT]), 60)
    eng.set_draft_head("nvfp4")
    w2 = draft_markov(mk)
    assert is_nvfp4(w2) and w2 is not mk.markov_w2 and "draft_w2" not in dict(mk.named_modules())
    e = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w2(e), e.to(torch.bfloat16).float() @ dequantized_weight(w2).T, atol=1e-5, rtol=1e-5)

    counted = Counted(w2)
    attach_draft_markov(mk, counted)
    got, stats = dspark_greedy(m, torch.tensor([PROMPT]), 60)
    assert got == want and counted.calls >= stats.steps > 0
    eng.set_draft_head("stored")
    assert draft_markov(mk) is mk.markov_w2


@pytest.mark.parametrize("op, want", [("swap_rows_", [3.0, 2.0, 1.0]), ("copy_rows_", [3.0, 2.0, 3.0])])
def test_row_swaps_and_copies_carry_the_dspark_rings(ckpt, op, want):
    """The scheduler swaps a prefill chunk's rows down to rows [:k] and back (Engine.swap_rows), and copies a row
    into another for a prefix snapshot (Engine.copy_rows): DSpark's rings (attached, not a submodule) move with
    the main caches, or the chunk's prompt lands in another row's rings; no other row changes."""
    model = load_model(ckpt, dtype=torch.float32, max_seq_len=64, max_batch_size=3, progress=False)[0]
    rings = [st.attn.kv_cache for st in model.dspark.mtp]
    main = next(b for n, b in model.named_buffers() if n.endswith("kv_cache"))
    for r in (*rings, main):
        for row in range(3):
            r[row].fill_(float(row + 1))
    getattr(model, op)([2], [0])
    for r in (*rings, main):
        assert [float(r[row].flatten()[0]) for row in range(3)] == want


def test_a_dspark_step_needs_k_positions_of_room_not_2k(ckpt):
    """A DSpark step writes the verified K + 1 positions only (drafting reads the rings): its runner's reach is K
    (MTP's 2K: its chained drafts write too), so a prompt of max_seq_len - K tokens is taken, and a row decodes
    the plain greedy tokens until K positions before max_seq_len."""
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.sampling import SamplingParams
    from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler
    from tests.helpers.to_the_end import to_the_end

    K, seq = 2, 64
    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, max_batch_size=1, max_seq_len=seq,
                                 progress=False, compile=False, spare_window_slots=K)
    s = SpeculativeScheduler(eng, K, method="dspark", modes=("greedy",))
    assert s.runner.reach == K and s.limit == seq - K
    prompt = list(PROMPT) + list(range(3, 3 + 40 - len(PROMPT)))
    r, ref = to_the_end(s, eng, prompt)
    assert r.finish_reason == "max_seq_len" and ref.finish_reason == "max_seq_len"
    assert r.token_ids == ref.token_ids[:len(r.token_ids)] and len(r.token_ids) >= seq - K - 40 - K
    s = SpeculativeScheduler(eng, K, method="dspark", modes=("greedy",))
    s.submit(Request(list(range(1, seq - K + 1)), SamplingParams(), 1, ignore_eos=True)).cancel()
    with pytest.raises(ValueError, match=f"no room for speculative steps \\(at most max_seq_len - {K} = {seq - K}"):
        s.submit(Request(list(range(1, seq - K + 2)), SamplingParams(), 1))
    s.run_until_idle()

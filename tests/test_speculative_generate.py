"""generate(..., speculate=K) (dsv4_model.runtime.speculative_runner / speculative_generate): greedy output equal to
speculate=0 over 200 tokens crossing window wraps and compression boundaries (ragged acceptance, the tiny
checkpoints of the layouts with an MTP block), the compiled step traced whole, sampled output following the non-speculative
distribution (chi-square against the exact joint of three tokens from the plain model's logits), the sampler's
distribution as the step computes it, and the refusals."""
import dataclasses

import pytest
import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG, write_tiny_checkpoint
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.session import RunnerOptions
from dsv4_model.runtime.speculative import filtered_probs
from dsv4_model.runtime.speculative_runner import SpeculativeRunner
from dsv4_ops.reference import sample_probs_ref
from tests.helpers.chi_square import assert_follows, exact_joint3
from tests.helpers.forced_drafts import force_drafts
from tests.helpers.speculative_static import static_speculative

# eos outside the vocabulary: no row stops early, so every row crosses the compression boundaries
CFG = ModelConfig(**{**TINY_CONFIG, "n_layers": 3, "compress_ratios": [0, 4, 16, 0], "eos_token_id": 10_000})
CFG = CFG.validate()
N = 200


def _engine(spare: int, rows: int = 3, seq: int = 256, cfg=CFG, seed: int = 6) -> Engine:
    m = init_random_weights(Transformer(cfg, max_batch_size=rows, max_seq_len=seq, dtype=torch.float32,
                                        simulate_quant=False, spare_window_slots=spare), seed)
    return Engine(m, runner_options=RunnerOptions(compile=False))


def _prompts(n_rows=3, lens=(13, 9, 5), vocab=CFG.vocab_size):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens[:n_rows]]


def _force_half(monkeypatch, truth, prompts):
    """The MTP block drafts truth's token where position % (2 + row) == 0 (rows accept different counts)."""
    lengths = [len(p) for p in prompts]

    def token(b, t):
        i = t + 2 - lengths[b]  # index of token t + 2 in the continuation (token 0 at position L)
        return truth[b][i] if 0 <= i < len(truth[b]) and t % (2 + b) == 0 else None

    force_drafts(monkeypatch, token)


@pytest.mark.parametrize("k,chunk", [(1, None), (2, None), (3, None), (2, 4)])
def test_greedy_equals_plain_generate(monkeypatch, k, chunk):
    """chunk: the prompts prefilled 4 positions at a time (the MTP block's cache too)."""
    e = _engine(k)
    if chunk is not None:
        e.prefill_chunk = chunk
    prompts = _prompts()
    want = e.generate(prompts, max_new_tokens=N)
    plain_lengths = e.lengths
    _force_half(monkeypatch, want.token_ids, prompts)
    got = e.generate(prompts, max_new_tokens=N, speculate=k)
    assert got.token_ids == want.token_ids and got.finish_reasons == ["length"] * 3
    stats = got.extra["speculation"]
    assert 0.2 < stats.acceptance()[0] < 0.9 and stats.tokens_per_step > 1.2
    assert got.decode_steps < want.decode_steps
    # the engine continues where each row's last emitted token goes (what plain decode() then feeds)
    assert all(n >= len(p) + N - 1 for n, p in zip(e.lengths, prompts)) and len(plain_lengths) == 3
    logits = e.decode(torch.tensor([t[-1] for t in got.token_ids]))
    assert logits.shape == (3, CFG.vocab_size)


@pytest.mark.parametrize("layout", ["official", "modelopt"])  # (HF checkpoints carry no MTP block)
def test_tiny_checkpoints(tmp_path, layout):
    cfg = dataclasses.replace(CFG)
    write_tiny_checkpoint(tmp_path, layout, seed=2, config=cfg)
    e = Engine.from_pretrained(tmp_path, device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=256,
                               compile=False, progress=False, spare_window_slots=2)
    prompts = _prompts(2)
    want = e.generate(prompts, max_new_tokens=N)
    got = e.generate(prompts, max_new_tokens=N, speculate=2)
    assert got.token_ids == want.token_ids


def test_the_compiled_step_is_one_graph():
    """The step as DecodeRunner compiles it (fullgraph, static shapes; Dynamo only, the CPU's cheap check): the
    same tokens as eager, no graph break, one graph per sampling mode."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    e = _engine(2, rows=2)
    prompts = _prompts(2)
    params = [SamplingParams(), SamplingParams()]
    want = e.generate(prompts, max_new_tokens=40, speculate=2).token_ids
    runner = SpeculativeRunner(e.model, 2, compile=True, compile_backend="eager")
    got, _, _ = static_speculative(e, runner, prompts, params, 40, {CFG.eos_token_id})
    assert got == want
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("top_k, top_p", [(4, 1.0), (5, 0.8)])
def test_sampling_follows_the_plain_distribution(top_k, top_p):
    """3 tokens after one prompt, 2048 draws (seeds) with K = 2 drafts from the random MTP block (accepted about
    half the time, so the acceptance, the correction and the bonus draws all act): chi-square against the exact
    joint of the plain model, p(t1) p(t2 | t1) p(t3 | t1, t2) from its prefill logits of every prefix and the
    sampler's reference distribution."""
    T, rows, draws = 1.5, 64, 2048
    cfg = dataclasses.replace(CFG, vocab_size=8)  # a small vocabulary: the MTP block's top tokens overlap the main's
    e = _engine(2, rows=rows, seq=64, cfg=cfg, seed=4)
    prompt = _prompts(1, (7,), vocab=8)[0]
    seen: dict[tuple, int] = {}
    for s in range(0, draws, rows):
        res = e.generate([prompt] * rows, max_new_tokens=3, temperature=T, top_k=top_k, top_p=top_p, seed=s,
                         speculate=2)
        for t in res.token_ids:
            seen[tuple(t)] = seen.get(tuple(t), 0) + 1
    acc = res.extra["speculation"].acceptance()[0]
    assert_follows(seen, exact_joint3(e.model, prompt, T, top_k, top_p))
    assert 0.1 < acc < 0.95  # both the acceptance and the correction act


@pytest.mark.parametrize("mode", ["greedy", "sample", "filter"])
def test_filtered_probs_is_the_samplers_distribution(mode):
    g = torch.Generator().manual_seed(0)
    B, V = 12, 300
    logits = (torch.randn(B, V, generator=g) * 3).round(decimals=1)  # ties at every boundary
    t = torch.rand(B, generator=g) + 0.3
    t[0] = 0.0
    k = torch.randint(0, 40, (B,), generator=g)
    p = torch.rand(B, generator=g)
    p[1], p[2], k[3] = 1.0, 0.0, V
    if mode != "filter":
        k, p = torch.zeros_like(k), torch.ones_like(p)
    if mode == "greedy":
        t = torch.zeros_like(t)
    got = filtered_probs(logits, t, k, p, mode)
    want = sample_probs_ref(logits, t, k, p)
    assert torch.allclose(got.double(), want, atol=1e-6, rtol=1e-5)


def test_refusals():
    e = _engine(1, rows=2, seq=64)
    with pytest.raises(ValueError, match="spare_window_slots >= 2"):
        e.generate(_prompts(2), max_new_tokens=4, speculate=2)
    with pytest.raises(ValueError, match="speculate must be an int"):
        e.generate(_prompts(2), max_new_tokens=4, speculate=-1)
    no_mtp = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 2, "compress_ratios": [0, 4]}).validate()
    with pytest.raises(ValueError, match="MTP block"):
        _engine(1, rows=2, seq=64, cfg=no_mtp).generate(_prompts(2), max_new_tokens=4, speculate=1)


def test_max_seq_len_cuts_rows_short():
    """Rows stop 2K positions before the caches end, saying so; the tokens so far are the plain ones."""
    e = _engine(2, rows=2, seq=64)
    prompts = _prompts(2)
    want = e.generate(prompts, max_new_tokens=100)
    got = e.generate(prompts, max_new_tokens=100, speculate=2)
    assert got.finish_reasons == ["max_seq_len"] * 2
    for w, g_ in zip(want.token_ids, got.token_ids):
        assert len(g_) >= 64 - 13 - 4 - 3 and g_ == w[: len(g_)]

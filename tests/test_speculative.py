"""Greedy speculative decoding with the MTP block (dsv4_model.runtime.speculative): the plain greedy decode's
tokens over 200 steps crossing window wraps and compression boundaries, with the block's own drafts (mostly
rejected on a random model), with drafts forced right (every one accepted) and half right (ragged acceptance
across rows), on the built-in model (mostly accepted), and the refusals."""
import pytest
import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

from helpers.forced_drafts import force_drafts
from helpers.speculative_greedy import speculative_greedy
from test_default_model import ASSETS, needs_assets

N = 200
CFG = ModelConfig(**{**TINY_CONFIG, "n_layers": 3, "compress_ratios": [0, 4, 16, 0]}).validate()


def _model(spare: int) -> Transformer:
    m = Transformer(CFG, max_batch_size=2, max_seq_len=256, dtype=torch.float32, simulate_quant=False,
                    spare_window_slots=spare)
    return init_random_weights(m, 6)


def _greedy(m, prompt, lengths, n=N) -> list[list[int]]:
    y = m.prefill(prompt, lengths).argmax(-1)
    out = [[int(t)] for t in y]
    for t in range(n - 1):
        y = m.decode_step(y, lengths + t).argmax(-1)
        for b, v in enumerate(y.tolist()):
            out[b].append(v)
    return out


@pytest.fixture(scope="module")
def case():
    prompt = torch.randint(0, CFG.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([13, 9])  # ragged rows
    return prompt, lengths, _greedy(_model(0), prompt, lengths)


def _force(monkeypatch, truth, lengths, right):
    """Make the MTP block's drafts the greedy tokens where right(position) holds: the draft made at position t
    (for token t + 2) becomes truth's token there."""
    def token(b, t):
        i = t + 2 - int(lengths[b])  # index of token t + 2 in the continuation
        return truth[b][i] if 0 <= i < len(truth[b]) and right(b, t) else None

    force_drafts(monkeypatch, token)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drafts", ["own", "right", "half"])
def test_the_plain_greedy_tokens(case, monkeypatch, k, drafts):
    prompt, lengths, want = case
    m = _model(k)
    if drafts == "right":
        _force(monkeypatch, want, lengths, lambda b, t: True)
    elif drafts == "half":  # row 0 right at even positions, row 1 at every third: rows accept different counts
        _force(monkeypatch, want, lengths, lambda b, t: t % (2 + b) == 0)
    got, stats = speculative_greedy(m, prompt, N, k, lengths)
    assert got == want
    rates = stats.acceptance()
    if drafts == "right":
        # (drafts past the 200th token are not forced: a few at the end fail)
        assert min(rates) > 0.95 and stats.tokens_per_step > k + 0.8
    elif drafts == "half":
        assert 0.2 < rates[0] < 0.9
    else:
        assert stats.tokens_per_step >= 1.0


def test_refusals(case):
    prompt, lengths, _ = case
    with pytest.raises(ValueError, match="spare_window_slots >= 2"):
        speculative_greedy(_model(1), prompt, 8, 2, lengths)
    with pytest.raises(ValueError, match="speculate must be an int >= 1"):
        speculative_greedy(_model(1), prompt, 8, 0, lengths)
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        speculative_greedy(_model(1), prompt, 250, 1, lengths)
    no_mtp = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 2, "compress_ratios": [0, 4]}).validate()
    m = Transformer(no_mtp, max_batch_size=2, max_seq_len=64, dtype=torch.float32, spare_window_slots=1)
    with pytest.raises(ValueError, match="MTP block"):
        speculative_greedy(m, prompt, 8, 1, lengths)


@needs_assets
@pytest.mark.parametrize("k", [1, 3])
def test_the_built_in_model(k):
    """The shipped model (NVFP4 W4A16, fp32 on the CPU, the official simulated roundings), its own MTP drafts
    mostly accepted: the greedy tokens of the same model decoding one token per step, exactly (the CPU kernels
    sum every row in one order whatever the row count: dsv4_ops/csrc/row_matmul.h)."""
    from dsv4_model.checkpoint.tokenizer import load_tokenizer
    from dsv4_model.runtime.engine import Engine

    m = Engine.from_pretrained(ASSETS, device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=512,
                               progress=False, compile=False, spare_window_slots=k).model
    tok = load_tokenizer(ASSETS, m.config)
    ids = [tok.encode(t) for t in ("def fibonacci(n):\n", "import os\nclass Path:\n")]
    L = max(map(len, ids))
    prompt = torch.tensor([i + [0] * (L - len(i)) for i in ids])
    lengths = torch.tensor([len(i) for i in ids])
    got, stats = speculative_greedy(m, prompt, N, k, lengths)
    assert got == _greedy(m, prompt, lengths)
    assert stats.acceptance()[0] > 0.5 and stats.tokens_per_step > 1.5


def test_wide_argmax_is_argmax():
    """The verification's two-reduction argmax (model.layers.wide_argmax) gives torch.argmax's index: the first
    maximum, ties within a piece and across pieces, NaN as the maximum, rows of -inf, widths it splits and not."""
    from dsv4_model.model.layers import wide_argmax

    g = torch.Generator().manual_seed(0)
    for V in (129280, 4096, 1000, 32768 + 8):
        x = torch.randn(3, 4, V, generator=g)
        x[0, 0, 5] = x[0, 0, V - 3] = 100.0  # tie across pieces
        x[0, 1, 7] = x[0, 1, 8] = 100.0  # tie inside one
        x[1, 0] = 0.0
        x[1, 1, V // 2] = x[1, 1, V - 1] = float("nan")
        x[2, 2] = float("-inf")
        assert torch.equal(wide_argmax(x), x.argmax(-1)), V
        assert torch.equal(wide_argmax(x[0, 0]), x[0, 0].argmax(-1)), V

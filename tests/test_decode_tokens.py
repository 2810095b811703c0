"""Transformer.decode_tokens: T tokens per row from any position in one pass (a speculative step's verification, a
prompt continued in chunks) against a prefill of the whole sequence and against T decode steps, for every layer
kind, ragged positions, both debug overrides, NVFP4 weights, and under torch.compile(fullgraph=True)."""
import pytest
import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG, make_config
from dsv4_model.model import mtp
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.decode_options import DecodeOptions
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights, random_nvfp4_model

PROMPT, TOTAL = 13, 60


def _float_model(simulate_quant: bool, spare: int = 0, **fields):
    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 3, "compress_ratios": [0, 4, 16],
                         **fields}).validate()
    m = Transformer(cfg, max_batch_size=2, max_seq_len=64, dtype=torch.float32, simulate_quant=simulate_quant,
                    spare_window_slots=spare)
    return init_random_weights(m, 5), cfg


def _ids(cfg):
    return torch.randint(0, cfg.vocab_size, (2, TOTAL), generator=torch.Generator().manual_seed(3))


def _chunks(m, ids, T, opts=DecodeOptions(), fn=None):
    """Prefill PROMPT tokens, then the rest T at a time; the logits of every position after the prompt."""
    fn = fn or m.decode_tokens
    m.prefill(ids[:, :PROMPT])
    outs, p = [], PROMPT
    while p + T <= ids.shape[1]:
        outs.append(fn(ids[:, p:p + T], torch.full((2,), p), opts))
        p += T
    return torch.cat(outs, dim=1), p


@pytest.mark.parametrize("T", [1, 2, 4, 7])
@pytest.mark.parametrize("opts", [DecodeOptions(), DecodeOptions(attention="torch"), DecodeOptions(hc_pre=False)],
                         ids=["shipped", "attention=torch", "hc_pre=0"])
def test_chunks_give_the_logits_of_one_prefill(T, opts):
    """Continuing a prompt T tokens at a time (the 16-token window wraps, ratio-4 and ratio-16 windows close
    inside chunks) gives the logits of one prefill of the whole sequence; fp32, no simulated quantization (its
    FP8 / FP4 roundings turn summation-order ulps into visible steps: the next test)."""
    m, cfg = _float_model(simulate_quant=False)
    ids = _ids(cfg)
    want = _float_model(simulate_quant=False)[0].prefill(ids, all_logits=True)
    got, end = _chunks(m, ids, T, opts)
    torch.testing.assert_close(got, want[:, PROMPT:end], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [2, 4])
def test_chunks_with_simulated_quantization_pick_the_same_tokens(T):
    """With the official FP8 KV / FP4 indexer roundings the chunks still give the prefill's greedy tokens, and
    logits within the steps a flipped rounding makes."""
    m, cfg = _float_model(simulate_quant=True)
    ids = _ids(cfg)
    want = _float_model(simulate_quant=True)[0].prefill(ids, all_logits=True)
    got, end = _chunks(m, ids, T)
    torch.testing.assert_close(got, want[:, PROMPT:end], rtol=0, atol=5e-3)
    assert torch.equal(got.argmax(-1), want[:, PROMPT:end].argmax(-1))


def test_ragged_positions_and_spare_slots():
    """Rows at different positions (prompts of 13 and 7 tokens), window rings with spare slots: each row's chunks
    give what its own decode steps give."""
    m, cfg = _float_model(simulate_quant=False, spare=3)
    ref, _ = _float_model(simulate_quant=False, spare=3)
    ids = _ids(cfg)
    lengths = torch.tensor([PROMPT, 7])
    for model in (m, ref):
        model.prefill(ids[:, :PROMPT], lengths)
    got, want = [], []
    for c in range(5):
        pos = lengths + 3 * c
        got.append(m.decode_tokens(ids[:, PROMPT + 3 * c: PROMPT + 3 * c + 3], pos))
        want += [ref.decode_step(ids[:, PROMPT + 3 * c + t], pos + t) for t in range(3)]
    torch.testing.assert_close(torch.cat(got, 1), torch.stack(want, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("simulate_quant", [False, True], ids=["fp32-keys", "fp8-kv-fp4-indexer"])
@pytest.mark.parametrize("opts", [DecodeOptions(), DecodeOptions(attention="fused"), DecodeOptions(attention="torch")],
                         ids=["shipped", "attention=fused", "attention=torch"])
@pytest.mark.parametrize("index_head_dim", [32, 64], ids=["keys-by-tensor-ops", "keys-by-the-op"])
def test_one_attention_call_for_the_tokens_equals_token_after_token(simulate_quant, opts, index_head_dim):
    """With T - 1 spare ring slots the layers select (the FP4 indexer's op where simulate_quant) and attend the T
    tokens in one call each after their cache writes (Attention.decode_tokens); without, token after token. Both
    give the same logits, ragged positions, every chunk of 4 tokens (the window wraps, ratio-4 and ratio-16
    windows close inside chunks), the indexer's keys stored by tensor ops (head dim 32) or by
    dsv4::indexer_store_keys (64). The torch form sums over the ring's slots, so rings of other sizes agree to
    fp32 ulps, which the simulated FP8 / FP4 roundings turn into steps (as two rings token after token do): there
    the greedy tokens, and logits within those steps."""
    T, wide = 4, dict(index_head_dim=index_head_dim)
    (batched, cfg), (tokenwise, _) = _float_model(simulate_quant, T - 1, **wide), _float_model(simulate_quant, **wide)
    ids = _ids(cfg)
    lengths = torch.tensor([PROMPT, 9])
    for m in (batched, tokenwise):
        m.prefill(ids[:, :PROMPT], lengths)
    for c in range((TOTAL - PROMPT) // T):
        chunk, pos = ids[:, PROMPT + T * c: PROMPT + T * (c + 1)], lengths + T * c
        got, want = batched.decode_tokens(chunk, pos, opts), tokenwise.decode_tokens(chunk, pos, opts)
        if simulate_quant and opts.attention == "torch":
            torch.testing.assert_close(got, want, rtol=0, atol=5e-3)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_ops_run_once_per_layer_for_the_tokens(monkeypatch):
    """With spare slots a T-token decode calls dsv4::sparse_attn_decode once per layer, the FP4 indexer's
    dsv4::indexer_score_topk and its key store once per CSA layer, and dsv4::compressor_decode once per compressor
    and the compressed-entry store once per compressor of the attention, the window's store once per layer
    (token after token: T times each, the window's by index_put)."""
    calls = dict.fromkeys(("sparse_attn_decode", "indexer_score_topk", "indexer_store_keys", "rms_norm_rope_store",
                           "compressor_decode"), 0)
    for name in calls:
        real = getattr(torch.ops.dsv4, name)
        monkeypatch.setattr(torch.ops.dsv4, name, lambda *a, _r=real, _n=name: calls.__setitem__(_n, calls[_n] + 1)
                            or _r(*a))
    T, opts = 4, DecodeOptions(attention="fused")
    for spare, per_layer in ((T - 1, 1), (0, T)):
        m, cfg = _float_model(simulate_quant=True, spare=spare, index_head_dim=64)  # keys the key-store op takes
        ids = _ids(cfg)
        m.prefill(ids[:, :PROMPT])
        calls.update(dict.fromkeys(calls, 0))
        m.decode_tokens(ids[:, PROMPT:PROMPT + T], torch.full((2,), PROMPT), opts)
        csa, compressed = cfg.compress_ratios.count(4), sum(r > 0 for r in cfg.compress_ratios)
        window = cfg.n_layers if per_layer == 1 else 0
        assert calls == {"sparse_attn_decode": cfg.n_layers * per_layer, "indexer_score_topk": csa * per_layer,
                         "indexer_store_keys": csa * per_layer, "rms_norm_rope_store": compressed * per_layer + window,
                         "compressor_decode": (compressed + csa) * per_layer}, spare


def test_nvfp4_weights():
    """A random NVFP4 (W4A16, bf16) model: 3 tokens per pass give, within bf16 noise, the logits of a prefill of
    the whole sequence, and the greedy tokens of 3 decode steps per pass."""
    cfg = make_config().sliced(n_mtp_layers=0)
    models = [random_nvfp4_model(cfg, device="cpu", max_batch_size=2, max_seq_len=64, seed=1) for _ in range(3)]
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    full = models[2].prefill(ids[:, :37], all_logits=True)[:, PROMPT:37]
    for model in models[:2]:
        model.prefill(ids[:, :PROMPT])
    got = torch.cat([models[0].decode_tokens(ids[:, p:p + 3], torch.full((2,), p)) for p in range(PROMPT, 37, 3)],
                    dim=1)
    steps = torch.stack([models[1].decode_step(ids[:, p], torch.full((2,), p)) for p in range(PROMPT, 37)], dim=1)
    assert torch.isfinite(got).all()
    assert float((got - full).norm() / full.norm()) < 0.02
    assert (got.argmax(-1) == full.argmax(-1)).float().mean() >= 0.95
    assert (got.argmax(-1) == steps.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("spare", [0, 2], ids=["token-after-token", "one-call"])
def test_compiles_as_one_graph(spare):
    """torch.compile(fullgraph=True) traces the T-token pass (static shapes, no host sync) and gives eager's
    logits, token after token and with the ops called once for the tokens (spare slots)."""
    m, cfg = _float_model(simulate_quant=False, spare=spare)
    ref, _ = _float_model(simulate_quant=False, spare=spare)
    ids = _ids(cfg)
    torch._dynamo.reset()
    step = torch.compile(lambda t, p, o: m.decode_tokens(t, p, o), fullgraph=True, backend="aot_eager")
    got, _ = _chunks(m, ids[:, :PROMPT + 6], 3, fn=step)
    want, _ = _chunks(ref, ids[:, :PROMPT + 6], 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mtp_block_from_any_position_gives_its_forward_over_the_sequence():
    """The MTP block continued chunk by chunk (mtp.decode_tokens on the main streams mtp.verify_tokens returns)
    gives what mtp.prefill gives over the whole sequence teacher-forced; fp32."""
    cfg = ModelConfig(**{**TINY_CONFIG, "n_layers": 3, "compress_ratios": [0, 4, 16, 0]}).validate()
    m = Transformer(cfg, max_batch_size=2, max_seq_len=64, dtype=torch.float32, simulate_quant=False)
    init_random_weights(m, 6)
    ids = _ids(cfg)[:, :40]
    S = ids.shape[1]
    with torch.no_grad():
        want, _ = mtp.prefill(m, m.streams(ids, torch.full((2,), S))[:, :-1], ids[:, 1:])
        m.prefill(ids[:, :PROMPT])
        h = m.streams(ids[:, :PROMPT], torch.full((2,), PROMPT))
        mtp.prefill(m, h[:, :-1], ids[:, 1:PROMPT])  # the block's cache: positions 0 .. PROMPT - 2
    last, got = h[:, -1:], []
    for p in range(PROMPT, S - 2, 3):
        _, hs = mtp.verify_tokens(m, ids[:, p:p + 3], torch.full((2,), p))
        # the block at positions p - 1 .. p + 1: the streams there with the token after each
        got.append(mtp.decode_tokens(m, torch.cat([last, hs[:, :2]], dim=1), ids[:, p:p + 3],
                                     torch.full((2,), p - 1))[0])
        last = hs[:, 2:]
    got = torch.cat(got, dim=1)
    torch.testing.assert_close(got, want[:, PROMPT - 1:PROMPT - 1 + got.shape[1]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [2, 4, 7])
def test_entry_write_of_t_tokens_is_the_token_after_token_write(T, monkeypatch):
    """Attention._write_entry over T tokens of each sequence (one index_put) leaves the cache the T writes token
    after token leave, with ragged positions, windows closing mid-pass and positions past the cache's last slot
    (clamped: several tokens of a sequence name it, an earlier one closing it); every duplicate index of the one
    write carries the same value, so the result does not depend on the order a device applies them in."""
    from types import SimpleNamespace

    from dsv4_model.model.attention import Attention

    g = torch.Generator().manual_seed(T)
    layer, offset, n, seqs = SimpleNamespace(ratio=4), 3, 5, 3
    for start in ([0, 5, 9], [14, 17, 18], [19, 22, 30]):  # the last rows run past slot n - 1 = 4
        positions = (torch.tensor(start).unsqueeze(0) + torch.arange(T).unsqueeze(1)).flatten()
        entry = torch.randn(T * seqs, 8, generator=g)
        complete = (positions + 1) % 4 == 0
        cache = torch.randn(seqs, offset + n, 8, generator=g)
        want = cache.clone()
        for t in range(T):
            r = slice(t * seqs, (t + 1) * seqs)
            Attention._write_entry(layer, want, offset, positions[r], entry[r], complete[r])
        puts, real = [], torch.Tensor.index_put_
        monkeypatch.setattr(torch.Tensor, "index_put_", lambda self, idx, v: puts.append((idx, v)) or real(self, idx, v))
        Attention._write_entry(layer, cache, offset, positions, entry, complete, seqs)
        monkeypatch.undo()
        assert torch.equal(cache, want), start
        (rows, slots), values = puts[0]
        assert len(puts) == 1 and len(set(zip(rows.tolist(), slots.tolist()))) < T * seqs  # duplicates exist
        for i in range(T * seqs):
            for j in range(T * seqs):
                if rows[i] == rows[j] and slots[i] == slots[j]:
                    assert torch.equal(values[i], values[j]), (start, i, j)

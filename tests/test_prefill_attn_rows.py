"""Prefill attention in query-row chunks (Attention.prefill_rows): by default as many rows as keep a chunk's
scores within the budget (one chunk for the default model's prompts, so an exported prefill has no unrolled
loop); however the rows are chunked, the logits are the same."""
import pytest
import torch

import dsv4_ops  # noqa: F401  (the op library: the model's fused ops)
from dsv4_model.checkpoint.writer import make_config
from dsv4_model.model import attention
from dsv4_model.model.attention import Attention
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights


def _model(chunk=None):
    # Exact numerics: with the simulated FP8 / FP4 rounding an ulp of a chunk's accumulation order can move a value
    # across a rounding boundary (seen at 2.5e-4 on an AVX512 host), which is not what this file tests.
    return init_random_weights(Transformer(make_config("tiny"), max_batch_size=2, max_seq_len=512, dtype=torch.float32,
                                           simulate_quant=False, prefill_attn_rows=chunk), 0).eval()


def _score_bytes(a: Attention, B, rows, n):
    return B * a.n_heads * rows * (2 * a.window + n) * 4


def test_rows_are_the_most_that_fit_the_budget(monkeypatch):
    a = next(m for m in _model().modules() if isinstance(m, Attention))
    assert a.prefill_rows(1, 4096, 1024) == 4096 or _score_bytes(a, 1, 4096, 1024) > attention.PREFILL_SCORE_BYTES
    for budget in (2**20, 2**24, 2**27):
        monkeypatch.setattr(attention, "PREFILL_SCORE_BYTES", budget)
        for B, S, n in ((1, 4096, 1024), (2, 3000, 0), (1, 100, 25)):
            r = a.prefill_rows(B, S, n)
            assert 1 <= r <= S
            if r > 64:
                assert _score_bytes(a, B, r, n) <= budget
            assert r == S or _score_bytes(a, B, 2 * r, n) > budget  # no more rows than needed to fit
    a.prefill_attn_rows = 48
    assert a.prefill_rows(1, 4096, 1024) == 48


def test_prefill_attn_rows_must_be_positive():
    with pytest.raises(ValueError, match="prefill_attn_rows"):
        _model(0)


@pytest.mark.parametrize("budget", [None, 1])
def test_logits_do_not_depend_on_the_chunking(monkeypatch, budget):
    torch.manual_seed(0)
    ids = torch.randint(0, make_config("tiny").vocab_size, (2, 200))
    lengths = torch.tensor([200, 137])
    whole = _model().prefill(ids, lengths, all_logits=True)
    if budget is not None:
        monkeypatch.setattr(attention, "PREFILL_SCORE_BYTES", budget)  # 64-row chunks
        got = _model().prefill(ids, lengths, all_logits=True)
    else:
        got = _model(chunk=24).prefill(ids, lengths, all_logits=True)
    valid = torch.arange(200)[None, :] < lengths[:, None]
    torch.testing.assert_close(got[valid], whole[valid], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("entries", ["none", "shared", "per-query"])
def test_window_sub_blocks_equal_one_dense_mask(entries):
    """_attend_window (the window in sub-blocks of W queries, a band mask over 2W - 1 keys each) gives what one
    softmax over the block's dense window mask gives (_attend, decode's torch form): T not a multiple of W, a row
    whose first keys lie before position 0, shared (dense) or per-query (top-k) entries."""
    a = next(m for m in _model().modules() if isinstance(m, Attention))
    g = torch.Generator().manual_seed(5)
    B, S, T, t0, H, D = 2, 90, 37, 40, a.n_heads, a.head_dim
    P = a.window - 1
    kv = torch.randn(B, P + S, D, generator=g)
    q = torch.randn(B, T, H, D, generator=g)
    first_ok = torch.tensor([[0], [P - 3 - t0]])  # row 1: positions from 3 - t0 on exist (start 3 - t0 < 0 past)
    blk = vis = qkeys = qmask = None
    if entries == "shared":
        blk = torch.randn(B, 11, D, generator=g)
        vis = torch.rand(B, T, 11, generator=g) < 0.6
    elif entries == "per-query":
        qkeys = torch.randn(B, T, 5, D, generator=g)
        qmask = torch.rand(B, T, 5, generator=g) < 0.6
    got = a._attend_window(q, kv, t0, first_ok, blk, vis, qkeys, qmask)
    tq = torch.arange(T).view(1, -1, 1)
    tj = torch.arange(T + P).view(1, 1, -1)
    mask = (tj >= tq) & (tj <= tq + P) & (t0 + tj >= first_ok.unsqueeze(-1))
    keys = kv[:, t0:t0 + T + P]
    if blk is not None:
        keys, mask = torch.cat([keys, blk], dim=1), torch.cat([mask, vis], dim=-1)
    want = a._attend(q, keys, mask, qkeys, qmask)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dense_max", [2048, 0])
def test_prefill_through_the_decode_attention_op(monkeypatch, dense_max):
    """Prefill's attention as dsv4::sparse_attn_decode calls (each query a row listing its window rows and its
    entries; what CUDA runs) gives the torch form's logits and caches: chunks from position 0 and from per-row
    starts, CSA (indexer top-k; dense_max 0: the gather form on the torch side) and HCA layers, blocks of rows."""
    torch.manual_seed(0)
    ids = torch.randint(0, make_config("tiny").vocab_size, (2, 120))

    def run(use_op: bool):
        monkeypatch.setattr(Attention, "prefill_attn_op", lambda self, x: use_op)
        m = _model()
        for mod in m.modules():
            if isinstance(mod, Attention):
                mod.prefill_dense_max_entries = dense_max
        first = m.prefill(ids[:, :70], torch.tensor([70, 45]), all_logits=True)
        second = m.prefill(ids[:, 70:], torch.tensor([50, 30]), start=torch.tensor([70, 45]), all_logits=True)
        return first, second, {n: b.clone() for n, b in m.named_buffers()}

    ref1, ref2, ref_bufs = run(False)
    monkeypatch.setattr(attention, "PREFILL_SCORE_BYTES", 1)  # 64-row blocks on the op side
    got1, got2, got_bufs = run(True)
    v1 = torch.arange(70)[None, :] < torch.tensor([70, 45])[:, None]
    v2 = torch.arange(50)[None, :] < torch.tensor([50, 30])[:, None]
    torch.testing.assert_close(got1[v1], ref1[v1], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got2[v2], ref2[v2], atol=2e-5, rtol=2e-5)
    for n, b in ref_bufs.items():
        torch.testing.assert_close(got_bufs[n], b, atol=2e-5, rtol=2e-5, msg=n)


@pytest.mark.cuda
def test_cuda_prefill_attention_op_matches_the_torch_form(monkeypatch):
    """On the GPU (bf16, head_dim 128: the tensor-core kernel) each layer's prefill attends through
    dsv4::sparse_attn_decode and gives the torch form's output, from the same input and cache state, to bf16
    rounding (SWA, CSA with the indexer's top-k, HCA). Layer by layer: through a whole random model the last-bit
    differences flip near-tied indexer and router choices downstream (H100: logits 0.5 apart from 1-ulp layers)."""
    cfg = make_config("tiny", head_dim=128, rope_head_dim=64, index_head_dim=64)  # FP8 KV: nope a multiple of 64
    ids = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(1)).cuda()
    lengths = torch.tensor([150, 97], device="cuda")
    m = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=512, dtype=torch.bfloat16,
                                        device="cuda"), 0).eval()
    valid = torch.arange(150, device="cuda")[None, :] < lengths[:, None]
    plain_prefill, seen = Attention.prefill, []

    def both_paths(self, x, *args):
        saved = {n: b.clone() for n, b in self.named_buffers()}
        monkeypatch.setattr(Attention, "prefill_attn_op", lambda s, x: True)
        got = plain_prefill(self, x, *args)
        op_bufs = {n: b.clone() for n, b in self.named_buffers()}
        for n, b in self.named_buffers():
            b.copy_(saved[n])
        monkeypatch.setattr(Attention, "prefill_attn_op", lambda s, x: False)
        want = plain_prefill(self, x, *args)
        torch.testing.assert_close(got[valid], want[valid], atol=0.02, rtol=0.02)
        for n, b in self.named_buffers():  # the caches: the same writes on both paths
            assert torch.equal(op_bufs[n], b), n
        seen.append(self.ratio)
        return want

    with torch.no_grad():
        assert all(a.prefill_attn_op(ids) for a in m.modules() if isinstance(a, Attention))
        monkeypatch.setattr(Attention, "prefill", both_paths)
        m.prefill(ids, lengths)
    assert {0, 4, 16} <= set(seen), seen  # every kind of layer was compared

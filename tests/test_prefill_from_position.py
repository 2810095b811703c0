"""Prefill from any position (Transformer.prefill(start=)) and the engine's chunked prefill: a prompt prefilled in
chunks, or continued by prefill after decode steps, gives the logits of one prefill of the whole prompt and
leaves caches from which decode (and the MTP block) continue as after it. The reference is the whole-prompt
prefill, itself checked against HF transformers (test_model_hf_parity.py)."""
import pytest
import torch

import dsv4_ops  # noqa: F401  (the op library: the model's fused ops)
from dsv4_model.checkpoint.writer import make_config
from dsv4_model.model import mtp
from dsv4_model.model.attention import Attention
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from dsv4_model.runtime.engine import Engine

CFG = make_config("tiny")  # SWA, CSA (ratio 4, indexer) and HCA (ratio 16) layers, window 16, an MTP block
# fp32, no simulated rounding: a chunk sums its keys in another order, and with FP8 / FP4 rounding an ulp can
# move a value across a rounding boundary (the simulate_quant case below has its own tolerance)
TOL = dict(atol=2e-5, rtol=2e-5)


def _model(spare: int = 0, simulate_quant: bool = False, batch: int = 2, gather: bool = False) -> Transformer:
    m = init_random_weights(Transformer(CFG, max_batch_size=batch, max_seq_len=256, dtype=torch.float32,
                                        simulate_quant=simulate_quant, spare_window_slots=spare), 0).eval()
    if gather:  # CSA attention on each query's gathered top-k entries (long prompts) instead of a dense mask
        for a in m.modules():
            if isinstance(a, Attention):
                a.prefill_dense_max_entries = 0
    return m


def _prompt(B=2, S=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (B, S), generator=g)


def _decode(m: Transformer, tok: torch.Tensor, pos: torch.Tensor, steps: int) -> list[torch.Tensor]:
    out = []
    for k in range(steps):
        out.append(m.decode_step(tok[:, k], pos + k))
    return out


@pytest.mark.parametrize("spare,gather", [(0, False), (3, False), (0, True)])
@pytest.mark.parametrize("bounds", [(0, 7, 40, 41, 77, 100), (0, 16, 32, 48, 64, 80, 96, 100), (0, 99, 100)])
def test_chunks_give_the_whole_prompt_and_its_caches(spare, gather, bounds):
    """Chunk edges off and on the compress ratios and the window, a one-token chunk, a row (67 tokens) that ends
    mid-batch and rides along with length 0; then 20 decode steps (past entry and window boundaries)."""
    ids, lengths = _prompt(), torch.tensor([100, 67])
    whole, chunked = _model(spare, gather=gather), _model(spare, gather=gather)
    ref = whole.prefill(ids, lengths, all_logits=True)
    got = torch.cat([chunked.prefill(ids[:, s:e], (lengths - s).clamp(0, e - s), all_logits=True, start=s)
                     for s, e in zip(bounds, bounds[1:])], dim=1)
    valid = torch.arange(ids.shape[1])[None] < lengths[:, None]
    torch.testing.assert_close(got[valid], ref[valid], **TOL)
    nxt = _prompt(2, 20, seed=1)
    for a, b in zip(_decode(whole, nxt, lengths, 20), _decode(chunked, nxt, lengths, 20)):
        torch.testing.assert_close(b, a, **TOL)


@pytest.mark.parametrize("spare", [0, 2])
def test_prefill_continues_after_decode_steps(spare):
    """Prefill 30 tokens, decode 9 (the compressor states shifted by decode, the ring written by it), prefill
    the rest from position 39: the logits of the whole prompt at positions 39.., then decode as after it."""
    ids = _prompt(2, 90)
    whole, mixed = _model(spare), _model(spare)
    ref = whole.prefill(ids, all_logits=True)
    mixed.prefill(ids[:, :30])
    steps = _decode(mixed, ids[:, 30:], torch.full((2,), 30), 9)
    for k, lg in enumerate(steps):
        torch.testing.assert_close(lg, ref[:, 30 + k], **TOL)
    got = mixed.prefill(ids[:, 39:], all_logits=True, start=39)
    torch.testing.assert_close(got, ref[:, 39:], **TOL)
    nxt = _prompt(2, 12, seed=2)
    for a, b in zip(_decode(whole, nxt, torch.full((2,), 90), 12), _decode(mixed, nxt, torch.full((2,), 90), 12)):
        torch.testing.assert_close(b, a, **TOL)


def test_chunks_with_the_simulated_fp8_and_fp4():
    ids, lengths = _prompt(), torch.tensor([100, 58])
    whole, chunked = _model(simulate_quant=True), _model(simulate_quant=True)
    ref = whole.prefill(ids, lengths)
    for s in range(0, 100, 24):
        got = chunked.prefill(ids[:, s:s + 24], (lengths - s).clamp(0, 24), start=s)
    # the last chunk holds row 0's last token (row 1's was in the third)
    torch.testing.assert_close(got[0], ref[0], atol=2e-3, rtol=2e-3)
    nxt = _prompt(2, 8, seed=3)
    for a, b in zip(_decode(whole, nxt, lengths, 8), _decode(chunked, nxt, lengths, 8)):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3)


def _engine(chunk: int, spare: int = 0) -> Engine:
    return Engine(_model(spare, batch=3), prefill_chunk=chunk)


@pytest.mark.parametrize("chunk", [10, 33])
def test_engine_prefills_a_long_prompt_in_chunks(chunk):
    ids, lengths = _prompt(3, 70, seed=4), torch.tensor([70, 9, 41])
    ref, eng = _engine(8192), _engine(chunk)
    torch.testing.assert_close(eng.prefill(ids, lengths), ref.prefill(ids, lengths), **TOL)
    nxt = _prompt(3, 5, seed=5)
    for k in range(5):
        torch.testing.assert_close(eng.decode(nxt[:, k]), ref.decode(nxt[:, k]), **TOL)
    prompts = [[5, 9, 3] * 20, [7, 1], [2] * 45]
    assert eng.generate(prompts, max_new_tokens=6).token_ids == ref.generate(prompts, max_new_tokens=6).token_ids


def test_engine_chunks_fill_the_mtp_block_as_one_prefill():
    """speculate: the MTP block's cache over the prompt (its position t reads token t + 1, across chunk edges);
    the MTP block's logits at each row's last position read that cache."""
    ids, lengths = _prompt(3, 60, seed=6), torch.tensor([60, 23, 1])
    ref, eng = _engine(8192, spare=2), _engine(16, spare=2)
    (la, ha), (lb, hb) = [e._prefill_logits(ids, lengths, speculate=True) for e in (ref, eng)]
    torch.testing.assert_close(lb, la, **TOL)
    torch.testing.assert_close(hb, ha, **TOL)
    nxt = _prompt(3, 1, seed=7)
    pos = lengths - 1  # the MTP block's next position: the row's last token, with the token sampled after it
    a, _ = mtp.decode_tokens(ref.model, ha.unsqueeze(1), nxt, pos)
    b, _ = mtp.decode_tokens(eng.model, hb.unsqueeze(1), nxt, pos)
    torch.testing.assert_close(b, a, **TOL)


def test_bad_starts_raise():
    m = _model()
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        m.prefill(_prompt(1, 4), start=-1)
    with pytest.raises(ValueError, match="from position 250 exceeds"):
        m.prefill(_prompt(1, 10), start=250)
    with pytest.raises(ValueError, match="span must be an int >= start"):
        m.prefill(_prompt(1, 10), start=5, span=12)
    with pytest.raises(ValueError, match=r"int64 \[1\]"):
        m.prefill(_prompt(1, 10), start=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        Engine(m, prefill_chunk=0)


@pytest.mark.parametrize("span", [None, 80])
def test_rows_continue_from_their_own_positions(span):
    """start as a tensor: row 0 continues at 30, row 1 at 50 (a ragged first prefill), each as its own whole
    prompt gives; span: every row's start + S at most (default max_seq_len: the same shapes for any start)."""
    ids = _prompt(2, 80)
    whole, chunked = _model(), _model()
    ref = whole.prefill(ids, all_logits=True)
    chunked.prefill(ids, torch.tensor([30, 50]))
    nxt = torch.stack([ids[0, 30:60], ids[1, 50:80]])
    got = chunked.prefill(nxt, torch.tensor([30, 30]), all_logits=True, start=torch.tensor([30, 50]), span=span)
    torch.testing.assert_close(got[0], ref[0, 30:60], **TOL)
    torch.testing.assert_close(got[1], ref[1, 50:80], **TOL)


def test_a_compiled_chunk_takes_any_start_without_recompiling():
    """One graph (fullgraph, static shapes) per (B, S, span): chunks at other starts replay it."""
    import torch._dynamo

    ids = _prompt(2, 96)
    whole, chunked = _model(), _model()
    ref = whole.prefill(ids, all_logits=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda t, s: chunked.prefill(t, all_logits=True, static_moe=True, start=s, span=96),
                         backend=backend, fullgraph=True, dynamic=False)
    outs = [step(ids[:, s:s + 32], torch.full((2,), s)) for s in (0, 32, 64)]
    torch._dynamo.reset()
    assert len(graphs) == 1
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, **TOL)


def test_stale_caches_never_reach_a_prefill():
    """Whatever the caches hold (NaN here) where no valid position was written, a prefill from 0 or from a
    later start gives the fresh model's logits: masked keys are zeros, not 0 * NaN; a row starting at 0 with no
    tokens starts its compressor states afresh; a row with no tokens may sit past max_seq_len."""
    from dsv4_model.model.compressor import Compressor

    ids = _prompt(2, 60)
    fresh, stale = _model(), _model()
    ref = fresh.prefill(ids, all_logits=True)
    for name, buf in stale.named_buffers():
        if name.endswith(("kv_cache", "kv_state", "score_state")):
            buf.fill_(float("nan"))
    torch.testing.assert_close(stale.prefill(ids[:, :25], all_logits=True, span=60), ref[:, :25], **TOL)
    torch.testing.assert_close(stale.prefill(ids[:, 25:], all_logits=True, start=25), ref[:, 25:], **TOL)
    for c in (m for m in stale.modules() if isinstance(m, Compressor)):
        c.kv_state.fill_(float("nan"))
    stale.prefill(ids[:, :8], torch.tensor([8, 0]))
    for c in (m for m in stale.modules() if isinstance(m, Compressor)):
        assert not c.kv_state[1].isnan().any() and not c.score_state[1].isnan().any()
    stale.prefill(ids[:, 8:28], torch.tensor([20, 0]), start=torch.tensor([8, 250]))  # row 1: idle, past the end
    fresh.prefill(ids[:, :28])
    pos = torch.full((2,), 28)
    torch.testing.assert_close(stale.decode_step(ids[:, 28], pos)[0], fresh.decode_step(ids[:, 28], pos)[0], **TOL)


def test_a_padded_chunk_may_run_past_max_seq_len():
    """Fixed-size chunks at tensor starts (what an exported or compiled chunk graph runs): the last one padded
    past max_seq_len (256; positions 240..287, windows past the last entry) writes nothing beyond its tokens;
    row 0 fills the cache, its last entry closing inside that chunk (the query at 255 reads it)."""
    ids, lengths = _prompt(2, 256, seed=8), torch.tensor([256, 203])
    whole, chunked = _model(), _model()
    ref = whole.prefill(ids, lengths, all_logits=True)
    outs = []
    for s in range(0, 256, 48):
        part = torch.zeros(2, 48, dtype=torch.long)
        part[:, :min(48, 256 - s)] = ids[:, s:s + 48]
        outs.append(chunked.prefill(part, (lengths - s).clamp(0, 48), all_logits=True, start=torch.full((2,), s),
                                    span=256)[:, :min(48, 256 - s)])
    valid = torch.arange(256)[None] < lengths[:, None]
    torch.testing.assert_close(torch.cat(outs, dim=1)[valid], ref[valid], **TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("nvfp4", [False, True])
def test_chunks_on_cuda(nvfp4):
    """The CUDA kernels (fp32 projections, NVFP4 W4A16 linears / MoE) under chunked prefill at per-row starts,
    the last chunk padded: the whole prompt's logits, then decode steps as after it. Tolerances: fp32 sums in
    another order (fp32 model), and W4A16's bf16 activations one ulp apart (as tests/test_export.py's)."""
    from dsv4_model.quant.quantize_model import quantize_model_

    def build():
        m = init_random_weights(Transformer(CFG, max_batch_size=2, max_seq_len=256, dtype=torch.float32, device="cuda",
                                            simulate_quant=False), 0).eval()
        return quantize_model_(m) if nvfp4 else m

    tol = dict(atol=2e-2, rtol=2e-2) if nvfp4 else dict(atol=1e-4, rtol=1e-4)
    ids, lengths = _prompt(2, 100).cuda(), torch.tensor([100, 61], device="cuda")
    whole, chunked = build(), build()
    ref = whole.prefill(ids, lengths, all_logits=True, static_moe=True)
    outs = []
    for s in range(0, 100, 32):
        part = torch.zeros(2, 32, dtype=torch.long, device="cuda")
        part[:, :min(32, 100 - s)] = ids[:, s:s + 32]
        got = chunked.prefill(part, (lengths - s).clamp(0, 32), all_logits=True, static_moe=True,
                              start=torch.full((2,), s, device="cuda"), span=128)
        outs.append(got[:, :min(32, 100 - s)])
    valid = torch.arange(100, device="cuda")[None] < lengths[:, None]
    torch.testing.assert_close(torch.cat(outs, dim=1)[valid], ref[valid], **tol)
    nxt = _prompt(2, 6, seed=10).cuda()
    for a, b in zip(_decode(whole, nxt, lengths, 6), _decode(chunked, nxt, lengths, 6)):
        torch.testing.assert_close(b, a, **tol)

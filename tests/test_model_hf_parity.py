"""Parity of dsv4_model (simulate_quant=False, fp32, CPU) with transformers 5.23 DeepseekV4ForCausalLM.

Tiny config: window 8, CSA m=4 (with indexer, top-4), HCA m=8, SWA-only layer, hash-routed + learned MoE, so
short sequences cross many window / compression boundaries. HF reference = one full-sequence forward."""

import pytest
import torch

pytest.importorskip("transformers")

from dsv4_model.runtime.engine import Engine  # noqa: E402

from hf_utils import build_pair, hf_logits, one_thread, tiny_config  # noqa: E402,F401

TOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_config(max_position_embeddings=1 << 20)
    hf, ours = build_pair(cfg, max_batch_size=3, max_seq_len=256, seed=0, prefill_attn_rows=16)
    return cfg, hf, ours


def _ids(cfg, n, seed):
    return torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def test_prefill_all_positions_match_hf(pair):
    cfg, hf, ours = pair
    ids = _ids(cfg, 45, seed=1)
    ref = hf_logits(hf, ids)
    out = Engine(ours).prefill(ids, all_logits=True)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max().item() <= TOL
    # the comparison is meaningful: logits are O(1) and differ between positions
    assert ref.abs().max() > 0.5 and (ref[0, 1:] - ref[0, :-1]).abs().max() > 0.1
    # CSA prefill with per-query gathered top-k entries instead of a dense mask
    attns = [layer.attn for layer in ours.layers]
    for a in attns:
        a.prefill_dense_max_entries = 0
    try:
        out = Engine(ours).prefill(ids, all_logits=True)
    finally:
        for a in attns:
            a.prefill_dense_max_entries = 2048
    assert (out - ref).abs().max().item() <= TOL


def test_decode_200_steps_match_hf(pair):
    cfg, hf, ours = pair
    P, N = 13, 203
    ids = _ids(cfg, P + N, seed=2)
    ref = hf_logits(hf, ids)[0]
    eng = Engine(ours)
    last = eng.prefill(ids[:, :P])
    assert (last[0] - ref[P - 1]).abs().max().item() <= TOL
    worst = 0.0
    for t in range(P, P + N - 1):
        out = eng.decode(ids[:, t])
        worst = max(worst, (out[0] - ref[t]).abs().max().item())
    assert eng.lengths == [P + N - 1]
    assert worst <= TOL, worst


def test_ragged_batch_matches_hf_per_row(pair):
    cfg, hf, ours = pair
    eng = Engine(ours)
    # two rounds on the same caches: the second (smaller batch, other lengths) must not see stale state
    for round_, (lens, steps) in enumerate([([5, 22, 13], 30), ([17, 3], 25)]):
        B = len(lens)
        seqs = [_ids(cfg, L + steps, seed=10 * round_ + b)[0] for b, L in enumerate(lens)]
        refs = [hf_logits(hf, s[None])[0] for s in seqs]
        S = max(lens)
        prompts = torch.full((B, S), -1, dtype=torch.long)
        for b, L in enumerate(lens):
            prompts[b, :L] = seqs[b][:L]
        last = eng.prefill(prompts, lengths=torch.tensor(lens))
        for b, L in enumerate(lens):
            assert (last[b] - refs[b][L - 1]).abs().max().item() <= TOL
        for i in range(steps - 1):
            nxt = torch.stack([seqs[b][L + i] for b, L in enumerate(lens)])
            out = eng.decode(nxt)
            for b, L in enumerate(lens):
                assert (out[b] - refs[b][L + i]).abs().max().item() <= TOL, (round_, b, i)
        assert eng.lengths == [L + steps - 1 for L in lens]

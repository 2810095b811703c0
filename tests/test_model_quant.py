"""simulate_quant=True rounds cached KV exactly as dsv4_model.model.quant_sim says (official QAT numerics)."""

import pytest
import torch

from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights
from dsv4_model.model.quant_sim import fp4_e2m1_block_fake_quant, indexer_fake_quant, kv_fake_quant

from hf_utils import one_thread, tiny_config  # noqa: F401


def _run(cfg, simulate_quant, ids, P):
    m = Transformer(cfg, max_batch_size=1, max_seq_len=64, dtype=torch.float32, simulate_quant=simulate_quant)
    init_random_weights(m, 3)
    m.prefill(ids[:, :P])
    for t in range(P, ids.shape[1]):
        m.decode_step(ids[:, t], torch.tensor([t]))
    return m


@pytest.mark.parametrize("ratio", [0, 4, 8])
def test_first_layer_kv_is_fake_quant_of_unquantised_kv(ratio):
    # layer 0 sees identical inputs with and without simulation, so its caches must differ by exactly the rounding
    cfg = tiny_config(n_layers=1, compress_ratios=[ratio, 0], n_hash_layers=1)
    ids = torch.randint(0, cfg.vocab_size, (1, 27), generator=torch.Generator().manual_seed(5))
    P, L, W, rd = 19, 27, cfg.window_size, cfg.rope_head_dim
    q = _run(cfg, True, ids, P).layers[0].attn
    f = _run(cfg, False, ids, P).layers[0].attn
    ring_q, ring_f = q.kv_cache[0, :W], f.kv_cache[0, :W]
    assert torch.equal(ring_q, kv_fake_quant(ring_f, rd))
    assert torch.equal(ring_q[:, -rd:], ring_f[:, -rd:])  # RoPE dims untouched
    assert not torch.equal(ring_q, ring_f)
    if ratio:
        n = L // ratio
        comp_q, comp_f = q.kv_cache[0, W: W + n], f.kv_cache[0, W: W + n]
        assert torch.equal(comp_q, kv_fake_quant(comp_f, rd))
        assert not torch.equal(comp_q, comp_f)
    if ratio == 4:
        n = L // 4
        ik_q, ik_f = q.indexer.kv_cache[0, :n], f.indexer.kv_cache[0, :n]
        assert torch.equal(ik_q, indexer_fake_quant(ik_f))


def test_all_layers_cache_values_are_representable():
    cfg = tiny_config()
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(6))
    m = _run(cfg, True, ids, 21)
    W, rd, L = cfg.window_size, cfg.rope_head_dim, 30
    for layer in m.layers:
        a = layer.attn
        kv = a.kv_cache[0, : W + (L // a.ratio if a.ratio else 0)]
        assert torch.equal(kv_fake_quant(kv, rd), kv)  # rounding is idempotent on representable values
        if a.indexer is not None:
            ik = a.indexer.kv_cache[0, : L // 4]
            assert torch.equal(fp4_e2m1_block_fake_quant(ik), ik)

"""MoE routing semantics and the two expert paths; indexer top-k tie order."""

import torch
import torch.nn.functional as F

from dsv4_model.model.indexer import topk_indices
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

from hf_utils import one_thread, tiny_config  # noqa: F401


def _moe(layer):
    cfg = tiny_config(n_layers=3, compress_ratios=[0, 0, 0, 0], n_hash_layers=2)
    m = Transformer(cfg, max_batch_size=1, max_seq_len=16, dtype=torch.float32, simulate_quant=False)
    init_random_weights(m, 0)
    return cfg, m.layers[layer].ffn


def _expert(x, w1, w2, w3, limit):
    g = (x @ w1.T).clamp(max=limit)
    u = (x @ w3.T).clamp(-limit, limit)
    return (F.silu(g) * u) @ w2.T


def test_hash_routing_repeated_expert_counts_once():
    cfg, moe = _moe(0)
    moe.gate.tid2eid[7] = torch.tensor([2, 2, 5])
    moe.gate.tid2eid[3] = torch.tensor([1, 6, 4])
    x = torch.randn(3, cfg.dim, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([7, 7, 3])
    E = moe.experts
    want = []
    for n in range(3):
        scores = F.softplus(x[n] @ moe.gate.weight.T).sqrt()
        idx = moe.gate.tid2eid[ids[n]].tolist()
        w = scores[idx] / scores[idx].sum() * cfg.route_scale  # duplicates stay in the denominator
        y = sum(w[k] * _expert(x[n], E.w1[e], E.w2[e], E.w3[e], cfg.swiglu_limit)
                for k, e in enumerate(idx) if e not in idx[:k])
        sh = moe.shared_experts
        want.append(y + _expert(x[n], sh.w1.weight, sh.w2.weight, sh.w3.weight, cfg.swiglu_limit))
    want = torch.stack(want)
    for static in (False, True):
        got = moe(x, ids, static=static)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), static
    # the duplicate matters: counting expert 2 twice would give a different result
    e2 = _expert(x[0], E.w1[2], E.w2[2], E.w3[2], cfg.swiglu_limit)
    assert (e2.abs() > 1e-3).any()


def test_learned_router_loop_equals_gather():
    cfg, moe = _moe(2)
    assert moe.gate.bias is not None
    x = torch.randn(11, cfg.dim, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, cfg.vocab_size, (11,))
    a, b = moe(x, ids, static=False), moe(x, ids, static=True)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    # bias steers selection only: a huge bias on expert 0 forces it into every row
    moe.gate.bias.zero_()
    moe.gate.bias[0] = 100.0
    w, idx = moe.gate(x, ids)
    assert (idx == 0).any(dim=-1).all()
    assert torch.allclose(w.sum(-1), torch.full((11,), cfg.route_scale))


def test_topk_indices_ties_prefer_lower_index():
    s = torch.tensor([[0.5, 1.0, 0.5, -0.0, 1.0, 0.0, float("-inf"), 0.5]])
    assert topk_indices(s, 2).tolist() == [[1, 4]]
    assert topk_indices(s, 4).tolist() == [[1, 4, 0, 2]]
    # -0.0 and +0.0 tie -> lower index first
    assert topk_indices(s, 7).tolist() == [[1, 4, 0, 2, 7, 3, 5]]
    z = torch.tensor([[0.0, -0.0, -1.0, -0.0]])
    assert topk_indices(z, 3).tolist() == [[0, 1, 3]]


def test_learned_routing_selects_distinct_experts():
    """A learned (top-k) layer's selection never repeats an expert, so MoE.forward skips the dedup step there
    (hash layers keep it): the router op and the topk fallback, ties included."""
    from dsv4_model.model.moe import dedup_weights

    cfg, moe = _moe(2)
    assert not moe.gate.hash
    x = torch.randn(16, cfg.dim, generator=torch.Generator().manual_seed(2))
    x[8:] = x[0]  # equal rows
    moe.gate.bias.zero_()
    weights, indices = moe.gate(x, torch.zeros(16, dtype=torch.long))
    assert all(len(set(row.tolist())) == indices.shape[1] for row in indices)
    assert torch.equal(dedup_weights(weights, indices), weights)
    with torch.enable_grad():  # the tensor-op fallback (topk)
        moe.gate.weight.requires_grad_(True)
        w2, i2 = moe.gate(x, torch.zeros(16, dtype=torch.long))
        moe.gate.weight.requires_grad_(False)
    assert all(len(set(row.tolist())) == i2.shape[1] for row in i2)


def test_tokens_not_routed_read_no_expert_and_keep_the_others_exact(monkeypatch):
    """MoE.forward(routed=mask) (a speculative step's positions past its cut): the routed tokens' outputs are
    bit for bit the unmasked ones, the others get the shared expert alone; NVFP4 (hash and learned layers) hands
    the expert kernels id -1 for them (which they skip: no weight read), float experts weight 0."""
    from dsv4_ops import ops
    from dsv4_model.quant.quantize_model import quantize_model_

    cfg = tiny_config(n_layers=3, compress_ratios=[0, 0, 0, 0], n_hash_layers=2)
    m = Transformer(cfg, max_batch_size=1, max_seq_len=16, dtype=torch.float32, simulate_quant=False)
    init_random_weights(m, 0)
    x = torch.randn(6, cfg.dim, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([7, 3, 9, 7, 1, 4])
    mask = torch.tensor([True, True, False, True, False, False])
    none = torch.zeros(6, dtype=torch.bool)
    for layer in (0, 2):  # hash routing, learned routing
        moe = m.layers[layer].ffn
        full, cut, shared = (moe(x, ids, static=True, routed=r) for r in (None, mask, none))
        assert torch.equal(cut[mask], full[mask]) and torch.equal(cut[~mask], shared[~mask])
        assert not torch.equal(cut[~mask], full[~mask])
    quantize_model_(m)
    seen = []
    real = ops.nvfp4_moe

    def spy(x, topk_ids, topk_weights, **kw):
        seen.append(topk_ids.clone())
        return real(x, topk_ids, topk_weights, **kw)

    monkeypatch.setattr(ops, "nvfp4_moe", spy)
    for layer in (0, 2):
        moe = m.layers[layer].ffn
        full, cut = moe(x, ids, static=True), moe(x, ids, static=True, routed=mask)
        assert torch.equal(cut[mask], full[mask])
        got = seen[-1]
        assert (got[~mask] == -1).all() and (got[mask] >= 0).all()

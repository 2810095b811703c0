"""dsv4_ops.limits: the values Python reads from the op library are the ones the kernels' own checks enforce
(each op accepts the limit and refuses one past it, naming the argument), and the model's gates follow them."""
import pytest
import torch

from dsv4_ops import ops
from dsv4_ops.limits import LIMITS


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_router_limits_are_the_kernels(device):
    e, k = LIMITS.router_max_experts, LIMITS.router_max_topk
    scores = torch.rand(2, e, device=device)
    w, i = ops.router_topk(scores, bias=None, k=k, renormalize=True, scale=1.0)
    assert i.shape == (2, k)
    assert torch.equal(i.sort(-1).values, scores.topk(k, dim=-1).indices.sort(-1).values)
    with pytest.raises(RuntimeError, match="E must be in"):
        ops.router_topk(torch.rand(2, e + 1, device=device), bias=None, k=k, renormalize=True, scale=1.0)
    with pytest.raises(RuntimeError, match="k must be in"):
        ops.router_topk(scores, bias=None, k=k + 1, renormalize=True, scale=1.0)


def test_the_gate_takes_the_router_kernel_exactly_within_the_limits(monkeypatch):
    from types import SimpleNamespace

    from dsv4_model.model.moe import Gate

    calls = []
    real = ops.router_topk
    monkeypatch.setattr(ops, "router_topk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for experts, used in ((LIMITS.router_max_experts, True), (LIMITS.router_max_experts + 1, False)):
        cfg = SimpleNamespace(n_activated_experts=LIMITS.router_max_topk, score_func="sqrtsoftplus", route_scale=1.0,
                              n_hash_layers=0, n_routed_experts=experts, dim=32, vocab_size=8)
        gate = Gate(cfg, 1, torch.float32)
        torch.nn.init.normal_(gate.weight)
        torch.nn.init.zeros_(gate.bias)
        calls.clear()
        weights, indices = gate(torch.randn(3, 32), torch.zeros(3, dtype=torch.long))
        assert bool(calls) == used, experts
        assert indices.shape == (3, LIMITS.router_max_topk)
        assert torch.allclose(weights.sum(-1), torch.ones(3))


@pytest.mark.cuda
def test_cuda_kernels_take_their_listed_widths_and_refuse_others():
    for d in LIMITS.hadamard_fp4_dims:  # x [rows, heads, d]
        x = torch.randn(4, 1, d, device="cuda", dtype=torch.bfloat16)
        assert ops.hadamard_fp4(x, cs=None, rope_dim=0).shape == x.shape
    off = max(LIMITS.hadamard_fp4_dims) * 2
    with pytest.raises(RuntimeError, match=f"got {off}"):
        ops.hadamard_fp4(torch.randn(4, 1, off, device="cuda", dtype=torch.bfloat16), cs=None, rope_dim=0)
    dmax = LIMITS.norm_rope_cuda_max_dim
    for d, ok in ((dmax, True), (dmax + 4, False)):
        x = torch.randn(2, 1, d, device="cuda")
        cs = torch.zeros(2, 0, 2, device="cuda")
        if ok:
            assert ops.rms_norm_rope(x, weight=None, cs=cs, eps=1e-6, rope_dim=0, fp8_nope=False).shape == x.shape
        else:
            with pytest.raises(RuntimeError, match=f"d <= {dmax}"):
                ops.rms_norm_rope(x, weight=None, cs=cs, eps=1e-6, rope_dim=0, fp8_nope=False)


def test_supports_answers_from_the_limits():
    """dsv4_ops.supports (the gates the model asks) takes each limit and refuses one past it."""
    from dsv4_ops import supports

    f32 = torch.float32
    dmax = LIMITS.norm_rope_cuda_max_dim
    assert supports.rms_norm_rope(f32, dmax, 0) and not supports.rms_norm_rope(f32, dmax + 4, 0)
    assert not supports.rms_norm_rope(torch.float16, 64, 0) and not supports.rms_norm_rope(f32, 64, 2)
    for gate, dims in ((supports.hadamard_fp4, LIMITS.hadamard_fp4_dims),
                       (supports.indexer_store_keys, LIMITS.store_keys_dims)):
        assert all(gate(f32, d) for d in dims) and not gate(f32, max(dims) * 2) and not gate(torch.half, dims[0])
    e, k = LIMITS.router_max_experts, LIMITS.router_max_topk
    assert supports.router_topk(torch.empty(3, e), k)
    assert not supports.router_topk(torch.empty(3, e), k + 1) and not supports.router_topk(torch.empty(3, e + 1), k)
    assert not supports.router_topk(torch.empty(3, e, requires_grad=True), k)  # the op has no backward
    D, H, K = LIMITS.indexer_cuda_head_dim, LIMITS.indexer_cuda_max_heads, LIMITS.indexer_cuda_max_topk
    cuda = torch.device("cuda")
    assert supports.indexer_score_topk(cuda, D, H, K)
    assert not any(supports.indexer_score_topk(cuda, *a) for a in ((D * 2, H, K), (D, H + 1, K), (D, H, K + 1)))
    assert supports.indexer_score_topk(torch.device("cpu"), D * 2, H + 1, K + 1)


def test_the_hc_gates_answer_as_the_mhc_ops_check():
    """supports.hc_pre / hc_post_pre say yes exactly where dsv4::hc_pre / hc_post_pre take the call (fn's dtype;
    the sublayer output in the streams' dtype)."""
    from dsv4_ops import supports

    hc, d, t = 4, 8, 3
    mix = (2 + hc) * hc
    x = torch.randn(t, hc, d)
    kw = dict(scale=torch.ones(3), base=torch.zeros(mix), norm_weight=torch.ones(d), iters=2, hc_eps=1e-6,
              norm_eps=1e-6, out_eps=1e-6)
    post, comb = torch.rand(t, hc), torch.rand(t, hc, hc)
    for fn_dtype in (torch.float32, torch.bfloat16, torch.float16):
        fn = torch.randn(mix, hc * d, dtype=fn_dtype) * 0.1
        for out_dtype in (torch.float32, torch.bfloat16):
            out = torch.randn(t, d, dtype=out_dtype)
            for op, ok, call in (
                    ("hc_pre", supports.hc_pre(fn), lambda: ops.hc_pre(x, fn=fn, **kw)),
                    ("hc_post_pre", supports.hc_post_pre(out.dtype, x.dtype, fn),
                     lambda: ops.hc_post_pre(out, x, post, comb, fn=fn, **kw))):
                if ok:
                    call()
                else:
                    with pytest.raises(RuntimeError, match="must"):
                        call()

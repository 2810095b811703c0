"""dsv4::router_topk (a decode step's MoE routing: top-k of score + bias, the unbiased scores renormalised and
scaled, one kernel) against the reference (dsv4_ops/reference/: a stable descending sort), opcheck,
torch.compile, and on CUDA a captured graph without host syncs. Indices must be equal (ties included: NaN first,
equal values to the lower index); the kernels add, divide and multiply in the reference's order, so weights
agree to a few ulps (torch may sum the k weights in another order). With sqrt_softplus (the op computes V4's
score function from the logits) the scores are torch's F.softplus(logits).sqrt() to an ulp (CPU: the C library's
log1p / exp vs torch's vectorised ones; CUDA: the same CUDA math functions as torch's kernel)."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def check(scores, bias, k, renorm, scale, device):
    w, i = ops.router_topk(scores.to(device), None if bias is None else bias.to(device), k, renorm, scale)
    rw, ri = ref.router_topk_ref(scores, bias, k, renorm, scale)
    assert i.dtype == torch.long and w.dtype == torch.float32 and i.shape == w.shape == (scores.shape[0], k)
    assert torch.equal(i.cpu(), ri)
    torch.testing.assert_close(w.cpu(), rw, rtol=4e-7, atol=0, equal_nan=True)
    return w, i


# V4-Flash (256 experts, top-6, sqrt-softplus scores + bias), V4-Pro (384), small and odd sizes
CASES = [(5, 256, 6, True), (3, 384, 6, True), (4, 16, 6, False), (2, 33, 1, True), (7, 1024, 16, True),
         (1, 8, 8, True), (0, 256, 6, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,E,k,renorm", CASES)
def test_matches_reference(device, n, E, k, renorm):
    gen = torch.Generator().manual_seed(E + k)
    scores = torch.nn.functional.softplus(torch.randn(n, E, generator=gen)).sqrt()
    bias = torch.randn(E, generator=gen) * 0.1
    check(scores, bias, k, renorm, 2.5, device)
    check(scores, None, k, renorm, 1.0, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,E,k", [(5, 256, 6), (3, 384, 6), (2, 33, 1), (0, 256, 6)])
def test_sqrt_softplus_matches_reference(device, n, E, k):
    gen = torch.Generator().manual_seed(E * 7 + k)
    logits = torch.randn(n, E, generator=gen) * 4
    if n:
        logits[0, :4] = torch.tensor([25.0, -30.0, 20.0, 19.99])  # both sides of softplus's threshold, exp underflow
    bias = torch.randn(E, generator=gen) * 0.1
    for b, scale in ((bias, 2.5), (None, 1.0)):
        w, i = ops.router_topk(logits.to(device), None if b is None else b.to(device), k, True, scale, True)
        rw, ri = ref.router_topk_ref(logits, b, k, True, scale, True)
        assert torch.equal(i.cpu(), ri)
        torch.testing.assert_close(w.cpu(), rw, rtol=1e-6, atol=0)
        # = the op on the scores torch computes (what the model did before the score function moved in)
        w2, i2 = ops.router_topk(torch.nn.functional.softplus(logits).sqrt().to(device),
                                 None if b is None else b.to(device), k, True, scale)
        assert torch.equal(i, i2)
        torch.testing.assert_close(w, w2, rtol=1e-6, atol=0)
    if n and device == "cuda":  # the CUDA kernel's scores are torch's CUDA softplus + sqrt bit for bit
        one = logits[:1, :8].to(device)
        w, _ = ops.router_topk(one, None, 8, False, 1.0, True)
        want = torch.nn.functional.softplus(one).sqrt().sort(descending=True, stable=True).values
        assert torch.equal(w, want)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_nan_signed_zero(device):
    scores = torch.tensor([[0.5, 0.25, 0.5, 0.5, 0.125, 0.25, 0.0, 0.75],
                           [float("nan"), 1.0, float("nan"), 2.0, 0.0, -0.0, -1.0, 3.0],
                           [0.0, -0.0, 0.0, -0.0, -1.0, float("-inf"), 0.5, float("inf")]])
    for k in (1, 3, 5, 8):
        check(scores, None, k, False, 1.0, device)
    w, i = ops.router_topk(scores.to(device), None, 4, False, 1.0)
    assert i[0].tolist() == [7, 0, 2, 3]  # equal scores: lower index first
    assert i[1].tolist() == [0, 2, 7, 3]  # NaN above every number
    assert i[2].tolist() == [7, 6, 0, 1]  # -0 == +0
    bias = torch.zeros(8)
    bias[4] = 10.0  # the bias selects, the unbiased score is the weight
    w, i = ops.router_topk(scores[:1].to(device), bias.to(device), 2, True, 1.0)
    assert i[0].tolist() == [4, 7]
    torch.testing.assert_close(w[0].cpu(), torch.tensor([0.125, 0.75]) / 0.875, rtol=0, atol=0)


def test_bad_arguments():
    s = torch.rand(2, 8)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.router_topk(s, None, 9, True, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.router_topk(s.double(), None, 2, True, 1.0)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[E = 8\]"):
        ops.router_topk(s, torch.zeros(7), 2, True, 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(4, 64, generator=gen).to(device)
    b = torch.randn(64, generator=gen).to(device)
    torch.library.opcheck(ops.router_topk.default, (s, b, 6, True, 2.5))
    torch.library.opcheck(ops.router_topk.default, (s, None, 3, False, 1.0))
    torch.library.opcheck(ops.router_topk.default, (s * 8 - 4, b, 6, True, 2.5, True))


def test_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(4)
    logits, bias = torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(logits, bias):
        w, i = ops.router_topk(torch.nn.functional.softplus(logits).sqrt(), bias, 6, True, 1.5)
        return w * 2, i

    w, i = f(logits, bias)
    rw, ri = ops.router_topk(torch.nn.functional.softplus(logits).sqrt(), bias, 6, True, 1.5)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw * 2, rtol=4e-7, atol=0)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(5)
    s, b = torch.rand(2, 256, generator=gen).cuda(), (torch.randn(256, generator=gen) * 0.1).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.router_topk(s, b, 6, True, 2.5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, i = ops.router_topk(s, b, 6, True, 2.5)
    s.copy_(torch.rand(2, 256, generator=gen).cuda())
    g.replay()
    torch.cuda.synchronize()
    rw, ri = ops.router_topk(s, b, 6, True, 2.5)
    assert torch.equal(i, ri) and torch.equal(w, rw)

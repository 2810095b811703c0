"""dsv4::hc_sinkhorn (the mHC mixing matrix of every token: row softmax, then Sinkhorn) against the pure-PyTorch
reference (dsv4_ops/reference/, the steps of dsv4_model.model.layers.hc_pre), opcheck, torch.compile, and on CUDA
a captured graph.

Tolerance: the kernels and the reference agree to a few fp32 ulps (exp implementations differ by <= 2 ulp; the
reference's softmax may sum in another order); a transposed normalisation, a dropped eps or a missing
iteration is off by orders of magnitude more (checked below)."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]
TOL = dict(rtol=2e-6, atol=2e-7)


def logits_case(shape, hc, gen):
    x = torch.randn(*shape, hc, hc, generator=gen) * 3
    if x.numel():
        x.view(-1)[0] = 40.0  # a near one-hot row
        x.view(-1)[-1] = -40.0
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hc,shape,iters", [(4, (3, 5), 20), (4, (1,), 1), (3, (7,), 5), (8, (2, 2), 20),
                                            (1, (4,), 3), (4, (0,), 20)])
def test_matches_reference(device, hc, shape, iters):
    gen = torch.Generator().manual_seed(hc * 10 + iters)
    x = logits_case(shape, hc, gen)
    want = ref.hc_sinkhorn_ref(x, iters, 1e-6)
    got = ops.hc_sinkhorn(x.to(device), iters, 1e-6).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL)
    if device == "cuda":  # the CUDA kernel vs the CPU kernel (same steps, same order; exp within 2 ulp)
        torch.testing.assert_close(got, ops.hc_sinkhorn(x, iters, 1e-6), **TOL)


def test_wrong_steps_are_far_from_the_reference():
    gen = torch.Generator().manual_seed(1)
    x = logits_case((16,), 4, gen)
    got = ops.hc_sinkhorn(x, 20, 1e-6)
    for wrong in (ref.hc_sinkhorn_ref(x.transpose(-1, -2), 20, 1e-6), ref.hc_sinkhorn_ref(x, 19, 1e-6),
                  ref.hc_sinkhorn_ref(x, 20, 1e-3)):
        assert float((got - wrong).abs().max()) > 100 * (TOL["atol"] + TOL["rtol"])
    # the result is (nearly) doubly stochastic: columns sum to 1 - O(eps) after the last column pass
    assert torch.allclose(got.sum(-2), torch.ones(16, 4), atol=1e-5)


def test_non_contiguous_input_and_bad_args():
    gen = torch.Generator().manual_seed(2)
    x = logits_case((6,), 4, gen)
    for view in (x.transpose(-1, -2), x[::2]):  # strided views
        torch.testing.assert_close(ops.hc_sinkhorn(view, 20, 1e-6), ref.hc_sinkhorn_ref(view, 20, 1e-6), **TOL)
    with pytest.raises(RuntimeError, match="float32"):
        ops.hc_sinkhorn(x.double(), 20, 1e-6)
    with pytest.raises(RuntimeError, match=r"\[\.\.\., hc, hc\]"):
        ops.hc_sinkhorn(x[..., :3], 20, 1e-6)
    with pytest.raises(RuntimeError, match="iters"):
        ops.hc_sinkhorn(x, 0, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    for shape, hc in (((2, 3), 4), ((5,), 3)):
        torch.library.opcheck(ops.hc_sinkhorn.default, (logits_case(shape, hc, gen).to(device), 20, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_without_graph_breaks(device):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(4)
    x = logits_case((2,), 4, gen).to(device)
    f = torch.compile(lambda t: ops.hc_sinkhorn(t * 2.0, 20, 1e-6) + 1.0, fullgraph=True)
    torch.testing.assert_close(f(x), ops.hc_sinkhorn(x * 2.0, 20, 1e-6) + 1.0, rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(5)
    x = logits_case((4,), 4, gen).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.hc_sinkhorn(x, 20, 1e-6)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.hc_sinkhorn(x, 20, 1e-6)
    x.copy_(logits_case((4,), 4, gen).cuda())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.hc_sinkhorn(x, 20, 1e-6))

"""dsv4::fp32_linear (the fp32 projections: compressor wkv / wgate, mHC mixes; several weights per call) against
the float64 reference (dsv4_ops/reference/), opcheck, torch.compile, and on CUDA every kernel variant (1 or 4
rows per CTA, accumulators for 1, 2, 4 or 8 token rows with M at and below each, bf16 / fp32 weights and x), the
matmul fallbacks (a large bf16 weight at 2+ rows included), a captured graph and no host sync.

Tolerance: the op sums fp32 products in fp32 in its own order; |out - ref64| <= 4e-6 * sum_k |x_k w_k| holds for
that with a wide margin (K <= 16384), while a wrong row, matrix, token or dropped piece of K is off by O(1)
relative to that sum (checked below)."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def check(got, x, weight):
    want = ref.fp32_linear_ref(x.cpu(), [w.cpu() for w in weight])
    assert len(got) == len(weight)
    for g, r, w in zip(got, want, weight):
        assert g.dtype == torch.float32 and g.shape == r.shape
        bound = (x.cpu().double().abs() @ w.cpu().double().abs().t()).float() * 4e-6 + 1e-30
        err = (g.cpu() - r).abs()
        assert bool((err <= bound).all()), f"max err / bound {float((err / bound).max()):.3g}"


def case(lead, K, ns, wdt, xdt, gen):
    x = torch.randn(*lead, K, generator=gen).to(xdt)
    ws = [torch.randn(n, K, generator=gen).mul(0.05).to(wdt) for n in ns]
    return x, ws


# (lead dims of x, K, N of each weight): V4-Flash compressor + indexer compressor (4 matrices), the mHC mixes
# (24 rows x 16384), rows that do not fill a CTA, several token rows (1, 2, 3-4 and 5-8 take different kernels;
# 2 and 4 are verification steps' rows), a prefill-sized x (the fallback).
SHAPES = [((1,), 4096, (1024, 1024, 256, 256)), ((1,), 16384, (24,)), ((3,), 512, (5, 130, 1)),
          ((2,), 4096, (1024, 1024, 256, 256)), ((2,), 16384, (24,)), ((4,), 4096, (1024, 256)),
          ((4,), 16384, (24,)), ((3,), 4096, (1024, 1024, 256, 256)), ((6,), 4096, (1024, 256)), ((6,), 512, (5, 130)),
          ((2, 4), 256, (64, 64)), ((8,), 1024, (1100,)), ((33,), 256, (40, 7))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,K,ns", SHAPES)
@pytest.mark.parametrize("wdt,xdt", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_matches_reference(device, lead, K, ns, wdt, xdt):
    gen = torch.Generator().manual_seed(K + sum(ns) + len(lead))
    x, ws = case(lead, K, ns, wdt, xdt, gen)
    got = ops.fp32_linear(x.to(device), [w.to(device) for w in ws])
    check(got, x, ws)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_weight_dtypes(device):
    # decode's one call: the compressors' projections (fp32, or bf16 once narrowed) + the indexer's weights_proj
    gen = torch.Generator().manual_seed(8)
    x, ws = case((1,), 512, (64, 64, 16, 16, 8), torch.float32, torch.bfloat16, gen)
    ws = [w.to(torch.bfloat16) if i % 2 else w for i, w in enumerate(ws)]
    check(ops.fp32_linear(x.to(device), [w.to(device) for w in ws]), x, ws)


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("m", [1, 3, 8])
def test_large_bf16_weight_every_row_count(m):
    # >= 2^26 bf16 weight elements with bf16 x (the head's case): the GEMV at one row, cuBLAS's bf16 GEMM with
    # fp32 output at 2..8 rows; both within the fp32-sum bound
    gen = torch.Generator().manual_seed(m)
    x, ws = case((m,), 4096, (16400,), torch.bfloat16, torch.bfloat16, gen)
    check(ops.fp32_linear(x.cuda(), [w.cuda() for w in ws]), x, ws)


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_math_is_outside_the_bound(device):
    gen = torch.Generator().manual_seed(3)
    x, ws = case((2,), 1024, (16, 16), torch.float32, torch.bfloat16, gen)
    got = ops.fp32_linear(x.to(device), [w.to(device) for w in ws])
    check(got, x, ws)
    bound = (x.double().abs() @ ws[0].double().abs().t()).float() * 4e-6
    for wrong in (ws[1], ws[0].roll(1, 0), ws[0].flip(1), ws[0] * (torch.arange(1024) < 1016)):
        err = (got[0].cpu() - ref.fp32_linear_ref(x, [wrong])[0]).abs()
        assert bool((err > bound).any())
    swapped = (got[0].cpu()[[1, 0]] - ref.fp32_linear_ref(x, ws)[0]).abs()
    assert bool((swapped > bound).any())


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_half_x_and_empty(device):
    gen = torch.Generator().manual_seed(4)
    x, ws = case((4,), 256, (32,), torch.bfloat16, torch.float32, gen)
    xv, wv = x.to(device)[::2, :128], ws[0].to(device)[:, :128]  # strided x rows, a non-contiguous weight
    check(ops.fp32_linear(xv, [wv]), xv, [wv])
    xh = x.to(device).half()
    check(ops.fp32_linear(xh, [ws[0].to(device)]), xh, ws)
    out = ops.fp32_linear(x.to(device)[:0], [ws[0].to(device)])
    assert out[0].shape == (0, 32)


def test_bad_arguments():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"weight\[1\] must be \[N, K = 64\]"):
        ops.fp32_linear(x, [torch.randn(3, 64), torch.randn(3, 32)])
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.fp32_linear(x, [torch.randn(3, 64, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match="1 to 8"):
        ops.fp32_linear(x, [])
    with pytest.raises(RuntimeError, match="x must be"):
        ops.fp32_linear(x.long(), [torch.randn(3, 64)])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(5)
    for lead, K, ns in (((1,), 256, (16, 8)), ((3,), 64, (5,)), ((12,), 64, (4, 4))):
        x, ws = case(lead, K, ns, torch.float32, torch.bfloat16, gen)
        torch.library.opcheck(ops.fp32_linear.default, (x.to(device), [w.to(device) for w in ws]))


def test_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(6)
    x, ws = case((2,), 128, (16, 8), torch.float32, torch.bfloat16, gen)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(x, a, b):
        ya, yb = ops.fp32_linear(x * 2, [a, b])
        return ya + 1.0, yb

    got = f(x, *ws)
    want = ops.fp32_linear(x * 2, ws)
    torch.testing.assert_close(got[0], want[0] + 1.0, rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_deterministic_and_no_sync():
    gen = torch.Generator().manual_seed(7)
    x, ws = case((1,), 4096, (1024, 1024, 256, 256), torch.float32, torch.bfloat16, gen)
    x, ws = x.cuda(), [w.cuda() for w in ws]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = ops.fp32_linear(x, ws)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b) for a, b in zip(first, ops.fp32_linear(x, ws)))  # same order every run
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.fp32_linear(x, ws)
    x.copy_(torch.randn(1, 4096, generator=gen).to(torch.bfloat16).cuda())
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, ops.fp32_linear(x, ws)))

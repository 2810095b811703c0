"""dsv4::hc_pre (a token's hc residual streams -> the sublayer input, its RMSNorm, and the mHC post / comb weights,
in one op) against the pure-PyTorch reference (dsv4_ops/reference.py: the steps of dsv4_model.layers.hc_pre and
RMSNorm), opcheck, torch.compile, and on CUDA the split-K + finish kernels (V4 widths, one and several tokens,
fp32 / bf16 fn), a captured graph and no host sync.

Tolerance: the mixes are 24 dot products of length hc * d summed in another order than the reference's matmul
(fp32 rounding, then amplified a little by the sigmoid and 20 Sinkhorn iterations: post / comb to 1e-4 relative);
y is the same fp32 value rounded once to x's dtype (one ulp where two fp32 values straddle a rounding boundary)."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from decode_switch import decode_with_switch

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]
ITERS, HC_EPS, NORM_EPS, OUT_EPS = 20, 1e-6, 1e-6, 1e-6


def case(lead, hc, d, dtype, fn_dtype, gen, norm=True):
    x = (torch.randn(*lead, hc, d, generator=gen) * 2).to(dtype)
    mix = (2 + hc) * hc
    fn = (torch.randn(mix, hc * d, generator=gen) * (hc * d) ** -0.5).to(fn_dtype)
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(mix, generator=gen) * 0.5
    w = torch.rand(d, generator=gen) + 0.5 if norm else None
    return x, fn, scale, base, w


def check(got, want, dtype):
    y, post, comb = got
    wy, wpost, wcomb = want
    assert y.shape == wy.shape and y.dtype == dtype
    assert post.shape == wpost.shape and post.dtype == torch.float32 and comb.shape == wcomb.shape
    torch.testing.assert_close(post.cpu(), wpost, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comb.cpu(), wcomb, rtol=1e-4, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(y.cpu(), wy, rtol=1e-4, atol=1e-5)
    else:
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
        torch.testing.assert_close(y.cpu().float(), wy.float(), rtol=2 * ulp, atol=1e-4)


# (lead dims, hc, d, x dtype, fn dtype, norm): V4-Flash decode (1 and 8 tokens), V4-Pro width, a tiny model, batch x
# sequence lead dims, hc != 4 (d % 8 != 0: ATen ops on CUDA), fn held in bf16, no tokens, more 16-byte vectors
# than the finish kernel's 1024 threads (bf16 with the norm, fp32 without)
CASES = [((1,), 4, 4096, torch.bfloat16, torch.float32, True), ((8,), 4, 4096, torch.bfloat16, torch.float32, True),
         ((2,), 4, 7168, torch.bfloat16, torch.float32, True), ((3,), 4, 64, torch.float32, torch.float32, True),
         ((2, 3), 4, 128, torch.float16, torch.float32, False), ((5,), 3, 40, torch.float32, torch.float32, True),
         ((4,), 4, 256, torch.bfloat16, torch.bfloat16, True), ((0,), 4, 64, torch.bfloat16, torch.float32, True),
         ((2,), 4, 12288, torch.bfloat16, torch.float32, True), ((1,), 2, 8192, torch.float32, torch.float32, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,hc,d,dtype,fn_dtype,norm", CASES)
def test_matches_reference(device, lead, hc, d, dtype, fn_dtype, norm):
    gen = torch.Generator().manual_seed(hc * 1000 + d + len(lead))
    x, fn, scale, base, w = case(lead, hc, d, dtype, fn_dtype, gen, norm)
    want = ref.hc_pre_ref(x, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    dev = [t.to(device) if t is not None else None for t in (x, fn, scale, base, w)]
    got = ops.hc_pre(*dev, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    check(got, want, dtype)
    if device == "cuda":  # the CUDA kernels vs the CPU kernel
        cpu = ops.hc_pre(x, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
        check(got, cpu, dtype)


def test_matches_the_model_steps():
    """The op equals dsv4_model.layers.hc_pre followed by the sublayer's RMSNorm (what the model runs unfused)."""
    from dsv4_model.layers import RMSNorm, hc_pre

    gen = torch.Generator().manual_seed(7)
    x, fn, scale, base, w = case((3,), 4, 96, torch.bfloat16, torch.float32, gen)
    norm = RMSNorm(96, OUT_EPS)
    norm.weight.data.copy_(w)
    y, post, comb = hc_pre(x, fn, scale, base, 4, ITERS, HC_EPS, NORM_EPS)
    got = ops.hc_pre(x, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    check(got, (norm(y), post, comb), torch.bfloat16)


def test_wrong_steps_are_far():
    gen = torch.Generator().manual_seed(8)
    x, fn, scale, base, w = case((2,), 4, 64, torch.float32, torch.float32, gen)
    y, post, comb = ops.hc_pre(x, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    for wrong in (ref.hc_pre_ref(x, fn, scale.flip(0), base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS),
                  ref.hc_pre_ref(x, fn, scale, base, None, ITERS, HC_EPS, NORM_EPS, OUT_EPS),
                  ref.hc_pre_ref(x, fn * 2, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS),
                  ref.hc_pre_ref(x, fn, scale, base, w, 1, HC_EPS, NORM_EPS, OUT_EPS)):
        diff = max(float((a - b).abs().max()) for a, b in zip((y, post, comb), wrong))
        assert diff > 1e-3


def test_bad_arguments():
    gen = torch.Generator().manual_seed(9)
    x, fn, scale, base, w = case((2,), 4, 16, torch.float32, torch.float32, gen)
    with pytest.raises(RuntimeError, match=r"fn must be \[\(2 \+ hc\) \* hc = 24"):
        ops.hc_pre(x, fn[:, :32], scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    with pytest.raises(RuntimeError, match="x must be bfloat16, float16 or float32"):
        ops.hc_pre(x.double(), fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    with pytest.raises(RuntimeError, match=r"norm_weight must be float32 \[d = 16\]"):
        ops.hc_pre(x, fn, scale, base, w[:8], ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    with pytest.raises(RuntimeError, match=r"base must be float32 \[24\]"):
        ops.hc_pre(x, fn, scale, base[:3], w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    with pytest.raises(RuntimeError, match="iters must be"):
        ops.hc_pre(x, fn, scale, base, w, 0, HC_EPS, NORM_EPS, OUT_EPS)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(10)
    for dtype, norm in ((torch.bfloat16, True), (torch.float32, False)):
        x, fn, scale, base, w = case((3,), 4, 32, dtype, torch.float32, gen, norm)
        args = [t.to(device) if t is not None else None for t in (x, fn, scale, base, w)]
        torch.library.opcheck(ops.hc_pre.default, (*args, ITERS, HC_EPS, NORM_EPS, OUT_EPS))


def test_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(11)
    x, fn, scale, base, w = case((2,), 4, 32, torch.float32, torch.float32, gen)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(x):
        y, post, comb = ops.hc_pre(x * 2, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
        return y + 1, post, comb

    got = f(x)
    want = ops.hc_pre(x * 2, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    for a, b in zip(got, (want[0] + 1, want[1], want[2])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(12)
    x, fn, scale, base, w = (t.cuda() for t in case((2,), 4, 4096, torch.bfloat16, torch.float32, gen))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.hc_pre(x, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.hc_pre(x, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    x2 = case((2,), 4, 4096, torch.bfloat16, torch.float32, gen)[0]
    x.copy_(x2.cuda())
    g.replay()
    torch.cuda.synchronize()
    check(out, ref.hc_pre_ref(x2, fn.cpu(), scale.cpu(), base.cpu(), w.cpu(), ITERS, HC_EPS, NORM_EPS, OUT_EPS),
          torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_decode_with_and_without_the_op(monkeypatch, dtype):
    """The decode step through dsv4::hc_pre (DSV4_FUSED_HC=1) gives the logits of the unfused steps (=0); fp32:
    to summation-order rounding; bf16: the same rounding points (y rounded, then normed), so within bf16 noise."""
    monkeypatch.setenv("DSV4_FUSED_HC_POST", "0")  # every collapse through hc_pre (hc_post_pre: its own test)
    logits, calls, cfg = decode_with_switch(monkeypatch, "hc_pre", "DSV4_FUSED_HC", steps=6, dtype=dtype,
                                            max_seq_len=32, n_layers=2, compress_ratios=[0, 4])
    assert calls == {"0": 0, "1": 2 * cfg.n_layers * 6}  # two per layer and decode step
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits["1"], logits["0"], **tol)
    assert float((logits["1"] - logits["0"]).abs().max()) < float(logits["0"].abs().max()) * 0.05


# ---------------------------------------------------------------------------------------------- hc_post_pre
def post_case(lead, hc, d, dtype, gen):
    """The previous sublayer's output, the streams it updates and its post / comb (comb from a real Sinkhorn)."""
    out = (torch.randn(*lead, d, generator=gen) * 2).to(dtype)
    res = (torch.randn(*lead, hc, d, generator=gen) * 2).to(dtype)
    post = 2 * torch.rand(*lead, hc, generator=gen)
    comb = ref.hc_sinkhorn_ref(torch.randn(*lead, hc, hc, generator=gen), ITERS, HC_EPS)
    return out, res, post, comb


def check_post(got, want, dtype):
    h, rest = got[0], got[1:]
    assert h.shape == want[0].shape and h.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(h.cpu(), want[0], rtol=1e-5, atol=1e-5)
    else:  # one ulp where the fp32 sums straddle a rounding boundary
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
        torch.testing.assert_close(h.cpu().float(), want[0].float(), rtol=2 * ulp, atol=1e-4)
    check(rest, want[1:], dtype)


POST_CASES = [((1,), 4, 4096, torch.bfloat16, True), ((8,), 4, 4096, torch.bfloat16, True),
              ((2,), 4, 7168, torch.bfloat16, True), ((3,), 4, 64, torch.float32, True),
              ((2, 3), 4, 128, torch.float16, False), ((5,), 3, 40, torch.float32, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,hc,d,dtype,norm", POST_CASES)
def test_post_pre_matches_reference(device, lead, hc, d, dtype, norm):
    gen = torch.Generator().manual_seed(hc * 100 + d + len(lead) + 1)
    out, res, post, comb = post_case(lead, hc, d, dtype, gen)
    _, fn, scale, base, w = case(lead, hc, d, dtype, torch.float32, gen, norm)
    want = ref.hc_post_pre_ref(out, res, post, comb, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    dev = [t.to(device) if t is not None else None for t in (out, res, post, comb, fn, scale, base, w)]
    got = ops.hc_post_pre(*dev, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    check_post(got, want, dtype)
    if device == "cuda":  # the CUDA kernels vs the CPU kernel
        check_post(got, ops.hc_post_pre(out, res, post, comb, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS),
                   dtype)


def test_post_pre_is_the_model_steps():
    """h equals dsv4_model.layers.hc_post exactly (CPU: the same fp32 steps in the same order), the rest hc_pre of
    it; a wrong comb orientation (comb[j, i]) is far."""
    from dsv4_model.layers import hc_post

    gen = torch.Generator().manual_seed(21)
    out, res, post, comb = post_case((3,), 4, 96, torch.bfloat16, gen)
    _, fn, scale, base, w = case((3,), 4, 96, torch.bfloat16, torch.float32, gen)
    got = ops.hc_post_pre(out, res, post, comb, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    h = hc_post(out, res, post, comb)
    assert torch.equal(got[0], h)
    for a, b in zip(got[1:], ops.hc_pre(h, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)):
        assert torch.equal(a, b)
    wrong = hc_post(out, res, post, comb.transpose(-1, -2))
    assert float((got[0].float() - wrong.float()).abs().max()) > 1e-2


def test_post_pre_bad_arguments():
    gen = torch.Generator().manual_seed(22)
    out, res, post, comb = post_case((2,), 4, 16, torch.float32, gen)
    _, fn, scale, base, w = case((2,), 4, 16, torch.float32, torch.float32, gen)
    with pytest.raises(RuntimeError, match=r"hc_post_pre: out must be \[2, 16\]"):
        ops.hc_post_pre(out[:, :8], res, post, comb, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    with pytest.raises(RuntimeError, match="out must have res's dtype"):
        ops.hc_post_pre(out.bfloat16(), res, post, comb, fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    with pytest.raises(RuntimeError, match=r"comb must be float32 \[2, 4, 4\]"):
        ops.hc_post_pre(out, res, post, comb[..., :3], fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    with pytest.raises(RuntimeError, match=r"hc_post_pre: fn must be"):
        ops.hc_post_pre(out, res, post, comb, fn[:, :32], scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)


@pytest.mark.parametrize("device", DEVICES)
def test_post_pre_opcheck(device):
    gen = torch.Generator().manual_seed(23)
    for dtype, norm in ((torch.bfloat16, True), (torch.float32, False)):
        out, res, post, comb = post_case((3,), 4, 32, dtype, gen)
        _, fn, scale, base, w = case((3,), 4, 32, dtype, torch.float32, gen, norm)
        args = [t.to(device) if t is not None else None for t in (out, res, post, comb, fn, scale, base, w)]
        torch.library.opcheck(ops.hc_post_pre.default, (*args, ITERS, HC_EPS, NORM_EPS, OUT_EPS))


@pytest.mark.cuda
@pytest.mark.kernels
def test_post_pre_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(24)
    out, res, post, comb = (t.cuda() for t in post_case((2,), 4, 4096, torch.bfloat16, gen))
    _, fn, scale, base, w = (t.cuda() for t in case((2,), 4, 4096, torch.bfloat16, torch.float32, gen))
    args = (fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.hc_post_pre(out, res, post, comb, *args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = ops.hc_post_pre(out, res, post, comb, *args)
    new = post_case((2,), 4, 4096, torch.bfloat16, gen)
    for dst, src in zip((out, res, post, comb), new):
        dst.copy_(src.cuda())
    g.replay()
    torch.cuda.synchronize()
    check_post(got, ref.hc_post_pre_ref(*new, *(t.cpu() for t in args[:4]), *args[4:]), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_model_decode_with_and_without_post_fusion(monkeypatch, device):
    """The decode step with hc_post folded into the next collapse (DSV4_FUSED_HC_POST=1) gives the logits of the
    separate hc_post (=0); fp32; the op runs for every sublayer but the first."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    logits, calls, cfg = decode_with_switch(monkeypatch, "hc_post_pre", "DSV4_FUSED_HC_POST", steps=4,
                                            device=device, max_seq_len=32, n_layers=2, compress_ratios=[0, 4])
    assert calls == {"0": 0, "1": (2 * cfg.n_layers - 1) * 4}
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-4, atol=1e-4)

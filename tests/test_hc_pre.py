"""dsv4::hc_pre (a token's hc residual streams -> the sublayer input, its RMSNorm, and the mHC post / comb weights,
in one op) against the pure-PyTorch reference (dsv4_ops/reference/: the steps of dsv4_model.model.layers.hc_pre and
RMSNorm), opcheck, torch.compile, and on CUDA the split-K + finish kernels (V4 widths, one and several tokens,
fp32 / bf16 fn), a captured graph and no host sync.

Tolerance: the mixes are 24 dot products of length hc * d summed in another order than the reference's matmul
(fp32 rounding, then amplified a little by the sigmoid and 20 Sinkhorn iterations: post / comb to 1e-4 relative);
y is the same fp32 value rounded once to x's dtype (one ulp where two fp32 values straddle a rounding boundary)."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from decode_counting import decode_counting

from dsv4_model.model.decode_options import DecodeOptions

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
    """The op equals dsv4_model.model.layers.hc_pre followed by the sublayer's RMSNorm (what the model runs unfused)."""
    from dsv4_model.model.layers import RMSNorm, hc_pre

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
@pytest.mark.parametrize("on", [True, False])
def test_model_decode_with_and_without_the_op(monkeypatch, dtype, on):
    """The decode step through dsv4::hc_pre (the default; the first collapse of a step, every later one folds the
    previous hc_post in: hc_post_pre) and with the DecodeOptions(hc_pre=False) override (the tensor ops) gives the
    logits of a prefill of the same tokens; fp32: to summation-order rounding; bf16: within bf16 noise."""
    decode, prefill, calls, _ = decode_counting(monkeypatch, "hc_pre", steps=6, dtype=dtype,
                                                options=DecodeOptions(hc_pre=on), max_seq_len=32, n_layers=2,
                                                compress_ratios=[0, 4])
    assert calls == (6 if on else 0)  # one per decode step
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(decode, prefill, **tol)


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
    """h equals dsv4_model.model.layers.hc_post exactly (CPU: the same fp32 steps in the same order), the rest hc_pre of
    it; a wrong comb orientation (comb[j, i]) is far."""
    from dsv4_model.model.layers import hc_post

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
def test_model_decode_with_post_fusion(monkeypatch, device):
    """The decode step with each hc_post folded into the next collapse (dsv4::hc_post_pre, for every sublayer but
    the first) gives the logits of a prefill of the same tokens; fp32."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    decode, prefill, calls, cfg = decode_counting(monkeypatch, "hc_post_pre", steps=4, device=device,
                                                  max_seq_len=32, n_layers=2, compress_ratios=[0, 4])
    assert calls == (2 * cfg.n_layers - 1) * 4
    torch.testing.assert_close(decode, prefill, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------- hc_post_pre with MoE rows
E_ROWS = 16  # out_experts


def rows_case(tokens, k, d, dtype, shared, ids_dtype, gen):
    """The MoE's uncombined rows [T*k (+ T), d] (nvfp4_moe_rows' layout) and their ids [T, k]. Slots 1 and 2 of each
    token cancel (+-2^28 times the others' size), so the fp32 sum loses what came before them: another slot order
    gives another value. Some ids are outside [0, E_ROWS) (-1 and E_ROWS: token 0's first slot, the last token's
    last slot, every third slot of token 2) and their rows are NaN: a kernel that read them would make NaN."""
    n = tokens * k + (tokens if shared else 0)
    mag = torch.exp2(torch.randint(-4, 5, (n, 1), generator=gen).float())
    rows = torch.randn(n, d, generator=gen) * mag
    slots = rows[:tokens * k].view(tokens, k, d)
    slots[:, 1] *= 2.0 ** 28
    slots[:, 2] = -slots[:, 1]
    rows = rows.to(dtype)
    ids = torch.randint(0, E_ROWS, (tokens, k), generator=gen)
    ids[0, 0] = -1
    ids[-1, -1] = E_ROWS
    if tokens > 2:
        ids[2, ::3] = -1
    bad = ((ids < 0) | (ids >= E_ROWS)).flatten()
    rows[:tokens * k][bad] = float("nan")
    return rows, ids.to(ids_dtype)


# (tokens, k, hc, d, shared): V4-Flash decode width (the CUDA kernels), then hc = 3, d % 8 != 0 (CUDA: ATen ops)
ROWS_CASES = [(t, 6, 4, 4096, s) for t in (1, 2, 5) for s in (False, True)] + [(3, 4, 3, 40, True),
                                                                                (3, 4, 3, 40, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens,k,hc,d,shared", ROWS_CASES)
def test_post_pre_rows_equal_the_combined_output(device, ids_dtype, tokens, k, hc, d, shared):
    """With out_ids the op sums the MoE's rows as the combine does (moe_combine_rows_ref) and goes on as with the
    combined output: all four outputs bit-equal to the call on the combined output."""
    gen = torch.Generator().manual_seed(tokens * 10 + k + d + shared)
    rows, ids = rows_case(tokens, k, d, torch.bfloat16, shared, ids_dtype, gen)
    _, res, post, comb = post_case((tokens,), hc, d, torch.bfloat16, gen)
    _, fn, scale, base, w = case((tokens,), hc, d, torch.bfloat16, torch.float32, gen)
    combined = ref.moe_combine_rows_ref(rows, ids, E_ROWS, shared)
    assert combined.shape == (tokens, d) and not combined.isnan().any()
    assert torch.equal(ref.hc_post_rows_ref(rows, ids, E_ROWS, (tokens,)), combined)
    rest = (fn, scale, base, w)
    dev = [t.to(device) for t in (rows, ids, combined, res, post, comb, *rest)]
    rows_d, ids_d, combined_d, res_d, post_d, comb_d = dev[:6]
    args = (*dev[6:], ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    got = ops.hc_post_pre(rows_d, res_d, post_d, comb_d, *args, ids_d, E_ROWS)
    want = ops.hc_post_pre(combined_d, res_d, post_d, comb_d, *args)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    check_post(got, ref.hc_post_pre_ref(rows, res, post, comb, *rest, ITERS, HC_EPS, NORM_EPS, OUT_EPS, ids, E_ROWS),
               torch.bfloat16)
    # the shared row and the slot order matter: without the shared row / with the slots reversed it is another sum
    other = (ref.moe_combine_rows_ref(rows[:tokens * k], ids, E_ROWS, False) if shared else
             ref.moe_combine_rows_ref(rows.view(tokens, k, d).flip(1).reshape(-1, d), ids.flip(1), E_ROWS, False))
    assert not torch.equal(other, combined)


def test_post_pre_rows_other_dtypes():
    """fp32 / fp16 rows and streams: the combine's fp32 sum rounded once to the rows' dtype (hc_post_rows_ref)."""
    gen = torch.Generator().manual_seed(31)
    for dtype in (torch.float32, torch.float16):
        rows, ids = rows_case(3, 4, 64, dtype, True, torch.int64, gen)
        if dtype == torch.float16:  # 2^28 overflows fp16
            rows = torch.where(rows.isnan(), rows, torch.randn(rows.shape, generator=gen).to(dtype))
        _, res, post, comb = post_case((3,), 4, 64, dtype, gen)
        _, fn, scale, base, w = case((3,), 4, 64, dtype, torch.float32, gen)
        args = (fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
        combined = ref.hc_post_rows_ref(rows, ids, E_ROWS, (3,))
        assert combined.dtype == dtype and not combined.isnan().any()
        got = ops.hc_post_pre(rows, res, post, comb, *args, ids, E_ROWS)
        for a, b in zip(got, ops.hc_post_pre(combined, res, post, comb, *args)):
            assert torch.equal(a, b)


def test_post_pre_rows_lead_dims():
    """res [B, S, hc, d]: the tokens are its B * S rows, the sum lands in res's lead shape."""
    gen = torch.Generator().manual_seed(32)
    rows, ids = rows_case(6, 3, 32, torch.bfloat16, True, torch.int32, gen)
    _, res, post, comb = post_case((2, 3), 4, 32, torch.bfloat16, gen)
    _, fn, scale, base, w = case((2, 3), 4, 32, torch.bfloat16, torch.float32, gen)
    args = (fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    combined = ref.moe_combine_rows_ref(rows, ids, E_ROWS, True).view(2, 3, 32)
    for a, b in zip(ops.hc_post_pre(rows, res, post, comb, *args, ids, E_ROWS),
                    ops.hc_post_pre(combined, res, post, comb, *args)):
        assert torch.equal(a, b)


def test_post_pre_rows_bad_arguments():
    gen = torch.Generator().manual_seed(33)
    rows, ids = rows_case(2, 3, 16, torch.float32, True, torch.int64, gen)
    _, res, post, comb = post_case((2,), 4, 16, torch.float32, gen)
    _, fn, scale, base, w = case((2,), 4, 16, torch.float32, torch.float32, gen)
    args = (fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    rows_msg = r"with out_ids \[2, 3\] out must be the expert rows \[T\*k = 6 or T\*k \+ T = 8"
    for bad_rows in (rows[:7], rows[:5], torch.cat([rows, rows[:1]]), rows[:, :8], rows.view(2, 4, 16)):
        with pytest.raises(RuntimeError, match=rows_msg):
            ops.hc_post_pre(bad_rows, res, post, comb, *args, ids, E_ROWS)
    with pytest.raises(RuntimeError, match=r"out_experts must be in \[1, 2\^31\) with out_ids, got 0"):
        ops.hc_post_pre(rows, res, post, comb, *args, ids, 0)
    with pytest.raises(RuntimeError, match="out must have res's dtype"):
        ops.hc_post_pre(rows.bfloat16(), res, post, comb, *args, ids, E_ROWS)
    with pytest.raises(RuntimeError, match="out_ids must be int32 or int64"):
        ops.hc_post_pre(rows, res, post, comb, *args, ids.float(), E_ROWS)
    with pytest.raises(RuntimeError, match=r"out_ids must be \[T = 2 \(res's tokens\), k\]"):
        ops.hc_post_pre(rows, res, post, comb, *args, ids[:1], E_ROWS)
    with pytest.raises(RuntimeError, match=r"out_experts \(4\) is only read with out_ids"):
        ops.hc_post_pre(rows[6:], res, post, comb, *args, None, 4)
    # the fake (torch.compile / export) rejects the same calls
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (rows, ids, res, post, comb, fn, scale, base, w)]
        fargs = (*fake[5:], ITERS, HC_EPS, NORM_EPS, OUT_EPS)
        assert ops.hc_post_pre(fake[0], *fake[2:5], *fargs, fake[1], E_ROWS)[0].shape == res.shape
        with pytest.raises(RuntimeError, match=r"out must be the expert rows"):
            ops.hc_post_pre(fake[0][:7], *fake[2:5], *fargs, fake[1], E_ROWS)
        with pytest.raises(RuntimeError, match=r"out_experts must be in \[1, 2\^31\)"):
            ops.hc_post_pre(fake[0], *fake[2:5], *fargs, fake[1], 0)


@pytest.mark.parametrize("device", DEVICES)
def test_post_pre_rows_opcheck(device):
    gen = torch.Generator().manual_seed(34)
    for (dtype, ids_dtype, shared, d), norm in zip(((torch.bfloat16, torch.int32, True, 32),
                                                    (torch.float32, torch.int64, False, 32),
                                                    (torch.bfloat16, torch.int64, True, 40)), (True, False, True)):
        rows, ids = rows_case(3, 4, d, dtype, shared, ids_dtype, gen)
        _, res, post, comb = post_case((3,), 4, d, dtype, gen)
        _, fn, scale, base, w = case((3,), 4, d, dtype, torch.float32, gen, norm)
        args = [t.to(device) if t is not None else None for t in (rows, res, post, comb, fn, scale, base, w)]
        torch.library.opcheck(ops.hc_post_pre.default,
                              (*args, ITERS, HC_EPS, NORM_EPS, OUT_EPS, ids.to(device), E_ROWS))


def test_post_pre_rows_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(35)
    rows, ids = rows_case(2, 3, 32, torch.bfloat16, True, torch.int64, gen)
    _, res, post, comb = post_case((2,), 4, 32, torch.bfloat16, gen)
    _, fn, scale, base, w = case((2,), 4, 32, torch.bfloat16, torch.float32, gen)
    args = (fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(rows, ids):
        h, y, p, c = ops.hc_post_pre(rows, res, post, comb, *args, ids, E_ROWS)
        return h, y * 2, p, c

    got = f(rows, ids)
    want = ops.hc_post_pre(rows, res, post, comb, *args, ids, E_ROWS)
    for a, b in zip(got, (want[0], want[1] * 2, want[2], want[3])):
        assert torch.equal(a, b)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_post_pre_rows_cuda_graph_replay_and_no_sync():
    """The ids are read on the device at replay (new ids and rows, one graph); no host sync."""
    gen = torch.Generator().manual_seed(36)
    rows, ids = (t.cuda() for t in rows_case(2, 6, 4096, torch.bfloat16, True, torch.int64, gen))
    _, res, post, comb = (t.cuda() for t in post_case((2,), 4, 4096, torch.bfloat16, gen))
    _, fn, scale, base, w = (t.cuda() for t in case((2,), 4, 4096, torch.bfloat16, torch.float32, gen))
    args = (fn, scale, base, w, ITERS, HC_EPS, NORM_EPS, OUT_EPS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.hc_post_pre(rows, res, post, comb, *args, ids, E_ROWS)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = ops.hc_post_pre(rows, res, post, comb, *args, ids, E_ROWS)
    new_rows, new_ids = rows_case(2, 6, 4096, torch.bfloat16, True, torch.int64, gen)
    # other slots skipped than at capture: the slots reversed, each row with its id
    new_rows = torch.cat([new_rows[:12].view(2, 6, 4096).flip(1).reshape(12, 4096), new_rows[12:]])
    new_ids = new_ids.flip(1)
    rows.copy_(new_rows.cuda())
    ids.copy_(new_ids.cuda())
    g.replay()
    torch.cuda.synchronize()
    want = ops.hc_post_pre(ref.moe_combine_rows_ref(new_rows, new_ids, E_ROWS, True).cuda(), res, post, comb, *args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- hc_post (torch)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_post_sums_in_order_without_the_product_tensor(device, dtype):
    """The model's hc_post adds one stream's term at a time: the same values as reducing the [..., hc, hc, d]
    products (what it computed before; prefill held that tensor), bit for bit."""
    from dsv4_model.model.layers import hc_post

    gen = torch.Generator().manual_seed(3)
    T, hc, d = 300, 4, 256
    out = torch.randn(2, T, d, generator=gen).to(dtype)
    res = torch.randn(2, T, hc, d, generator=gen).to(dtype)
    post = torch.rand(2, T, hc, generator=gen) * 2
    comb = torch.rand(2, T, hc, hc, generator=gen)
    out, res, post, comb = (t.to(device) for t in (out, res, post, comb))
    want = post.unsqueeze(-1) * out.float().unsqueeze(-2) + (comb.unsqueeze(-1) * res.float().unsqueeze(-2)).sum(-3)
    assert torch.equal(hc_post(out, res, post, comb), want.to(dtype))

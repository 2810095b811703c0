"""dsv4::rms_norm_rope (the decode step's RMSNorm + RoPE of q, kv and compressed entries, with the simulated FP8
rounding of kv) against the pure-PyTorch reference (dsv4_ops/reference.py), which is checked bit for bit against
the model's own steps (dsv4_model.layers.RMSNorm / unweighted_rms_norm, apply_rope, quant_sim.kv_fake_quant);
opcheck, torch.compile, a captured CUDA graph, and the model's decode with and without the op.

Tolerance: the sum of squares runs in another order than torch's mean (rs to an ulp), so a value rounded to
bf16 can land one ulp away where the fp32 value straddles a rounding boundary, and an FP8 code one step away
where its scaled value straddles one; fp32 results to 1e-5 relative."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from decode_switch import decode_with_switch

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]
EPS = 1e-6


def case(rows, heads, d, rope, dtype, weighted, gen, scale=3.0):
    x = (torch.randn(rows, heads, d, generator=gen) * scale).to(dtype)
    ang = torch.rand(rows, rope // 2, generator=gen) * 6.3
    cs = torch.stack([ang.cos(), ang.sin()], -1)
    w = torch.rand(d, generator=gen) + 0.5 if weighted else None
    return x, w, cs


def close(got, want, fp8):
    if got.dtype == torch.float32 and not fp8:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
        return
    # a few values one rounding step (bf16 ulp, or an FP8 code: 2^-3 relative) away, or a rotated value carrying an
    # input's one-ulp difference (a bf16 ulp of the vector's largest value); the rest equal
    diff = (got.cpu().float() - want.float()).abs()
    w = want.float().abs()
    step = w * (2 ** -3 if fp8 else 2 ** -7) + w.amax(-1, keepdim=True) * 2 ** -7 + 1e-6
    assert bool((diff <= step).all()), float((diff - step).max())
    assert float((diff > 1e-5 * w.amax(-1, keepdim=True)).float().mean()) < 0.02  # past fp32 rounding noise


# (rows, heads, d, rope_dim, dtype, weight, fp8): V4 q (64 heads x 512, rope 64), kv and the CSA / HCA compressed
# entries (512, weight, FP8 nope), the indexer's compressed keys (128, weight), tiny-model widths, a width that is
# not a whole number of warps of 4-element threads, no rope
CASES = [(1, 64, 512, 64, torch.bfloat16, False, False), (3, 64, 512, 64, torch.float32, False, False),
         (2, 1, 512, 64, torch.bfloat16, True, True), (2, 1, 128, 64, torch.bfloat16, True, False),
         (4, 4, 128, 64, torch.float32, True, True), (2, 3, 72, 8, torch.float32, True, True),
         (2, 2, 64, 0, torch.bfloat16, False, True)]


def test_reference_is_the_model_steps():
    from dsv4_model.layers import RMSNorm, apply_rope, unweighted_rms_norm
    from dsv4_model.quant_sim import kv_fake_quant

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, cs = case(3, 5, 512, 64, dtype, True, gen)
        norm = RMSNorm(512, EPS)
        norm.weight.data.copy_(w)
        want = kv_fake_quant(apply_rope(norm(x), cs.unsqueeze(1), 64), 64)
        assert torch.equal(ref.rms_norm_rope_ref(x, w, cs, EPS, 64, True), want)
        want = apply_rope(unweighted_rms_norm(x, EPS), cs.unsqueeze(1), 64)
        assert torch.equal(ref.rms_norm_rope_ref(x, None, cs, EPS, 64, False), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,heads,d,rope,dtype,weighted,fp8", CASES)
def test_matches_reference(device, rows, heads, d, rope, dtype, weighted, fp8):
    gen = torch.Generator().manual_seed(rows * 1000 + heads + d + rope)
    x, w, cs = case(rows, heads, d, rope, dtype, weighted, gen)
    if fp8:  # a block of zeros (the amax floor) and one with a value 10^4 larger than the rest (codes flush to 0)
        x[0, 0, :64] = 0
        if d - rope >= 128:
            x[-1, -1, 64:128] *= 1e-4
            x[-1, -1, 70] = 50
    want = ref.rms_norm_rope_ref(x, w, cs, EPS, rope, fp8)
    dev = [t.to(device) if t is not None else None for t in (x, w, cs)]
    got = ops.rms_norm_rope(*dev, EPS, rope, fp8)
    assert got.shape == x.shape and got.dtype == dtype
    close(got, want, fp8)
    if device == "cuda":  # the CUDA kernel vs the CPU kernel
        close(got, ops.rms_norm_rope(x, w, cs, EPS, rope, fp8), fp8)


def test_wrong_steps_are_far():
    gen = torch.Generator().manual_seed(1)
    x, w, cs = case(2, 3, 128, 64, torch.float32, True, gen)
    got = ops.rms_norm_rope(x, w, cs, EPS, 64, True)
    for wrong in (ref.rms_norm_rope_ref(x, None, cs, EPS, 64, True), ref.rms_norm_rope_ref(x, w, cs, EPS, 64, False),
                  ref.rms_norm_rope_ref(x, w, cs.flip(-1), EPS, 64, True),
                  ref.rms_norm_rope_ref(x, w, cs[[1, 0]], EPS, 64, True)):
        assert float((got - wrong).abs().max()) > 1e-2


def test_bad_arguments():
    gen = torch.Generator().manual_seed(2)
    x, w, cs = case(2, 3, 128, 64, torch.float32, True, gen)
    with pytest.raises(RuntimeError, match=r"cs must be float32 \[rows = 2, rope_dim / 2 = 32, 2\]"):
        ops.rms_norm_rope(x, w, cs[:1], EPS, 64, False)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[d = 128\]"):
        ops.rms_norm_rope(x, w[:64], cs, EPS, 64, False)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        ops.rms_norm_rope(x.half(), w, cs, EPS, 64, False)
    with pytest.raises(RuntimeError, match="rope_dim must be a multiple of 4"):
        ops.rms_norm_rope(x, w, cs[:, :3], EPS, 6, False)
    with pytest.raises(RuntimeError, match="fp8_nope needs d - rope_dim"):
        ops.rms_norm_rope(x[..., :96].contiguous(), w[:96], cs, EPS, 64, True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    for dtype, weighted, fp8 in ((torch.bfloat16, True, True), (torch.float32, False, False)):
        x, w, cs = case(2, 3, 128, 64, dtype, weighted, gen)
        args = [t.to(device) if t is not None else None for t in (x, w, cs)]
        torch.library.opcheck(ops.rms_norm_rope.default, (*args, EPS, 64, fp8))


def test_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(4)
    x, w, cs = case(2, 3, 128, 64, torch.float32, True, gen)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(x):
        return ops.rms_norm_rope(x * 2, w, cs, EPS, 64, True) + 1

    torch.testing.assert_close(f(x), ops.rms_norm_rope(x * 2, w, cs, EPS, 64, True) + 1, rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_no_sync_and_unaligned_views():
    gen = torch.Generator().manual_seed(5)
    x, w, cs = (t.cuda() for t in case(2, 1, 512, 64, torch.bfloat16, True, gen))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.rms_norm_rope(x, w, cs, EPS, 64, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.rms_norm_rope(x, w, cs, EPS, 64, True)
    x2 = case(2, 1, 512, 64, torch.bfloat16, True, gen)[0]
    x.copy_(x2.cuda())
    g.replay()
    torch.cuda.synchronize()
    close(out, ref.rms_norm_rope_ref(x2, w.cpu(), cs.cpu(), EPS, 64, True), True)
    big = torch.randn(2, 1, 516, device="cuda").to(torch.bfloat16)  # a view 4 elements (8 bytes) in
    view = big[..., 4:]
    close(ops.rms_norm_rope(view, w, cs, EPS, 64, True), ref.rms_norm_rope_ref(view.cpu(), w.cpu(), cs.cpu(), EPS,
                                                                               64, True), True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_decode_with_and_without_the_op(monkeypatch, device, dtype):
    """The decode step through dsv4::rms_norm_rope (DSV4_FUSED_NORM_ROPE=1) gives the logits of the separate steps
    (=0): fp32 to summation-order rounding, bf16 within bf16 noise; the op runs for q and kv of every layer and
    every compressor's entry."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    logits, calls, _ = decode_with_switch(monkeypatch, "rms_norm_rope", "DSV4_FUSED_NORM_ROPE", steps=5,
                                          device=device, dtype=dtype, n_layers=3, compress_ratios=[0, 4, 16])
    # per step: q + kv of 3 layers, 3 compressors (CSA's, its indexer's, HCA's)
    assert calls == {"0": 0, "1": (2 * 3 + 3) * 5}
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits["1"], logits["0"], **tol)

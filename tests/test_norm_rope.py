"""dsv4::rms_norm_rope (the decode step's RMSNorm + RoPE of q, kv and compressed entries, with the simulated FP8
rounding of kv) against the pure-PyTorch reference (dsv4_ops/reference/), which is checked bit for bit against
the model's own steps (dsv4_model.model.layers.RMSNorm / unweighted_rms_norm, apply_rope, quant_sim.kv_fake_quant);
opcheck, torch.compile, a captured CUDA graph, and the model's decode with and without the op. The same for
dsv4::rms_norm_rope_store (the result written into the attention cache's window / entry slots).

Tolerance: the sum of squares runs in another order than torch's mean (rs to an ulp), so a value rounded to
bf16 can land one ulp away where the fp32 value straddles a rounding boundary, and an FP8 code one step away
where its scaled value straddles one; fp32 results to 1e-5 relative."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from decode_counting import decode_counting


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
    from dsv4_model.model.layers import RMSNorm, apply_rope, unweighted_rms_norm
    from dsv4_model.model.quant_sim import kv_fake_quant

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
def test_model_decode_through_the_op(monkeypatch, device, dtype):
    """The decode step through dsv4::rms_norm_rope gives the logits of a prefill of the same tokens (the
    separate steps): fp32 to summation-order rounding, bf16 within bf16 noise; the op runs for q_norm (rope_dim 0)
    and q of every layer and the indexer's compressor entry (kv and the other entries go through
    rms_norm_rope_store)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    decode, prefill, calls, _ = decode_counting(monkeypatch, "rms_norm_rope", steps=5, device=device, dtype=dtype,
                                                n_layers=3, compress_ratios=[0, 4, 16])
    assert calls == (2 * 3 + 1) * 5
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(decode, prefill, **tol)


# ---------------------------------------------------------------------------------------------- rms_norm_rope_store
def store_case(rows, d, rope, dtype, gen, S=24):
    x, w, cs = case(rows, 1, d, rope, dtype, True, gen)
    cache = (torch.randn(rows + 1, S, d, generator=gen)).to(dtype)  # one row more than x: must stay untouched
    return x.squeeze(1), w, cs, cache


# (ratio, offset, slots, positions): the sliding window (every row, wrapping), compressed entries of ratio 4 (rows
# whose window closes and rows whose does not, one past the last slot: clamped), ratio 1, a negative position
STORE_CASES = [(0, 0, 8, [0, 5, 8, 21]), (4, 8, 16, [3, 5, 7, 200]), (1, 8, 16, [0, 9, 15, 40]),
               (0, 3, 5, [-1, 2, 4, 12])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,offset,slots,positions", STORE_CASES)
def test_store_matches_reference(device, dtype, ratio, offset, slots, positions):
    gen = torch.Generator().manual_seed(ratio * 100 + offset + slots)
    x, w, cs, cache = store_case(len(positions), 512, 64, dtype, gen)
    for pdtype in (torch.int64, torch.int32):
        pos = torch.tensor(positions, dtype=pdtype)
        want = cache.clone()
        ref.rms_norm_rope_store_ref(x, w, cs, EPS, 64, True, pos, ratio, offset, slots, want)
        got = cache.clone().to(device)
        dev = [t.to(device) for t in (x, w, cs, pos)]
        ops.rms_norm_rope_store(dev[0], dev[1], dev[2], EPS, 64, True, dev[3], ratio, offset, slots, got)
        written = (want != cache).any(-1)  # the slots the reference wrote (random data: every one changes)
        assert int(written.sum()) == sum(p >= 0 and (ratio == 0 or (p + 1) % ratio == 0) for p in positions)
        assert torch.equal(got.cpu()[~written], cache[~written])  # every other slot and row untouched
        close(got.cpu()[written], want[written], True)
        if device == "cuda":  # the CUDA kernel vs the CPU kernel
            cpu = cache.clone()
            ops.rms_norm_rope_store(x, w, cs, EPS, 64, True, pos, ratio, offset, slots, cpu)
            close(got.cpu(), cpu, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [0, 4])
def test_store_kv_batch_is_each_token_in_turn(device, ratio):
    """kv_batch = S: 3 tokens of 2 sequences (token-major) written in one call go where 3 calls of one token per
    sequence put them (the window wraps; ratio 4: one window closes in the call), bit for bit; the reference too;
    opcheck."""
    gen = torch.Generator().manual_seed(11 + ratio)
    T, S = 3, 2
    x, w, cs, cache = store_case(T * S, 512, 64, torch.bfloat16, gen)
    pos = torch.tensor([5, 14]).repeat(T) + torch.arange(T).repeat_interleave(S)  # token t of row b at p_b + t
    args = lambda *t: [v.to(device) for v in t]  # noqa: E731
    want = cache.clone().to(device)
    for t in range(T):
        r = slice(t * S, (t + 1) * S)
        ops.rms_norm_rope_store(*args(x[r], w, cs[r]), EPS, 64, True, pos[r].to(device), ratio, 2, 8, want)
    got = cache.clone().to(device)
    ops.rms_norm_rope_store(*args(x, w, cs), EPS, 64, True, pos.to(device), ratio, 2, 8, got, S)
    assert torch.equal(got, want) and not torch.equal(got.cpu(), cache)
    refd = cache.clone()
    ref.rms_norm_rope_store_ref(x, w, cs, EPS, 64, True, pos, ratio, 2, 8, refd, S)
    close(got.cpu(), refd, True)
    torch.library.opcheck(ops.rms_norm_rope_store.default,
                          (*args(x, w, cs), EPS, 64, True, pos.to(device), ratio, 2, 8, cache.clone().to(device), S))
    with pytest.raises(RuntimeError, match="kv_batch must be 0 or divide rows = 6, got 4"):
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, True, pos, ratio, 2, 8, cache.clone(), 4)


def test_store_is_rms_norm_rope():
    """The stored vectors are rms_norm_rope's, bit for bit (same kernel, another destination)."""
    gen = torch.Generator().manual_seed(7)
    x, w, cs, cache = store_case(3, 128, 64, torch.float32, gen)
    ops.rms_norm_rope_store(x, w, cs, EPS, 64, False, torch.tensor([1, 2, 3]), 0, 4, 6, cache)
    assert torch.equal(cache[[0, 1, 2], [5, 6, 7]], ops.rms_norm_rope(x.unsqueeze(1), w, cs, EPS, 64, False)[:, 0])


def test_store_bad_arguments():
    gen = torch.Generator().manual_seed(8)
    x, w, cs, cache = store_case(2, 128, 64, torch.float32, gen)
    pos = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match=r"x must be \[rows, d\]"):
        ops.rms_norm_rope_store(x.unsqueeze(1), w, cs, EPS, 64, False, pos, 0, 0, 8, cache)
    with pytest.raises(RuntimeError, match=r"positions must be \[rows = 2\]"):
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, False, pos[:1], 0, 0, 8, cache)
    with pytest.raises(RuntimeError, match="positions must be int64 or int32"):
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, False, pos.float(), 0, 0, 8, cache)
    with pytest.raises(RuntimeError, match=r"cache must be a contiguous Float \[>= rows = 2, >= offset \+ slots = 30"):
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, False, pos, 0, 10, 20, cache)
    with pytest.raises(RuntimeError, match="cache must be a contiguous Float"):
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, False, pos, 0, 0, 8, cache.bfloat16())
    with pytest.raises(RuntimeError, match="need ratio >= 0, offset >= 0, slots >= 1"):
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, False, pos, -1, 0, 8, cache)
    with pytest.raises(RuntimeError, match=r"cs must be float32 \[rows = 2"):
        ops.rms_norm_rope_store(x, w, cs[:1], EPS, 64, False, pos, 0, 0, 8, cache)


@pytest.mark.parametrize("device", DEVICES)
def test_store_opcheck(device):
    gen = torch.Generator().manual_seed(9)
    for dtype, fp8, ratio in ((torch.bfloat16, True, 4), (torch.float32, False, 0)):
        x, w, cs, cache = store_case(2, 128, 64, dtype, gen)
        pos = torch.tensor([3, 6])
        args = [t.to(device) for t in (x, w, cs)]
        torch.library.opcheck(ops.rms_norm_rope_store.default,
                              (*args, EPS, 64, fp8, pos.to(device), ratio, 2, 12, cache.to(device)))


def test_store_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(10)
    x, w, cs, cache = store_case(2, 128, 64, torch.float32, gen)
    pos = torch.tensor([3, 9])
    eager = cache.clone()

    @torch.compile(fullgraph=True, backend="inductor")
    def f(x, cache):
        ops.rms_norm_rope_store(x * 2, w, cs, EPS, 64, True, pos, 0, 0, 8, cache)
        return cache[:2].sum()

    got = f(x, cache)
    ops.rms_norm_rope_store(x * 2, w, cs, EPS, 64, True, pos, 0, 0, 8, eager)
    assert torch.equal(cache, eager)
    torch.testing.assert_close(got, eager[:2].sum())  # read after the write (Inductor's own summation order)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_store_cuda_graph_replay_no_sync():
    gen = torch.Generator().manual_seed(11)
    x, w, cs, cache = (t.cuda() for t in store_case(2, 512, 64, torch.bfloat16, gen))
    pos = torch.tensor([3, 7], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, True, pos, 4, 8, 16, cache)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.rms_norm_rope_store(x, w, cs, EPS, 64, True, pos, 4, 8, 16, cache)
    x2 = store_case(2, 512, 64, torch.bfloat16, gen)[0]
    x.copy_(x2.cuda())
    pos.copy_(torch.tensor([11, 15]))  # new slots: 8 + 2, 8 + 3
    before = cache.cpu()
    want = before.clone()
    ref.rms_norm_rope_store_ref(x2, w.cpu(), cs.cpu(), EPS, 64, True, pos.cpu(), 4, 8, 16, want)
    g.replay()
    torch.cuda.synchronize()
    written = (want != before).any(-1)
    assert written.nonzero().tolist() == [[0, 10], [1, 11]]
    assert torch.equal(cache.cpu()[~written], before[~written])
    close(cache.cpu()[written], want[written], True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_decode_through_the_store(monkeypatch, device, dtype):
    """The decode step writing kv and compressed entries with dsv4::rms_norm_rope_store gives the logits of a
    prefill of the same tokens (fp32 to summation-order rounding, bf16 within bf16 noise); the op runs for kv of
    every layer and the entries of the non-indexer compressors."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    decode, prefill, calls, _ = decode_counting(monkeypatch, "rms_norm_rope_store", steps=5, device=device,
                                                dtype=dtype, n_layers=3, compress_ratios=[0, 4, 16])
    assert calls == (3 + 2) * 5  # kv of 3 layers, the CSA and HCA compressors' entries
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(decode, prefill, **tol)

"""dsv4::sparse_attn_decode (a decode step's attention: one query token per row against the window + compressed /
top-k cache rows it lists, one shared K = V head, per-head sink) against the reference (dsv4_ops/reference/,
the steps of dsv4_model.model.attention.Attention._attend), opcheck, torch.compile, and on CUDA the split-K kernels
(one and many splits, head counts that do not fill a CTA, skipped rows), a captured graph and no host sync.

Tolerance: fp32 results agree to fp32 rounding of the sums (rtol 1e-5); bf16 results are the same fp32 values
rounded once, so they may sit one bf16 ulp apart where the two fp32 values straddle a rounding boundary."""
import math

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from dsv4_ops.overrides import kernel_overrides

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def case(B, H, D, N, J, dtype, gen, masked=0.2, kv_rows=None):
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    kv = torch.randn(kv_rows or B, N, D, generator=gen).to(dtype)
    idx = torch.randint(0, N, (B, J), generator=gen)
    drop = torch.rand(B, J, generator=gen) < masked
    idx = torch.where(drop, torch.where(torch.rand(B, J, generator=gen) < 0.5, -1, N + 3), idx)
    sink = torch.randn(H, generator=gen)
    return q, kv, idx, sink


def check(got, q, kv, idx, sink, scale):
    want = ref.sparse_attn_decode_ref(q.cpu(), kv.cpu(), idx.cpu(), sink.cpu(), scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2 ** -7, atol=1e-5)


# (B, H, D, N, J): V4-Flash CSA (window 128 + top-512 of 1024 entries), HCA at long context (many splits),
# V4-Pro heads, a tiny model (H = 4 does not fill a CTA, D = 80), batch rows with a larger cache batch
SHAPES = [(1, 64, 512, 1152, 640), (1, 64, 512, 2200, 2176), (2, 128, 512, 700, 640), (3, 4, 80, 40, 20),
          (2, 12, 64, 300, 33)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,D,N,J", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(device, B, H, D, N, J, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + H + D + J)
    q, kv, idx, sink = case(B, H, D, N, J, dtype, gen, kv_rows=B + 1)
    scale = D ** -0.5
    got = ops.sparse_attn_decode(q.to(device), kv.to(device), idx.to(device).int(), sink.to(device), scale)
    check(got, q, kv, idx, sink, scale)


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("B,H,D,N,J", [s for s in SHAPES if s[2] % 64 == 0])
def test_both_partial_kernels_match_reference(B, H, D, N, J):
    """bf16 with D % 64 == 0 runs a tensor-core partial kernel (P applied as bf16 hi + lo parts: the CUDA-core
    kernel's tolerance holds): the default (auto), the 16-head mma.sync CTA, the warpgroup-MMA one; the
    attn_kernel="simt" override the CUDA-core one; H = 12 leaves heads of a 16-head CTA empty. "mma_all_heads" (64
    heads per CTA, prefill's form) does each head's arithmetic in the same order as the 16-head CTA: the same bits."""
    gen = torch.Generator().manual_seed(B * 1000 + H + D + J + 7)
    q, kv, idx, sink = case(B, H, D, N, J, torch.bfloat16, gen, kv_rows=B + 1)
    idx[0, :5] = -1  # a chunk that starts with skipped rows
    scale = D ** -0.5
    args = (q.cuda(), kv.cuda(), idx.cuda().int(), sink.cuda(), scale)
    auto = ops.sparse_attn_decode(*args)
    check(auto, q, kv, idx, sink, scale)
    outs = {}
    for kernel in ("simt", "mma_16_heads", "mma_all_heads", "wgmma"):  # wgmma: D = 512, else the auto choice
        with kernel_overrides(attn_kernel=kernel):
            outs[kernel] = ops.sparse_attn_decode(*args)
        check(outs[kernel], q, kv, idx, sink, scale)
    mma = outs["mma_16_heads"]
    assert torch.equal(outs["mma_all_heads"], mma)
    for kernel in ("simt", "wgmma"):
        torch.testing.assert_close(outs[kernel].float(), mma.float(), rtol=2 ** -7, atol=1e-5, msg=kernel)
    assert any(torch.equal(auto, outs[k]) for k in ("mma_16_heads", "wgmma"))  # auto picks one of them


@pytest.mark.cuda
@pytest.mark.kernels
@pytest.mark.parametrize("T,n,listed", [(300, 700, 512), (140, 90, 90), (5, 40, 37)])
def test_prefill_rows_warpgroup_kernel(T, n, listed):
    """The prefill form (T query rows of one sequence, kv one key buffer seen through a stride-0 view, each row its
    128-key window then its entries as idx2 with an offset; some rows see fewer keys, a chunk of skipped ones) on
    the warpgroup-MMA kernel: within the reference's bf16 tolerance, and close to the mma kernel's output; the
    auto choice runs it where the rows fill the SMs."""
    gen = torch.Generator().manual_seed(T + n)
    H, D, W = 64, 512, 128
    L = W - 1 + T + n
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    buf = torch.randn(1, L, D, generator=gen).to(torch.bfloat16)
    win = torch.arange(T).view(T, 1) + torch.arange(W).view(1, W)
    win = torch.where(win < W - 1 - (T // 3), -1, win)  # the first rows' windows reach before the sequence
    sel = torch.randint(0, n, (T, listed), generator=gen)
    sel = torch.where(torch.arange(listed).view(1, -1) >= (torch.arange(T).view(-1, 1) * listed) // T + 1, -1, sel)
    sink = torch.randn(H, generator=gen)
    scale = D ** -0.5
    dev = [t.cuda() for t in (q, buf, win.int(), sel.int(), sink)]
    kv = dev[1].expand(T, -1, -1)
    call = lambda: ops.sparse_attn_decode(dev[0], kv, dev[2], dev[4], scale, None, 0, dev[3], W - 1 + T)  # noqa: E731
    with kernel_overrides(attn_kernel="wgmma"):
        got = call()
    joined = torch.cat([win, torch.where(sel >= 0, sel + W - 1 + T, -1)], dim=1)
    check(got, q, buf.expand(T, -1, -1), joined, sink, scale)
    with kernel_overrides(attn_kernel="mma_all_heads"):
        torch.testing.assert_close(got.float(), call().float(), rtol=2 ** -7, atol=1e-5)
    # the auto choice: this kernel where the rows alone fill the SMs (prefill), the 16-head mma CTA below
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with kernel_overrides(attn_kernel="wgmma" if T >= sms else "mma_16_heads"):
        want = call()
    assert torch.equal(call(), want), f"auto choice at {T} rows ({sms} SMs)"


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_rows_int64_ids_and_empty(device):
    gen = torch.Generator().manual_seed(1)
    q, kv, idx, sink = case(2, 8, 64, 50, 40, torch.float32, gen)
    idx[0] = -1  # row 0 lists nothing: only the sink is left, the output is 0
    got = ops.sparse_attn_decode(q.to(device), kv.to(device), idx.to(device), sink.to(device), 0.125)
    check(got, q, kv, idx, sink, 0.125)
    assert torch.equal(got[0].cpu(), torch.zeros(8, 64))
    empty = ops.sparse_attn_decode(q.to(device), kv.to(device), idx[:, :0].to(device), sink.to(device), 0.125)
    assert torch.equal(empty.cpu(), torch.zeros(2, 8, 64))


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_math_is_far(device):
    gen = torch.Generator().manual_seed(2)
    q, kv, idx, sink = case(1, 8, 64, 60, 48, torch.float32, gen, masked=0.0)
    sink = sink + 2.0  # a sink that takes a visible share
    got = ops.sparse_attn_decode(q.to(device), kv.to(device), idx.to(device), sink.to(device), 0.125).cpu()
    check(got, q, kv, idx, sink, 0.125)
    for wrong in (ref.sparse_attn_decode_ref(q, kv, idx, sink - 1e4, 0.125),  # no sink
                  ref.sparse_attn_decode_ref(q, kv, idx, sink, 0.25),
                  ref.sparse_attn_decode_ref(q, kv, idx.roll(1, 1).clamp(max=58) + 1, sink, 0.125),
                  ref.sparse_attn_decode_ref(q, kv, idx[:, :40], sink, 0.125)):
        assert float((got - wrong).abs().max()) > 1e-3


# (B, H, D, N, J1, J2, offset): a CSA layer (window 128 + the indexer's top-512 of 1024 entries at offset 128), a
# tiny one, a window part that is empty
TWO_LISTS = [(1, 64, 512, 1152, 128, 512, 128), (2, 4, 80, 40, 16, 12, 16), (2, 12, 64, 300, 0, 33, 5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,D,N,J1,J2,off", TWO_LISTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_second_row_list_is_the_joined_list(device, B, H, D, N, J1, J2, off, dtype):
    """idx2 + idx2_offset (negative idx2: no row) listed after idx: the same bits as the joined list in one idx
    (the same kernel reads the same rows in the same order), both partial kernels on CUDA, int32 / int64 idx2."""
    gen = torch.Generator().manual_seed(B * 100 + J1 + J2)
    q, kv, idx, sink = case(B, H, D, N, J1, dtype, gen, kv_rows=B + 1)
    sel = torch.randint(0, N - off, (B, J2), generator=gen)
    sel = torch.where(torch.rand(B, J2, generator=gen) < 0.25, -1, sel)
    sel[0, -3:] = -1  # the top-k's padding
    sel[-1, 0] = N  # past the cache: skipped
    joined = torch.cat([idx, torch.where(sel >= 0, sel + off, -1)], dim=1)
    scale = D ** -0.5
    dev = [t.to(device) for t in (q, kv, idx, sink)]
    for kernel in (("auto", "simt", "mma_all_heads", "wgmma") if device == "cuda" else ("auto",)):
        with kernel_overrides(attn_kernel=kernel):
            want = ops.sparse_attn_decode(dev[0], dev[1], joined.to(device).int(), dev[3], scale)
            for s in (sel.int(), sel):
                got = ops.sparse_attn_decode(dev[0], dev[1], dev[2].int(), dev[3], scale, None, 0, s.to(device), off)
                assert torch.equal(got, want), (kernel, s.dtype)
    check(got, q, kv, joined, sink, scale)
    torch.testing.assert_close(ref.sparse_attn_decode_ref(q, kv, idx, sink, scale, None, 0, sel, off),
                               ref.sparse_attn_decode_ref(q, kv, joined, sink, scale), rtol=0, atol=0)


# (T, S, H, D, N, J1, J2): a verification of 4 tokens of 2 V4-Flash CSA rows, 2 tokens of 3 tiny rows
KV_BATCH = [(4, 2, 64, 512, 1152, 128, 512), (2, 3, 4, 80, 40, 16, 12)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,S,H,D,N,J1,J2", KV_BATCH)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_batch_reads_each_rows_sequence(device, T, S, H, D, N, J1, J2, dtype):
    """kv_batch = S: query row b (T tokens of S sequences, token-major) reads kv[b % S] -- the same bits as the
    call on the cache repeated T times (every kernel on CUDA), a cache with spare rows, and the reference."""
    gen = torch.Generator().manual_seed(T * 10 + S)
    q, kv, idx, sink = case(T * S, H, D, N, J1, dtype, gen, kv_rows=S + 2)
    sel = torch.where(torch.rand(T * S, J2, generator=gen) < 0.25, -1, torch.randint(0, N - J1, (T * S, J2),
                                                                                       generator=gen))
    scale = D ** -0.5
    rep = kv[:S].repeat(T, 1, 1)
    dev = lambda t: t.to(device)  # noqa: E731
    for kernel in (("auto", "simt", "mma_all_heads", "mma_16_heads", "wgmma") if device == "cuda" else ("auto",)):
        with kernel_overrides(attn_kernel=kernel):
            want = ops.sparse_attn_decode(dev(q), dev(rep), dev(idx).int(), dev(sink), scale, None, 0, dev(sel), J1)
            got = ops.sparse_attn_decode(dev(q), dev(kv), dev(idx).int(), dev(sink), scale, None, 0, dev(sel), J1, S)
            assert torch.equal(got, want), kernel
    joined = torch.cat([idx, torch.where(sel >= 0, sel + J1, -1)], dim=1)
    check(got, q, rep, joined, sink, scale)
    torch.testing.assert_close(ref.sparse_attn_decode_ref(q, kv, idx, sink, scale, None, 0, sel, J1, S),
                               ref.sparse_attn_decode_ref(q, rep, joined, sink, scale), rtol=0, atol=0)
    torch.library.opcheck(ops.sparse_attn_decode.default,
                          (dev(q), dev(kv), dev(idx).int(), dev(sink), scale, None, 0, dev(sel), J1, S))


def test_bad_arguments():
    q, kv = torch.randn(2, 4, 16), torch.randn(2, 10, 16)
    idx, sink = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(4)
    with pytest.raises(RuntimeError, match="kv must be"):
        ops.sparse_attn_decode(q, kv[:, :, :8], idx, sink, 1.0)
    with pytest.raises(RuntimeError, match="kv must have q's dtype"):
        ops.sparse_attn_decode(q, kv.double(), idx, sink, 1.0)
    with pytest.raises(RuntimeError, match="idx must be"):
        ops.sparse_attn_decode(q, kv, idx.float(), sink, 1.0)
    with pytest.raises(RuntimeError, match=r"sink must be float32 \[H = 4\]"):
        ops.sparse_attn_decode(q, kv, idx, torch.zeros(3), 1.0)
    with pytest.raises(RuntimeError, match=r"idx2 must be \[B = 2, J2\]"):
        ops.sparse_attn_decode(q, kv, idx, sink, 1.0, None, 0, idx[:1], 4)
    with pytest.raises(RuntimeError, match="idx2 must be int32 or int64"):
        ops.sparse_attn_decode(q, kv, idx, sink, 1.0, None, 0, idx.float(), 4)
    with pytest.raises(RuntimeError, match=r"idx2_offset must be in \[0, 2\^31\)"):
        ops.sparse_attn_decode(q, kv, idx, sink, 1.0, None, 0, idx, -1)
    with pytest.raises(RuntimeError, match="kv_batch must be 0 or divide B = 2, got 3"):
        ops.sparse_attn_decode(q, kv, idx, sink, 1.0, None, 0, None, 0, 3)
    with pytest.raises(RuntimeError, match=r"kv must be \[B' >= kv_batch = 2"):
        ops.sparse_attn_decode(q.repeat(2, 1, 1), kv[:1], idx.repeat(2, 1), sink, 1.0, None, 0, None, 0, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        q, kv, idx, sink = case(2, 8, 64, 30, 20, dtype, gen, kv_rows=3)
        torch.library.opcheck(ops.sparse_attn_decode.default,
                              (q.to(device), kv.to(device), idx.int().to(device), sink.to(device), 0.125))
        torch.library.opcheck(ops.sparse_attn_decode.default,
                              (q.to(device), kv.to(device), idx[:, :8].int().to(device), sink.to(device), 0.125,
                               None, 0, idx[:, 8:].int().to(device), 5))


def test_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(4)
    q, kv, idx, sink = case(2, 4, 32, 16, 10, torch.float32, gen)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(q, kv, idx, sink):
        return ops.sparse_attn_decode(q * 2, kv, idx.int(), sink, 0.5) + 1.0

    torch.testing.assert_close(f(q, kv, idx, sink), ops.sparse_attn_decode(q * 2, kv, idx.int(), sink, 0.5) + 1.0,
                               rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(5)
    q, kv, idx, sink = (t.cuda() for t in case(1, 64, 512, 1152, 640, torch.bfloat16, gen))
    idx = idx.int()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = ops.sparse_attn_decode(q, kv, idx, sink, 512 ** -0.5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(first, ops.sparse_attn_decode(q, kv, idx, sink, 512 ** -0.5))  # deterministic
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.sparse_attn_decode(q, kv, idx, sink, 512 ** -0.5)
    q2, kv2, idx2, _ = case(1, 64, 512, 1152, 640, torch.bfloat16, gen)
    q.copy_(q2.cuda())
    kv.copy_(kv2.cuda())
    idx.copy_(idx2.int().cuda())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.sparse_attn_decode(q, kv, idx, sink, 512 ** -0.5))
    assert math.isfinite(float(out.float().abs().max()))


def test_model_picks_the_op_by_size():
    """Decode calls the op whenever its tensor-core kernel runs (bf16, head dim % 64 == 0; not under the
    attn_kernel="simt" override, read when the step is built), else up to FUSED_ATTN_MAX_ROWS (batch x listed
    rows) and the tensor-op form above; DecodeOptions.attention forces either, the op only where kv has q's dtype
    (Attention.fused_attention with the answers its alloc_runtime asks)."""
    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.attention import Attention
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.decode_options import DecodeOptions
    from dsv4_model.model.step_values import DecodeStep
    from dsv4_ops import supports
    from dsv4_ops.supports import FUSED_ATTN_MAX_ROWS as limit

    def layer(dtype, head_dim):
        a = Attention(ModelConfig(**{**TINY_CONFIG, "head_dim": head_dim}), 0, dtype, 1, 64)
        a.ring = a.window
        a.alloc_runtime("meta", dtype)
        return a

    def step(attention="auto"):
        return DecodeStep(torch.zeros(1, dtype=torch.long), DecodeOptions(attention=attention), {}, {}, None, {})

    auto, fused, torch_form = step(), step("fused"), step("torch")
    bf16, fp32, odd = layer(torch.bfloat16, 512), layer(torch.float32, 512), layer(torch.bfloat16, 72)
    for a in (fp32, odd):
        assert a.fused_attention(1, limit, auto)
        assert a.fused_attention(4, limit // 4, auto)
        assert not a.fused_attention(8, limit // 4, auto)
    assert bf16.fused_attention(64, limit, auto)
    with kernel_overrides(attn_kernel="simt"):
        simt = step()
    assert not bf16.fused_attention(8, limit // 4, simt) and bf16.fused_attention(64, limit, auto)
    assert fp32.fused_attention(8, limit, fused)
    assert not supports.sparse_attn_decode(torch.float32, torch.bfloat16)
    fp32.use_attn_op = False  # kv_cache not in q's dtype
    assert not fp32.fused_attention(1, 1, fused)
    assert not bf16.fused_attention(1, 1, torch_form)
    with pytest.raises(ValueError, match="attention must be one of"):
        DecodeOptions(attention="tensor")


# ------------------------------------------------------------------------- the output's inverse RoPE (out_rope)
def rope_case(B, rope, gen):
    ang = torch.rand(B, rope // 2, generator=gen) * 6.3
    return torch.stack([ang.cos(), ang.sin()], -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_rope_is_the_model_step(device, dtype):
    """With out_rope the op's output is the plain output through Attention._out's inverse RoPE (apply_rope with
    inverse=True) bit for bit (CUDA: the combine kernel rotates the values it rounded; the rest of the row is
    untouched), and the reference's to rounding; a forward rotation is far."""
    from dsv4_model.model.layers import apply_rope

    B, H, D, N, J, rope = 2, 12, 128, 40, 24, 64
    gen = torch.Generator().manual_seed(31)
    q, kv, idx, sink = case(B, H, D, N, J, dtype, gen, kv_rows=B + 1)
    cs = rope_case(B, rope, gen)
    args = [t.to(device) for t in (q, kv, idx, sink)]
    plain = ops.sparse_attn_decode(*args, D ** -0.5)
    got = ops.sparse_attn_decode(*args, D ** -0.5, cs.to(device), rope)
    assert torch.equal(got, apply_rope(plain, cs.to(device).unsqueeze(-3), rope, inverse=True))
    assert torch.equal(got[..., :D - rope], plain[..., :D - rope])
    want = ref.sparse_attn_decode_ref(q, kv, idx, sink, D ** -0.5, cs, rope)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    forward = apply_rope(plain, cs.to(device).unsqueeze(-3), rope)
    assert float((got.float() - forward.float()).abs().max()) > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_out_rope_opcheck_and_bad_arguments(device):
    gen = torch.Generator().manual_seed(32)
    q, kv, idx, sink = (t.to(device) for t in case(2, 4, 64, 20, 10, torch.bfloat16, gen, kv_rows=3))
    cs = rope_case(2, 16, gen).to(device)
    torch.library.opcheck(ops.sparse_attn_decode.default, (q, kv, idx.int(), sink, 0.125, cs, 16))
    with pytest.raises(RuntimeError, match="rope_dim must be 0 without out_rope"):
        ops.sparse_attn_decode(q, kv, idx, sink, 0.125, None, 16)
    with pytest.raises(RuntimeError, match=r"out_rope must be float32 \[B = 2, rope_dim / 2 = 8, 2\]"):
        ops.sparse_attn_decode(q, kv, idx, sink, 0.125, cs[:1], 16)
    with pytest.raises(RuntimeError, match="rope_dim must be a multiple of 4"):
        ops.sparse_attn_decode(q, kv, idx, sink, 0.125, cs[:, :3], 6)


@pytest.mark.parametrize("device", DEVICES)
def test_model_decode_with_out_rope(monkeypatch, device):
    """The decode step with the output's inverse RoPE inside the attention op (every layer's call passes out_rope)
    gives the logits of a prefill of the same tokens (its separate rotation), fp32."""
    from decode_counting import decode_counting

    from dsv4_model.model.decode_options import DecodeOptions

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    real, rotated = ops.sparse_attn_decode, []
    monkeypatch.setattr(ops, "sparse_attn_decode",
                        lambda *a: rotated.append(len(a) > 5 and a[5] is not None) or real(*a))  # a[5]: out_rope
    decode, prefill, calls, _ = decode_counting(monkeypatch, "sparse_attn_decode", steps=5,
                                                options=DecodeOptions(attention="fused"), device=device,
                                                n_layers=3, compress_ratios=[0, 4, 16])
    assert calls == 3 * 5 and rotated == [True] * calls
    torch.testing.assert_close(decode, prefill, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_decode_with_the_top_k_as_second_list(monkeypatch, device, dtype):
    """A CSA layer passes the step's shared window rows and its indexer's top-k (idx2 at offset window) instead
    of a joined row list: its calls carry idx2, and the logits are a prefill's of the same tokens (fp32 to
    summation-order rounding, bf16 within bf16 noise). index_head_dim 128: the width the CUDA scoring kernel
    takes (else the indexer scores unpacked keys and there is no raw top-k to pass)."""
    from decode_counting import decode_counting

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    real, second = ops.sparse_attn_decode, []
    monkeypatch.setattr(ops, "sparse_attn_decode",
                        lambda *a: second.append(len(a) > 7 and a[7] is not None) or real(*a))  # a[7]: idx2
    decode, prefill, calls, cfg = decode_counting(monkeypatch, "sparse_attn_decode", steps=4, device=device,
                                                  dtype=dtype, n_layers=2, compress_ratios=[4, 0],
                                                  index_head_dim=128)
    assert calls == 2 * 4
    assert sum(second) == 4  # the CSA layer once per step
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(decode, prefill, **tol)

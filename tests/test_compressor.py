"""dsv4::compressor_decode (a KV compressor's decode step: the token into its state slot, the gated pooling of
the window, the overlap shift) against the pure-PyTorch reference (dsv4_ops/reference/: the tensor ops of
dsv4_model.model.compressor.Compressor.decode), step after step across window boundaries; opcheck, torch.compile with
the states as mutated buffers, a captured CUDA graph, and the model's decode with and without the op.

Tolerance: pooled is a softmax-weighted sum over the window's rows in fp32; the CPU kernel sums in row order, the
CUDA kernel merges 8 online-softmax partials: a few fp32 ulps of the largest term (rtol 1e-5, atol 1e-6). The
states are copies: exact."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from decode_counting import decode_counting

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def fresh_state(rows, R, C, device):
    return (torch.zeros(rows, R, C, device=device), torch.full((rows, R, C), float("-inf"), device=device))


# (B, state rows, m, hd, overlap, positions dtype): V4's CSA compressor (m 4, overlapping, 512) and its indexer's
# (128), HCA (m 128, 512), a ratio that is not a power of 2, hd not a multiple of the CUDA kernel's 32 columns
CASES = [(1, 2, 4, 512, True, torch.int64), (3, 4, 4, 128, True, torch.int32), (2, 2, 128, 512, False, torch.int64),
         (2, 3, 6, 40, False, torch.int64), (3, 3, 3, 72, True, torch.int64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,rows,m,hd,overlap,pdtype", CASES)
def test_matches_reference_step_by_step(device, B, rows, m, hd, overlap, pdtype):
    gen = torch.Generator().manual_seed(B * 100 + m + hd)
    C = 2 * hd if overlap else hd
    R = 2 * m if overlap else m
    ape = torch.randn(m, C, generator=gen)
    ks, ss = fresh_state(rows, R, C, device)
    rks, rss = fresh_state(rows, R, C, "cpu")
    start = torch.randint(0, 3 * m, (B,), generator=gen)  # rows at different points of their windows
    steps = 2 * m + 3 if m <= 8 else m + 5  # crosses a window boundary (HCA: one, at step m - start)
    for t in range(steps):
        kv = torch.randn(B, C, generator=gen)
        score = torch.randn(B, C, generator=gen) * 3
        pos = (start + t).to(pdtype)
        pooled = torch.full((B, hd), float("nan"), device=device)
        ops.compressor_decode(kv.to(device), score.to(device), ape.to(device), pos.to(device), ks, ss, pooled)
        want = ref.compressor_decode_ref(kv, score, ape, pos, rks, rss)
        torch.testing.assert_close(pooled.cpu(), want, rtol=1e-5, atol=1e-6, msg=f"step {t}")
        assert torch.equal(ks.cpu(), rks) and torch.equal(ss.cpu(), rss), f"state differs at step {t}"
    assert torch.isfinite(ss[:B]).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,hd,overlap,spare", [(4, 128, True, 4), (4, 40, True, 0), (4, 40, False, 0),
                                                 (16, 72, False, 2), (16, 72, False, 4), (128, 64, False, 4)])
def test_kv_batch_advances_each_sequence_in_order(device, m, hd, overlap, spare):
    """kv_batch = S: T tokens of S sequences (token-major) in one call give what T calls of one token per sequence
    give, states and pooled bit for bit (windows close inside a call, twice at m = 4: two shifts of the shifted
    state in one call; the state indexed by position with spare slots, fewer and more than T - 1 of them, HCA's
    m = 128 among them); the reference too; opcheck."""
    gen = torch.Generator().manual_seed(m * 10 + spare + 7)
    S, T, C = 3, 5, (2 * hd if overlap else hd)
    R = (2 * m if overlap else m) + spare
    ape = torch.randn(m, C, generator=gen)
    one, many, ref_states = fresh_state(S, R, C, device), fresh_state(S, R, C, device), fresh_state(S, R, C, "cpu")
    start = torch.tensor([m - 3, 2, m + 1])  # m = 16: rows 0 and 2 close a window in the first / third call
    for call in range(3):
        pos = start.repeat(T) + call * T + torch.arange(T).repeat_interleave(S)  # token t of row b at start_b + t
        kv, score = torch.randn(T * S, C, generator=gen), torch.randn(T * S, C, generator=gen) * 3
        want = torch.empty(T * S, hd, device=device)
        for t in range(T):
            r = slice(t * S, (t + 1) * S)
            ops.compressor_decode(kv[r].to(device), score[r].to(device), ape.to(device), pos[r].to(device), *one,
                                  want[r])
        got = torch.full((T * S, hd), float("nan"), device=device)
        ops.compressor_decode(kv.to(device), score.to(device), ape.to(device), pos.to(device), *many, got, S)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(many, one)), f"call {call}"
        r = ref.compressor_decode_ref(kv, score, ape, pos, *ref_states, overlap=overlap, kv_batch=S)
        torch.testing.assert_close(got.cpu(), r, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(ops.compressor_decode.default, (kv.to(device), score.to(device), ape.to(device),
                                                          pos.to(device), *many, got, S))
    with pytest.raises(RuntimeError, match="kv_batch must be 0 or divide B = 15, got 2"):
        ops.compressor_decode(kv, score, ape, pos, *fresh_state(S, R, C, "cpu"), torch.empty(T * S, hd), 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,hd,overlap,spare", [(4, 128, True, 1), (4, 40, True, 3), (16, 72, False, 2),
                                                 (3, 64, False, 3)])
def test_by_position_matches_reference_step_by_step(device, m, hd, overlap, spare):
    """States of c*m + spare rows are indexed by position (Transformer(spare_window_slots=)): the token into row
    p mod R, the window read by position, no shift; rows at different positions, positions below 0 unwritten."""
    gen = torch.Generator().manual_seed(m * 10 + spare)
    B, C = 3, (2 * hd if overlap else hd)
    R = (2 * m if overlap else m) + spare
    ape = torch.randn(m, C, generator=gen)
    ks, ss = fresh_state(B, R, C, device)
    rks, rss = fresh_state(B, R, C, "cpu")
    start = torch.tensor([0, 1, m + 2])
    for t in range(3 * m + 2):
        kv, score = torch.randn(B, C, generator=gen), torch.randn(B, C, generator=gen) * 3
        pooled = torch.full((B, hd), float("nan"), device=device)
        ops.compressor_decode(kv.to(device), score.to(device), ape.to(device), (start + t).to(device), ks, ss, pooled)
        want = ref.compressor_decode_ref(kv, score, ape, start + t, rks, rss, overlap=overlap)
        torch.testing.assert_close(pooled.cpu(), want, rtol=1e-5, atol=1e-6, msg=f"step {t}")
        assert torch.equal(ks.cpu(), rks) and torch.equal(ss.cpu(), rss), f"state differs at step {t}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,overlap", [(4, True), (16, False)])
def test_by_position_pools_a_closed_window_as_the_shifted_state(device, m, overlap):
    """Where a window closes, the position-indexed state pools exactly what the shifted one does (the same rows in
    the same order and arithmetic: a model with spare slots gives the plain model's entries bit for bit), also
    after tokens written ahead at later positions were discarded and those positions decoded again (a speculative
    step's rejected drafts)."""
    gen = torch.Generator().manual_seed(m)
    B, hd, spare = 2, 48, 2
    C = 2 * hd if overlap else hd
    cm = 2 * m if overlap else m
    ape = torch.randn(m, C, generator=gen).to(device)
    shifted = fresh_state(B, cm, C, device)
    by_pos = fresh_state(B, cm + spare, C, device)
    toks = [(torch.randn(B, C, generator=gen).to(device), (torch.randn(B, C, generator=gen) * 3).to(device))
            for _ in range(4 * m)]
    closed = 0
    for t, (kv, score) in enumerate(toks):
        pos = torch.full((B,), t, device=device)
        if t % 3 == 1:  # junk written ahead at t .. t + spare - 1, then t decoded again
            for j in range(spare):
                junk = torch.randn(B, C, generator=gen).to(device)
                ops.compressor_decode(junk, junk, ape, pos + j, *by_pos, torch.empty(B, hd, device=device))
        a, b = torch.empty(B, hd, device=device), torch.empty(B, hd, device=device)
        ops.compressor_decode(kv, score, ape, pos, *shifted, a)
        ops.compressor_decode(kv, score, ape, pos, *by_pos, b)
        if (t + 1) % m == 0:
            assert torch.equal(a, b), f"position {t}"
            closed += 1
    assert closed == 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pooled_in_a_narrow_dtype_is_the_fp32_pooling_rounded(device, dtype):
    """pooled bf16 / fp16: the op's fp32 pooling rounded once (what .to(dtype) gives, bit for bit), same states."""
    gen = torch.Generator().manual_seed(17)
    B, m, hd = 3, 4, 72  # hd not a multiple of the CUDA kernel's 32 columns
    C, R = 2 * hd, 2 * m
    ape = torch.randn(m, C, generator=gen).to(device)
    states = fresh_state(B, R, C, device)
    narrow_states = [s.clone() for s in states]
    for t in range(2 * m + 1):  # across a window boundary (the overlap shift)
        kv = (torch.randn(B, C, generator=gen) * 4).to(device)
        score = (torch.randn(B, C, generator=gen) * 3).to(device)
        pos = torch.tensor([t, t + 1, t + 3], device=device)
        wide = torch.empty(B, hd, device=device)
        narrow = torch.full((B, hd), float("nan"), dtype=dtype, device=device)
        ops.compressor_decode(kv, score, ape, pos, *states, wide)
        ops.compressor_decode(kv, score, ape, pos, *narrow_states, narrow)
        assert torch.equal(narrow, wide.to(dtype)), f"step {t}"
        assert all(torch.equal(a, b) for a, b in zip(states, narrow_states)), f"state differs at step {t}"
    with pytest.raises(RuntimeError, match="pooled must be float32, bfloat16 or float16"):
        ops.compressor_decode(kv, score, ape, pos, *states, torch.empty(B, hd, dtype=torch.float64, device=device))


def test_wrong_steps_are_far():
    """The test above would see a missing shift, a wrong slot or a missing ape: at every step that closes a window
    (the only ones that pool; the others give 0), and a slot one off also closes the wrong windows."""
    gen = torch.Generator().manual_seed(5)
    m, hd, B = 4, 16, 1
    ape = torch.randn(m, 2 * hd, generator=gen)
    ks, ss = fresh_state(B, 2 * m, 2 * hd, "cpu")
    outs = []
    for t in range(4 * m):
        kv, score = torch.randn(B, 2 * hd, generator=gen), torch.randn(B, 2 * hd, generator=gen)
        pooled = torch.empty(B, hd)
        before = ks.clone(), ss.clone()
        ops.compressor_decode(kv, score, ape, torch.tensor([t]), ks, ss, pooled)
        wrong_ape = ref.compressor_decode_ref(kv, score, ape * 0, torch.tensor([t]), *[s.clone() for s in before])
        wrong_slot = ref.compressor_decode_ref(kv, score, ape, torch.tensor([t + 1]), *[s.clone() for s in before])
        outs.append((t, pooled, wrong_ape, wrong_slot))
    closing = [o for o in outs if (o[0] + 1) % m == 0]
    assert len(closing) == 4 and all(float(p.abs().max()) > 1e-3 for _, p, _, _ in closing)
    assert all(float(p.abs().max()) == 0.0 for t, p, _, _ in outs if (t + 1) % m)
    assert all(float((p - a).abs().max()) > 1e-3 for _, p, a, _ in closing)
    assert all(float((p - s).abs().max()) > 1e-3 for t, p, _, s in outs if (t + 1) % m == 0 or (t + 2) % m == 0)


def test_bad_arguments():
    kv, score, ape = torch.randn(2, 32), torch.randn(2, 32), torch.randn(4, 32)
    pos = torch.tensor([0, 1])
    ks, ss = fresh_state(2, 8, 32, "cpu")
    pooled = torch.empty(2, 16)
    with pytest.raises(RuntimeError, match="score must match kv"):
        ops.compressor_decode(kv, score[:, :16], ape, pos, ks, ss, pooled)
    with pytest.raises(RuntimeError, match=r"ape must be \[m >= 1, C = 32\]"):
        ops.compressor_decode(kv, score, ape[:, :8], pos, ks, ss, pooled)
    with pytest.raises(RuntimeError, match="positions must be int64 or int32"):
        ops.compressor_decode(kv, score, ape, pos.float(), ks, ss, pooled)
    with pytest.raises(RuntimeError, match=r"kv_state must be \[>= B = 2, >= 8 \(2m, m = 4\)"):
        ops.compressor_decode(kv, score, ape, pos, ks[:, :5], ss[:, :5], pooled)
    with pytest.raises(RuntimeError, match=r"kv_state must be \[>= B = 2, >= 4 \(m, m = 4\)"):
        ops.compressor_decode(kv, score, ape, pos, ks[:, :3], ss[:, :3], torch.empty(2, 32))
    with pytest.raises(RuntimeError, match=r"pooled must be a contiguous \[B = 2, C = 32 or C / 2"):
        ops.compressor_decode(kv, score, ape, pos, ks, ss, torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="kv_state must be float32"):
        ops.compressor_decode(kv, score, ape, pos, ks.double(), ss, pooled)
    with pytest.raises(RuntimeError, match="must be distinct"):
        ops.compressor_decode(kv, score, ape, pos, ks, ks, pooled)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(6)
    for m, hd, overlap, dtype, spare in ((4, 32, True, torch.float32, 0), (8, 40, False, torch.float32, 0),
                                         (4, 32, True, torch.bfloat16, 0), (4, 32, True, torch.float32, 3),
                                         (8, 40, False, torch.bfloat16, 8)):
        C, R = (2 * hd, 2 * m + spare) if overlap else (hd, m + spare)
        ks, ss = fresh_state(3, R, C, device)
        ss.normal_(generator=None)
        args = (torch.randn(2, C, generator=gen).to(device), torch.randn(2, C, generator=gen).to(device),
                torch.randn(m, C, generator=gen).to(device), torch.tensor([3, 8], device=device), ks, ss,
                torch.empty(2, hd, dtype=dtype, device=device))
        torch.library.opcheck(ops.compressor_decode.default, args)


def test_compile_fullgraph_mutates_buffers():
    """Inside torch.compile(fullgraph=True) the op writes a module's state buffers as in eager."""
    from torch._dynamo.utils import counters

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("ks", torch.zeros(2, 8, 64))
            self.register_buffer("ss", torch.full((2, 8, 64), float("-inf")))
            self.register_buffer("ape", torch.randn(4, 64, generator=torch.Generator().manual_seed(1)))

        def forward(self, kv, score, pos):
            pooled = torch.empty(kv.shape[0], 32)
            ops.compressor_decode(kv * 2, score, self.ape, pos, self.ks, self.ss, pooled)
            return pooled + 1

    counters.clear()
    eager, compiled = Step(), Step()
    fn = torch.compile(compiled, fullgraph=True, backend="inductor")
    gen = torch.Generator().manual_seed(2)
    for t in range(6):
        kv, score, pos = torch.randn(2, 64, generator=gen), torch.randn(2, 64, generator=gen), torch.tensor([t, t + 2])
        torch.testing.assert_close(fn(kv, score, pos), eager(kv, score, pos), rtol=0, atol=0)
    assert torch.equal(compiled.ks, eager.ks) and torch.equal(compiled.ss, eager.ss)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(3)
    m, hd = 4, 512
    ape = torch.randn(m, 2 * hd, generator=gen).cuda()
    ks, ss = fresh_state(2, 2 * m, 2 * hd, "cuda")
    rks, rss = fresh_state(2, 2 * m, 2 * hd, "cpu")
    kv, score, pos = torch.zeros(2, 2 * hd, device="cuda"), torch.zeros(2, 2 * hd, device="cuda"), \
        torch.zeros(2, dtype=torch.long, device="cuda")
    pooled = torch.empty(2, hd, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.compressor_decode(kv, score, ape, pos, ks.clone(), ss.clone(), pooled)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.compressor_decode(kv, score, ape, pos, ks, ss, pooled)
    for t in range(2 * m + 1):  # replays with new tokens and positions, across a window boundary
        k2, s2, p2 = torch.randn(2, 2 * hd, generator=gen), torch.randn(2, 2 * hd, generator=gen), \
            torch.tensor([t, t + 1])
        kv.copy_(k2.cuda()), score.copy_(s2.cuda()), pos.copy_(p2.cuda())
        g.replay()
        want = ref.compressor_decode_ref(k2, s2, ape.cpu(), p2, rks, rss)
        torch.testing.assert_close(pooled.cpu(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(ks.cpu(), rks) and torch.equal(ss.cpu(), rss)


@pytest.mark.parametrize("device", DEVICES)
def test_model_decode_through_the_op(monkeypatch, device):
    """The decode step through dsv4::compressor_decode gives the logits of a prefill of the same tokens (the
    compressors' tensor ops over whole windows), fp32, over enough steps to close CSA (ratio 4) and HCA (ratio 16)
    windows; the op runs once per compressor and step (the CSA layer's and its indexer's, the HCA layer's)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    decode, prefill, calls, _ = decode_counting(monkeypatch, "compressor_decode", steps=8, device=device,
                                                n_layers=3, compress_ratios=[0, 4, 16])
    assert calls == 3 * 8
    torch.testing.assert_close(decode, prefill, rtol=1e-4, atol=1e-4)

"""dsv4::indexer_store_keys (a closed window's indexer key into the float cache and, as FP4 codes + UE8M0
exponents, into the packed caches) against the pure-PyTorch reference (dsv4_ops/reference/: the decode step's
writes with indexer_fp4_quantize_keys): every byte of every cache equal, step after step across window
boundaries; opcheck, torch.compile with the caches as mutated buffers, a captured CUDA graph, and the model's
decode with and without the op."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from decode_counting import decode_counting

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def caches(rows, n, D, dtype, device):
    return (torch.zeros(rows, n, D, dtype=dtype, device=device), torch.zeros(rows, n, D // 2, dtype=torch.uint8,
                                                                           device=device),
            torch.zeros(rows, n, D // 32, dtype=torch.uint8, device=device))


def fp4_keys(B, D, dtype, gen):
    """FP4-rounded keys (what the indexer stores), with a zero block and a tiny one (the exponent floor)."""
    from dsv4_model.model.quant_sim import indexer_fake_quant

    k = indexer_fake_quant(torch.randn(B, D, generator=gen) * 3).to(dtype)
    k[0, :32] = 0
    k[-1, 32:64] *= 1e-30
    return k


# (B, cache rows, n entries, D, ratio, dtype, positions dtype): V4 (D 128, ratio 4), the other kernel widths,
# a ratio that fills the last slot twice (n smaller than the positions reach: the slot is clamped)
CASES = [(1, 2, 8, 128, 4, torch.bfloat16, torch.int64), (3, 4, 6, 128, 4, torch.float32, torch.int32),
         (2, 2, 3, 64, 3, torch.bfloat16, torch.int64), (2, 3, 4, 256, 2, torch.float32, torch.int64),
         (2, 2, 4, 512, 4, torch.bfloat16, torch.int64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,rows,n,D,ratio,dtype,pdtype", CASES)
def test_matches_reference_step_by_step(device, B, rows, n, D, ratio, dtype, pdtype):
    gen = torch.Generator().manual_seed(B * 100 + n + D + ratio)
    got, want = caches(rows, n, D, dtype, device), caches(rows, n, D, dtype, "cpu")
    start = torch.randint(0, 2 * ratio, (B,), generator=gen)
    for t in range(ratio * (n + 1)):  # past the last slot: the clamped slot is rewritten
        keys, pos = fp4_keys(B, D, dtype, gen), (start + t).to(pdtype)
        ops.indexer_store_keys(keys.to(device), pos.to(device), ratio, *got)
        ref.indexer_store_keys_ref(keys, pos, ratio, *want)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w), f"step {t}"
    assert int(got[1].count_nonzero()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_kv_batch_is_each_token_in_turn(device):
    """kv_batch = S: 4 tokens of 3 sequences (token-major, ratio 4: each sequence closes one window in the call)
    written in one call leave every cache byte where 4 calls of one token per sequence do; the reference too."""
    gen = torch.Generator().manual_seed(12)
    T, S, n, D = 4, 3, 6, 128
    keys = fp4_keys(T * S, D, torch.bfloat16, gen)
    pos = torch.tensor([2, 9, 13]).repeat(T) + torch.arange(T).repeat_interleave(S)
    want, got, refd = (caches(S + 1, n, D, torch.bfloat16, dev) for dev in (device, device, "cpu"))
    for t in range(T):
        r = slice(t * S, (t + 1) * S)
        ops.indexer_store_keys(keys[r].to(device), pos[r].to(device), 4, *want)
    ops.indexer_store_keys(keys.to(device), pos.to(device), 4, *got, S)
    ref.indexer_store_keys_ref(keys, pos, 4, *refd, S)
    for g, w, r in zip(got, want, refd):
        assert torch.equal(g, w) and torch.equal(g.cpu(), r)
    assert int(got[1].count_nonzero()) > 0
    torch.library.opcheck(ops.indexer_store_keys.default,
                          (keys.to(device), pos.to(device), 4, *caches(S, n, D, torch.bfloat16, device), S))
    with pytest.raises(RuntimeError, match="kv_batch must be 0 or divide B = 12, got 5"):
        ops.indexer_store_keys(keys, pos, 4, *caches(S, n, D, torch.bfloat16, "cpu"), 5)


def test_bad_arguments():
    keys, pos = torch.randn(2, 128), torch.tensor([3, 7])
    kv, codes, scales = caches(2, 4, 128, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="keys must be \\[B, D\\] with D a positive multiple of 32"):
        ops.indexer_store_keys(keys[:, :40].contiguous(), pos, 4, kv, codes, scales)
    with pytest.raises(RuntimeError, match="kv_cache must be a contiguous"):
        ops.indexer_store_keys(keys, pos, 4, kv.bfloat16(), codes, scales)
    with pytest.raises(RuntimeError, match=r"k_codes must be a contiguous uint8 \[2, 4, D / 2 = 64\]"):
        ops.indexer_store_keys(keys, pos, 4, kv, codes[..., :32], scales)
    with pytest.raises(RuntimeError, match="ratio must be >= 1"):
        ops.indexer_store_keys(keys, pos, 0, kv, codes, scales)
    with pytest.raises(RuntimeError, match=r"positions must be \[B = 2\]"):
        ops.indexer_store_keys(keys, pos[:1], 4, kv, codes, scales)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        keys = fp4_keys(2, 128, dtype, gen).to(device)
        torch.library.opcheck(ops.indexer_store_keys.default,
                              (keys, torch.tensor([3, 6], device=device), 4, *caches(3, 4, 128, dtype, device)))


def test_compile_fullgraph_mutates_buffers():
    from torch._dynamo.utils import counters

    class Store(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, t in zip(("kv", "codes", "scales"), caches(2, 4, 64, torch.float32, "cpu")):
                self.register_buffer(name, t)

        def forward(self, keys, pos):
            ops.indexer_store_keys(keys * 1, pos, 2, self.kv, self.codes, self.scales)
            return self.kv.sum()

    counters.clear()
    eager, compiled = Store(), Store()
    fn = torch.compile(compiled, fullgraph=True, backend="inductor")
    gen = torch.Generator().manual_seed(5)
    for t in range(6):
        keys, pos = fp4_keys(2, 64, torch.float32, gen), torch.tensor([t, t + 1])
        torch.testing.assert_close(fn(keys, pos), eager(keys, pos), rtol=0, atol=0)
    for a, b in ((compiled.kv, eager.kv), (compiled.codes, eager.codes), (compiled.scales, eager.scales)):
        assert torch.equal(a, b)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(6)
    got, want = caches(2, 4, 128, torch.bfloat16, "cuda"), caches(2, 4, 128, torch.bfloat16, "cpu")
    keys = torch.zeros(2, 128, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(2, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.indexer_store_keys(keys, pos + 1, 4, *caches(2, 4, 128, torch.bfloat16, "cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.indexer_store_keys(keys, pos, 4, *got)
    for t in range(12):
        k2, p2 = fp4_keys(2, 128, torch.bfloat16, gen), torch.tensor([t, t + 2])
        keys.copy_(k2.cuda()), pos.copy_(p2.cuda())
        g.replay()
        ref.indexer_store_keys_ref(k2, p2, 4, *want)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_model_decode_through_the_op(monkeypatch, device):
    """The decode step through dsv4::indexer_store_keys gives the logits of a prefill of the same tokens (fp32,
    over two closed windows); the op runs once per step for the CSA layer."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    decode, prefill, calls, _ = decode_counting(monkeypatch, "indexer_store_keys", steps=9, device=device,
                                                max_seq_len=32, n_layers=2, compress_ratios=[0, 4],
                                                index_head_dim=128)  # the width the CUDA scoring kernel takes
    assert calls == 9
    torch.testing.assert_close(decode, prefill, rtol=1e-4, atol=1e-4)

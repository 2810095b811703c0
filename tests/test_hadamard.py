"""dsv4::hadamard_fp4 (the indexer's RoPE + Walsh-Hadamard rotation + simulated FP4 rounding of its queries and
keys) against the model's own steps (dsv4_model.model.layers.apply_rope, quant_sim.indexer_fake_quant: the same
butterfly, so the same bits) and against an independent reference (dsv4_ops/reference/: the rotation as a
float64 product with the Sylvester matrix, so a value may round to a neighbouring FP4 code where the fp32 sums
straddle a rounding boundary); CUDA against CPU bit for bit; opcheck, torch.compile, a captured CUDA graph, and
the model's decode with and without the op."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from decode_counting import decode_counting

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def case(rows, heads, d, rope, dtype, gen):
    x = (torch.randn(rows, heads, d, generator=gen) * 3).to(dtype)
    ang = torch.rand(rows, rope // 2, generator=gen) * 6.3
    return x, (torch.stack([ang.cos(), ang.sin()], -1) if rope else None)


def model_steps(x, cs, rope):
    from dsv4_model.model.layers import apply_rope
    from dsv4_model.model.quant_sim import indexer_fake_quant

    return indexer_fake_quant(apply_rope(x, cs.unsqueeze(1), rope) if rope else x)


# (rows, heads, d, rope_dim, dtype): V4 indexer queries (64 heads x 128, rope 64) at batch 1 / 3, its keys (one
# per row, no rope), the other kernel widths, and a width only the CPU kernel takes
CASES = [(1, 64, 128, 64, torch.bfloat16), (3, 64, 128, 64, torch.float32), (4, 1, 128, 0, torch.bfloat16),
         (2, 3, 64, 16, torch.float32), (2, 5, 256, 64, torch.bfloat16), (2, 2, 32, 0, torch.float32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,heads,d,rope,dtype", CASES)
def test_matches_model_steps_and_reference(device, rows, heads, d, rope, dtype):
    if device == "cuda" and d not in (64, 128, 256):
        pytest.skip("the CUDA kernel takes d = 64 / 128 / 256")
    gen = torch.Generator().manual_seed(rows * 100 + heads + d + rope)
    x, cs = case(rows, heads, d, rope, dtype, gen)
    x[0, 0, :32] = 0  # a block of zeros: the amax floor
    got = ops.hadamard_fp4(x.to(device), cs.to(device) if cs is not None else None, rope).cpu()
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got, model_steps(x, cs, rope))  # the same butterfly and roundings: the same bits
    want = ref.hadamard_fp4_ref(x, cs, rope)
    differ = got != want
    assert float(differ.float().mean()) < 0.01
    # a differing value is a neighbouring FP4 code: within the block's largest step (2 * scale <= amax / 1.5)
    amax = want.float().unflatten(-1, (d // 32, 32)).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 32).flatten(-2)
    assert bool(((got.float() - want.float()).abs() <= amax / 1.5 + 1e-30).all())


def test_wrong_steps_are_far():
    gen = torch.Generator().manual_seed(1)
    x, cs = case(2, 4, 128, 64, torch.float32, gen)
    got = ops.hadamard_fp4(x, cs, 64)
    from dsv4_model.model.quant_sim import fp4_e2m1_block_fake_quant

    for wrong in (ops.hadamard_fp4(x, cs[[1, 0]], 64), fp4_e2m1_block_fake_quant(x),
                  ops.hadamard_fp4(x, torch.stack([cs[..., 0], -cs[..., 1]], -1), 64)):
        assert float((got - wrong).abs().max()) > 0.1


def test_bad_arguments():
    gen = torch.Generator().manual_seed(2)
    x, cs = case(2, 3, 128, 64, torch.float32, gen)
    with pytest.raises(RuntimeError, match=r"d must be a power of two in \[32, 4096\], got 96"):
        ops.hadamard_fp4(x[..., :96].contiguous(), None, 0)
    with pytest.raises(RuntimeError, match="cs must be given exactly when rope_dim > 0"):
        ops.hadamard_fp4(x, None, 64)
    with pytest.raises(RuntimeError, match=r"cs must be float32 \[rows = 2, rope_dim / 2 = 32, 2\]"):
        ops.hadamard_fp4(x, cs[:1], 64)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        ops.hadamard_fp4(x.half(), cs, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    for dtype, rope in ((torch.bfloat16, 64), (torch.float32, 0)):
        x, cs = case(2, 3, 128, rope, dtype, gen)
        torch.library.opcheck(ops.hadamard_fp4.default, (x.to(device), cs.to(device) if cs is not None else None,
                                                          rope))


def test_compile_fullgraph():
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(4)
    x, cs = case(2, 3, 128, 64, torch.float32, gen)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(x):
        return ops.hadamard_fp4(x * 2, cs, 64) + 1

    assert torch.equal(f(x), ops.hadamard_fp4(x * 2, cs, 64) + 1)
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    gen = torch.Generator().manual_seed(5)
    x, cs = case(2, 64, 128, 64, torch.bfloat16, gen)
    x, cs = x.cuda(), cs.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.hadamard_fp4(x, cs, 64)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.hadamard_fp4(x, cs, 64)
    x2 = case(2, 64, 128, 64, torch.bfloat16, gen)[0]
    x.copy_(x2.cuda())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ops.hadamard_fp4(x2, cs.cpu(), 64))


@pytest.mark.parametrize("device", DEVICES)
def test_model_decode_through_the_op(monkeypatch, device):
    """The decode step through dsv4::hadamard_fp4 gives the logits of a prefill of the same tokens (the tensor
    ops; fp32); the op runs for the CSA layer's indexer queries and keys each step."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    decode, prefill, calls, _ = decode_counting(monkeypatch, "hadamard_fp4", steps=6, device=device,
                                                max_seq_len=32, n_layers=2, compress_ratios=[0, 4],
                                                index_head_dim=64)  # a width the kernels take
    assert calls == 2 * 6
    torch.testing.assert_close(decode, prefill, rtol=1e-4, atol=1e-4)

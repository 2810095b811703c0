"""Simulated FP8 / FP4 rounding (dsv4_model.model.quant_sim) on hand-computed cases."""

import pytest
import torch

from dsv4_model.model.quant_sim import (fp4_e2m1_block_fake_quant, fp8_e4m3_block_fake_quant, hadamard_matrix,
                                  hadamard_rotate, indexer_fake_quant, kv_fake_quant, pow2_ceil, round_to_e2m1)


def test_pow2_ceil():
    x = torch.tensor([1.0, 1.5, 0.3, 3.0, 2.0**-10, 4.0 + 2.0**-20, 1e-30])
    want = torch.tensor([1.0, 2.0, 0.5, 4.0, 2.0**-10, 8.0, 2.0**-99])
    assert torch.equal(pow2_ceil(x), want)


def test_fp8_block64_hand_cases():
    x = torch.zeros(2, 64)
    # block 0: amax 896 -> 896/448 = 2 -> scale 2
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 896.0, 1.0, 3.3, -0.01
    # block 1: amax 500 -> 500/448 = 1.12 -> scale 2; 250 lies between e4m3 240 and 256 (step 16) -> 256
    x[1, 0], x[1, 1] = 500.0, 0.2
    y = fp8_e4m3_block_fake_quant(x, 64)
    assert y[0, 0] == 896.0 and y[0, 1] == 1.0
    assert y[0, 2] == 3.25  # 3.3/2 = 1.65 -> nearest 1.625 (step 1/8 in [1, 2)) -> 3.25
    assert y[0, 3] == -0.01171875  # 0.005 -> e4m3 subnormal grid 2^-9: 0.005/2^-9 = 2.56 -> 3 * 2^-9; *2
    assert y[1, 0] == 512.0
    assert y[1, 1] == 0.203125  # 0.1 -> [2^-4, 2^-3) step 2^-7: 0.1/2^-7 = 12.8 -> 13 * 2^-7 = 0.1015625; *2
    assert torch.count_nonzero(y[0, 4:]) == 0 and torch.count_nonzero(y[1, 2:]) == 0


def test_fp8_blocks_are_independent_and_zero_block_stays_zero():
    x = torch.zeros(128)
    x[64:] = torch.linspace(-1, 1, 64)
    y = fp8_e4m3_block_fake_quant(x, 64)
    assert torch.count_nonzero(y[:64]) == 0
    # amax 1 -> 1/448 -> scale 2^-8; every value is an e4m3 multiple of 2^-8
    q = y[64:] / 2.0**-8
    assert torch.equal(q, q.to(torch.float8_e4m3fn).float())
    assert (y[64:] - x[64:]).abs().max() <= 2.0**-4 * 2.0**-8 * 256 / 2  # half an ulp at the top binade


def test_e2m1_rounding_ties_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -0.25, -2.6, 0.2, 6.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -3.0, 0.0, 6.0])
    assert torch.equal(round_to_e2m1(v), want)


def test_fp4_block32_hand_cases():
    x = torch.zeros(2, 32)
    x[0, :5] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0])  # amax 6 -> scale 1
    x[1, :3] = torch.tensor([7.0, 1.3, -0.4])  # amax 7 -> 7/6 -> scale 2
    y = fp4_e2m1_block_fake_quant(x, 32)
    assert torch.equal(y[0, :5], torch.tensor([6.0, 0.0, 1.0, 2.0, 4.0]))
    # 7/2 = 3.5 -> 4 -> 8; 1.3/2 = 0.65 -> 0.5 -> 1.0; -0.4/2 = -0.2 -> 0
    assert torch.equal(y[1, :3], torch.tensor([8.0, 1.0, 0.0]))


def test_hadamard_sylvester_orthonormal():
    h4 = hadamard_matrix(4)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # rows of H4: ++++, +-+-, ++--, +--+ ; scale 1/2
    assert torch.equal(x @ h4, torch.tensor([5.0, -1.0, -2.0, 0.0]))
    assert torch.equal(hadamard_rotate(x), torch.tensor([5.0, -1.0, -2.0, 0.0]))
    h = hadamard_matrix(128)
    assert torch.allclose(h @ h, torch.eye(128), atol=1e-6)
    assert torch.equal(h, h.T)


def test_hadamard_butterfly_is_the_matrix_product():
    """hadamard_rotate's butterfly (the official fast_hadamard_transform's algorithm) equals x @ H n^-0.5 to fp32
    rounding, for every power of two up to 256, any lead dims, bf16 rounded once at the end."""
    g = torch.Generator().manual_seed(2)
    for n in (1, 2, 8, 32, 128, 256):
        x = torch.randn(3, 5, n, generator=g) * 4
        want = x.double() @ hadamard_matrix(n).double()
        torch.testing.assert_close(hadamard_rotate(x).double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(hadamard_rotate(x.bfloat16()), hadamard_rotate(x.bfloat16().float()).bfloat16())
    with pytest.raises(ValueError, match="not a power of two"):
        hadamard_rotate(torch.zeros(2, 96))


def test_kv_fake_quant_leaves_rope_dims():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 5, 80, generator=g)
    y = kv_fake_quant(kv, 16, 64)
    assert torch.equal(y[..., 64:], kv[..., 64:])
    assert torch.equal(y[..., :64], fp8_e4m3_block_fake_quant(kv[..., :64], 64))
    assert not torch.equal(y[..., :64], kv[..., :64])


def test_indexer_fake_quant_is_fp4_after_rotation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=g)
    y = indexer_fake_quant(x)
    r = hadamard_rotate(x)
    yb, rb = y.view(7, 2, 32), r.view(7, 2, 32)
    s = pow2_ceil(rb.abs().amax(-1, keepdim=True) / 6.0)
    assert torch.equal(round_to_e2m1(yb / s), yb / s)
    assert ((yb - rb).abs() <= s).all()  # within the coarsest e2m1 step (2 * s / 2)


def test_fp4_indexer_key_packing_matches_deepseeks_cache_form():
    # the model's packing (quant_sim) against the oracle's transcription of fp4_act_quant (dsv4_ops.reference),
    # and exact: the packed keys decode to the fake-quantized values
    from dsv4_model.model.quant_sim import fp4_e2m1_block_fake_quant, fp4_pack_indexer_keys
    from dsv4_ops.reference import indexer_fp4_dequantize, indexer_fp4_quantize_keys

    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-3, 1e3, 1e-30):
        for dtype in (torch.float32, torch.bfloat16):
            k = (torch.randn(3, 5, 128, generator=g) * scale).to(dtype)
            k[0, 0, :32] = 0.0
            k[0, 1, :5] = -0.0
            codes, exps = fp4_pack_indexer_keys(k)
            ref_codes, ref_exps = indexer_fp4_quantize_keys(k)
            assert torch.equal(codes, ref_codes) and torch.equal(exps, ref_exps)
            assert torch.equal(indexer_fp4_dequantize(codes, exps), fp4_e2m1_block_fake_quant(k.float()))


def test_training_sinkhorn_matches_the_op_reference():
    from dsv4_model.model.layers import _sinkhorn
    from dsv4_ops.reference import hc_sinkhorn_ref

    logits = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(1))
    for iters in (1, 2, 20):
        assert torch.equal(_sinkhorn(logits, iters, 1e-6), hc_sinkhorn_ref(logits, iters, 1e-6))

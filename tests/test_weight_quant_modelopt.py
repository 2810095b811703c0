"""The weight quantizer (bf16 / fp32 -> NVFP4 at load or conversion) gives NVIDIA ModelOpt's bytes.

The reference transcribes ModelOpt's `NVFP4QTensor.quantize` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py,
dynamic path): global scale amax / (6 * 448), block scale amax_b / (6 * gs) with zeros -> 1 and a 2^-9 floor, cast
to e4m3, values DIVIDED by (block scale * gs), E2M1 by searchsorted over the midpoints with the 0.75 / 1.75 / 3.5
ties bumped up. Where ModelOpt itself is installed the last test compares against it directly.
"""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.quant.nvfp4 import quantize_weight

_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def modelopt_reference(w: torch.Tensor):
    gs = w.float().abs().amax() / (6.0 * 448.0)
    blocks = w.unflatten(-1, (-1, 16))
    scale = blocks.abs().amax(dim=-1).float() / (6.0 * gs)
    scale[scale == 0] = 1.0
    scale = scale.clamp(min=2**-9).to(torch.float8_e4m3fn)
    y = (blocks / (scale.to(torch.float32) * gs).unsqueeze(-1)).flatten(-2)
    sign = (y < 0).to(torch.uint8)
    a = y.abs()
    code = torch.searchsorted(_BOUNDS, a, out_int32=True).to(torch.uint8)
    code += torch.any(a.unsqueeze(-1) == _BOUNDS[[1, 3, 5]], dim=-1).to(torch.uint8)
    q = (sign << 3) + code
    return (q[..., 1::2] << 4) | q[..., 0::2], scale, gs


def _cases():
    g = torch.Generator().manual_seed(2)
    # 32,768 codes of a bf16 randn matrix whose global scale has an inexact reciprocal (seed 2): the activation
    # quantizer's bytes differ from ModelOpt's in 51 codes and some block scales
    w = torch.randn(256, 128, generator=g).bfloat16()
    yield "bf16 randn", w
    w = torch.randn(64, 512, generator=g) * 3.0
    w[0, :16] = 0.0  # a zero block: scale 1
    w[1, 16:32] *= 1e-7  # a block far below the matrix's amax: the 2^-9 scale floor
    w[2, :16] = -0.0
    yield "fp32 with zero / tiny / -0 blocks", w
    yield "bf16 small values", (torch.randn(128, 256, generator=g) * 1e-3).bfloat16()


@pytest.mark.parametrize("name, w", list(_cases()), ids=[c[0] for c in _cases()])
def test_weight_quantizer_matches_modelopt_bytes(name, w):
    packed, scale, gs = quantize_weight(w)
    ref_packed, ref_scale, ref_gs = modelopt_reference(w)
    assert torch.equal(gs, ref_gs)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
    assert torch.equal(packed, ref_packed)


def test_stacked_matrices_quantize_each_with_its_own_global_scale():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 32, 64, generator=g) * torch.tensor([1.0, 10.0, 0.01]).view(3, 1, 1)
    packed, scale, gs = quantize_weight(w)
    assert gs.shape == (3,)
    for e in range(3):
        p, s, gse = modelopt_reference(w[e])
        assert torch.equal(gs[e], gse) and torch.equal(packed[e], p)
        assert torch.equal(scale[e].view(torch.uint8), s.view(torch.uint8))


def test_the_activation_quantizer_keeps_its_own_rounding():
    # dsv4::nvfp4_quantize multiplies by the rounded reciprocal (as TensorRT-LLM's activation quantizer does,
    # docs/ops.md): on this matrix its bytes are not ModelOpt's, which is why weights do not go through it.
    w = next(_cases())[1]
    packed, scale, gs = quantize_weight(w)
    op_packed, op_scale = torch.ops.dsv4.nvfp4_quantize(w.contiguous(), gs)
    assert not torch.equal(op_packed, packed)
    deq = torch.ops.dsv4.nvfp4_dequantize(packed, scale, gs, torch.float32)
    op_deq = torch.ops.dsv4.nvfp4_dequantize(op_packed, op_scale, gs, torch.float32)
    changed = int((deq != op_deq).sum())
    assert 0 < changed < 200  # rare: values that scale onto a rounding boundary, blocks whose scale rounds apart


def test_against_modelopt_itself():
    nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    for _, w in _cases():
        q, s, gs = nvfp4_tensor.NVFP4QTensor.quantize(w.clone(), 16)
        packed, scale, mine_gs = quantize_weight(w)
        assert torch.equal(q._quantized_data, packed) and torch.equal(gs, mine_gs)
        assert torch.equal(s.view(torch.uint8), scale.view(torch.uint8))

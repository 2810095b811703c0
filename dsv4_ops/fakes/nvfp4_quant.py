"""Fakes of the NVFP4 quantization ops (shapes/dtypes only; see docs/ops.md "## NVFP4 quantization")."""
import torch

_FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)


def _check_float(x: torch.Tensor, name: str, multiple: int) -> None:
    torch._check(x.dtype in _FLOAT_IN, lambda: f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    torch._check(x.dim() >= 1, lambda: f"{name} must have at least one dimension")
    torch._check(x.shape[-1] % multiple == 0,
                 lambda: f"the last dimension of {name} ({x.shape[-1]}) must be a multiple of {multiple}")


def _quant_outputs(x: torch.Tensor, K):
    lead = x.shape[:-1]
    return (x.new_empty((*lead, K // 2), dtype=torch.uint8),
            x.new_empty((*lead, K // 16), dtype=torch.float8_e4m3fn))


def _global_scale(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    return x.new_empty(x.shape[:-1] if per_row else (), dtype=torch.float32)


@torch.library.register_fake("dsv4::nvfp4_quantize")
def _nvfp4_quantize(x, global_scale):
    _check_float(x, "x", 16)
    torch._check(global_scale.dtype == torch.float32, lambda: "global_scale must be float32")
    torch._check(global_scale.dim() == 0 or tuple(global_scale.shape) == tuple(x.shape[:-1]),
                 lambda: "global_scale must be 0-d or have the leading shape of x")
    return _quant_outputs(x, x.shape[-1])


@torch.library.register_fake("dsv4::nvfp4_dequantize")
def _nvfp4_dequantize(packed, block_scale, global_scale, dtype):
    torch._check(packed.dtype == torch.uint8, lambda: "packed must be uint8")
    torch._check(block_scale.dtype in (torch.float8_e4m3fn, torch.uint8),
                 lambda: "block_scale must be float8_e4m3fn (or uint8 holding e4m3 bits)")
    torch._check(packed.shape[-1] == block_scale.shape[-1] * 8, lambda: "packed.shape[-1] != 8 * block_scale.shape[-1]")
    torch._check(dtype in _FLOAT_IN, lambda: f"dtype must be bfloat16, float16 or float32, got {dtype}")
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype)


@torch.library.register_fake("dsv4::fused_amax_quantize")
def _fused_amax_quantize(x):
    _check_float(x, "x", 16)
    return (*_quant_outputs(x, x.shape[-1]), _global_scale(x, False))


@torch.library.register_fake("dsv4::fused_amax_quantize_per_row")
def _fused_amax_quantize_per_row(x):
    _check_float(x, "x", 16)
    return (*_quant_outputs(x, x.shape[-1]), _global_scale(x, True))


@torch.library.register_fake("dsv4::fused_deinterleave_amax_quantize")
def _fused_deinterleave_amax_quantize(gate_up, row_weight, limit, per_row):
    _check_float(gate_up, "gate_up", 32)
    if row_weight is not None:
        torch._check(row_weight.dtype == torch.float32, lambda: "row_weight must be float32")
        torch._check(row_weight.numel() == gate_up[..., 0].numel(), lambda: "row_weight needs one weight per row")
    return (*_quant_outputs(gate_up, gate_up.shape[-1] // 2), _global_scale(gate_up, per_row))

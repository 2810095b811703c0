"""Checks of one checkpoint tensor (and its quantization scales) against the model tensor it fills, from the
safetensors headers alone: each returns the one-line problem or None. Used by the loader's load plan."""

from __future__ import annotations

import torch

from dsv4_model.checkpoint.io import FLOAT_TAGS, INT_TAGS, TensorInfo
from dsv4_model.quant.formats import FP4_BLOCK, FP8_BLOCK, fp8_scale_shape, mxfp4_shapes

FP8_TAGS = frozenset({"F8_E4M3", "F8_E5M2"})
PACKED_FP4_TAGS = frozenset({"I8", "U8"})
_SCALE_TAGS = frozenset({"F8_E8M0", "F32", "BF16"})
_NVFP4_BLOCK = 16
# ModelOpt NVFP4 companions of `X.weight`
NVFP4_SCALE, NVFP4_SCALE2, NVFP4_INPUT_SCALE = "weight_scale", "weight_scale_2", "input_scale"


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def source_name(info: TensorInfo, official: str) -> str:
    return f"{official!r}" if official == info.key else f"{official!r} (checkpoint key {info.key!r})"


def dtype_ok(tag: str, dtype: torch.dtype) -> bool:
    if dtype.is_floating_point:
        return tag in FLOAT_TAGS
    if dtype == torch.bool:
        return tag == "BOOL"
    return tag in INT_TAGS


def dtype_problem(where: str, dtype: torch.dtype, tag: str) -> str:
    kind = "a floating-point" if dtype.is_floating_point else "an integer"
    return f"{where}: dtype mismatch: expected {kind} tensor (model dtype {dtype}), got {tag}"


def check_source(where: str, name: str, info: TensorInfo, scale: TensorInfo | None, kind: str,
                  shape: tuple[int, ...], dtype: torch.dtype, scale2: TensorInfo | None = None) -> str | None:
    if kind == "plain":
        if info.shape != shape:
            return f"{where}: shape mismatch: expected {fmt_shape(shape)}, got {fmt_shape(info.shape)}"
        if not dtype_ok(info.dtype, dtype):
            return dtype_problem(where, dtype, info.dtype)
        return None
    if not dtype.is_floating_point or len(shape) != 2:
        return f"{where}: is quantized ({info.dtype} + scale) but the model tensor {fmt_shape(shape)} {dtype} is not a float matrix"
    out_f, in_f = shape
    if kind == "nvfp4":
        return _check_nvfp4(where, name, info, scale, scale2, out_f, in_f)
    swhere = source_name(scale, name[: -len("weight")] + "scale")
    if scale.dtype not in _SCALE_TAGS:
        return f"{swhere}: dtype mismatch: expected a scale dtype ({', '.join(sorted(_SCALE_TAGS))}), got {scale.dtype}"
    if kind == "fp8":
        wshape, sshape = shape, fp8_scale_shape(out_f, in_f, FP8_BLOCK)
        what = f"FP8 {FP8_BLOCK}x{FP8_BLOCK}-block"
    else:
        if in_f % 2:
            return f"{where}: packed FP4 needs an even input dim, the model tensor is {fmt_shape(shape)}"
        wshape, sshape = mxfp4_shapes(out_f, in_f, FP4_BLOCK)
        what = f"MXFP4 1x{FP4_BLOCK}-block"
    if info.shape != wshape:
        return (f"{where}: shape mismatch: expected {fmt_shape(wshape)} ({what} storage of model tensor "
                f"{fmt_shape(shape)}), got {fmt_shape(info.shape)}")
    if scale.shape != sshape:
        return (f"{swhere}: shape mismatch: expected {fmt_shape(sshape)} ({what} scales of model tensor "
                f"{fmt_shape(shape)}), got {fmt_shape(scale.shape)}")
    return None


def _check_nvfp4(where: str, name: str, info: TensorInfo, scale: TensorInfo, scale2: TensorInfo, out_f: int,
                 in_f: int) -> str | None:
    base = name[: -len("weight")]
    swhere, s2where = source_name(scale, base + NVFP4_SCALE), source_name(scale2, base + NVFP4_SCALE2)
    if in_f % _NVFP4_BLOCK:
        return f"{where}: NVFP4 needs an input dim that is a multiple of 16, the model tensor is {fmt_shape((out_f, in_f))}"
    if info.shape != (out_f, in_f // 2):
        return (f"{where}: shape mismatch: expected {fmt_shape((out_f, in_f // 2))} (NVFP4 packed storage of model "
                f"tensor {fmt_shape((out_f, in_f))}), got {fmt_shape(info.shape)}")
    if scale.dtype not in ("F8_E4M3", "U8"):
        return f"{swhere}: dtype mismatch: expected F8_E4M3 (NVFP4 block scales), got {scale.dtype}"
    if scale.shape != (out_f, in_f // _NVFP4_BLOCK):
        return (f"{swhere}: shape mismatch: expected {fmt_shape((out_f, in_f // _NVFP4_BLOCK))} (NVFP4 1x16-block "
                f"scales of model tensor {fmt_shape((out_f, in_f))}), got {fmt_shape(scale.shape)}")
    if scale2.dtype != "F32" or scale2.shape not in ((), (1,)):
        return f"{s2where}: expected a float32 scalar (NVFP4 global scale), got {scale2.dtype} {fmt_shape(scale2.shape)}"
    return None

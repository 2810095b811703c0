"""Fakes for the NVFP4 GEMM / MoE ops (dsv4::nvfp4_linear, nvfp4_linear_grouped, nvfp4_linear_multi,
nvfp4_fp32_linear_multi, nvfp4_linear_w4a4, nvfp4_moe, nvfp4_moe_rows): shapes only."""
import torch

from dsv4_ops.fakes.fp32_linear import fp32_linear_outputs

_CHUNK = 128


def _kp(k):
    return (k + _CHUNK - 1) // _CHUNK * _CHUNK


def _check_weight(op, w, s, k, lead):
    torch._check(w.dim() == 2 + lead, lambda: f"{op}: weight must have {2 + lead} dims, got {tuple(w.shape)}")
    torch._check(w.dtype == torch.uint8 and s.dtype == torch.uint8,
                 lambda: f"{op}: kernel-layout weight and scale must be uint8, got {w.dtype}, {s.dtype}")
    torch._check(k % 16 == 0, lambda: f"{op}: K must be a multiple of 16, got {k}")
    torch._check(w.shape[-1] * 2 == _kp(k), lambda: f"{op}: weight last dim must be Kp/2 = {_kp(k) // 2}")
    torch._check(s.dim() == w.dim() and s.shape[:-1] == w.shape[:-1] and s.shape[-1] * 16 == _kp(k),
                 lambda: f"{op}: scale {tuple(s.shape)} does not match weight {tuple(w.shape)}")
    return w.shape[-2]


def _check_gs(op, g):
    torch._check(g.dtype == torch.float32 and g.numel() == 1, lambda: f"{op}: global scale must be fp32 0-d")


def _linear_fake(x, w_packed, w_scale, w_global_scale, out_dtype=None):
    op = "dsv4::nvfp4_linear"
    torch._check(x.dtype == torch.bfloat16, lambda: f"{op}: x must be bf16, got {x.dtype}")
    dt = torch.bfloat16 if out_dtype is None else out_dtype
    torch._check(dt in (torch.bfloat16, torch.float16, torch.float32),
                 lambda: f"{op}: out_dtype must be bfloat16, float16 or float32, got {dt}")
    n = _check_weight(op, w_packed, w_scale, x.shape[-1], 0)
    _check_gs(op, w_global_scale)
    return x.new_empty((*x.shape[:-1], n), dtype=dt)


def _linear_grouped_fake(x, w_packed, w_scale, w_global_scale):
    op = "dsv4::nvfp4_linear_grouped"
    torch._check(x.dtype == torch.bfloat16 and x.dim() >= 2, lambda: f"{op}: x must be bf16 [..., G, K]")
    n = _check_weight(op, w_packed, w_scale, x.shape[-1], 1)
    torch._check(w_packed.shape[0] == x.shape[-2], lambda: f"{op}: w_packed must hold x.shape[-2] matrices")
    torch._check(w_global_scale.dtype == torch.float32 and tuple(w_global_scale.shape) == (x.shape[-2],),
                 lambda: f"{op}: w_global_scale must be float32 [G]")
    return x.new_empty((*x.shape[:-1], n))


def _linear_multi_fake(x, w_packed, w_scale, w_global_scale, op="dsv4::nvfp4_linear_multi"):
    torch._check(x.dtype == torch.bfloat16, lambda: f"{op}: x must be bf16, got {x.dtype}")
    torch._check(len(w_packed) > 0 and len(w_scale) == len(w_packed) == len(w_global_scale),
                 lambda: f"{op}: w_packed, w_scale, w_global_scale must be non-empty lists of one length")
    outs = []
    for w, s, g in zip(w_packed, w_scale, w_global_scale):
        n = _check_weight(op, w, s, x.shape[-1], 0)
        _check_gs(op, g)
        outs.append(x.new_empty((*x.shape[:-1], n)))
    return outs


def _nvfp4_fp32_linear_multi_fake(x, w_packed, w_scale, w_global_scale, fp32_weight):
    op = "dsv4::nvfp4_fp32_linear_multi"
    outs = _linear_multi_fake(x, w_packed, w_scale, w_global_scale, op)
    return outs + fp32_linear_outputs(op, "fp32_weight", x, fp32_weight)


def _linear_w4a4_fake(x_packed, x_scale, x_global_scale, w_packed, w_scale, w_global_scale, out_dtype):
    op = "dsv4::nvfp4_linear_w4a4"
    torch._check(x_packed.dtype == torch.uint8, lambda: f"{op}: x_packed must be uint8")
    torch._check(x_scale.dtype in (torch.float8_e4m3fn, torch.uint8),
                 lambda: f"{op}: x_scale must be float8_e4m3fn (or its bytes as uint8)")
    k = x_packed.shape[-1] * 2
    torch._check(x_scale.shape[:-1] == x_packed.shape[:-1] and x_scale.shape[-1] * 16 == k,
                 lambda: f"{op}: x_scale {tuple(x_scale.shape)} does not match x_packed {tuple(x_packed.shape)}")
    _check_gs(op, x_global_scale)
    n = _check_weight(op, w_packed, w_scale, k, 0)
    _check_gs(op, w_global_scale)
    torch._check(out_dtype in (torch.bfloat16, torch.float16, torch.float32),
                 lambda: f"{op}: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    return x_packed.new_empty((*x_packed.shape[:-1], n), dtype=out_dtype)


def _check_moe(op, x, topk_ids, topk_weights, w13_packed, w13_scale, w13_global_scale, w2_packed, w2_scale,
               w2_global_scale, shared_w13_packed, shared_w13_scale, shared_w13_global_scale, shared_w2_packed,
               shared_w2_scale, shared_w2_global_scale):
    """check_moe of nvfp4_gemm_checks.h; returns (T, d, k, has_shared)."""
    torch._check(x.dim() == 2 and x.dtype == torch.bfloat16, lambda: f"{op}: x must be bf16 [T, d]")
    t, d = x.shape
    torch._check(topk_ids.dim() == 2 and topk_ids.shape[0] == t, lambda: f"{op}: topk_ids must be [T, k]")
    torch._check(topk_ids.dtype in (torch.int32, torch.int64), lambda: f"{op}: topk_ids must be int32/int64")
    torch._check(topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32,
                 lambda: f"{op}: topk_weights must be fp32 [T, k]")
    two_i = _check_weight(op, w13_packed, w13_scale, d, 1)
    torch._check(two_i % 16 == 0, lambda: f"{op}: w13 rows must be a multiple of 16")
    e = w13_packed.shape[0]
    n = _check_weight(op, w2_packed, w2_scale, two_i // 2, 1)
    torch._check(n == d and w2_packed.shape[0] == e, lambda: f"{op}: w2 must be [E, d, Ip/2]")
    torch._check(w13_global_scale.shape == (e,) and w2_global_scale.shape == (e,),
                 lambda: f"{op}: global scales must be fp32 [E]")
    shared = (shared_w13_packed, shared_w13_scale, shared_w13_global_scale, shared_w2_packed, shared_w2_scale,
              shared_w2_global_scale)
    n_shared = sum(s is not None for s in shared)
    torch._check(n_shared in (0, 6), lambda: f"{op}: pass all six shared_* tensors or none")
    if n_shared == 6:
        s_two_i = _check_weight(op, shared_w13_packed, shared_w13_scale, d, 0)
        sn = _check_weight(op, shared_w2_packed, shared_w2_scale, s_two_i // 2, 0)
        torch._check(sn == d, lambda: f"{op}: shared_w2 must have d rows")
    return t, d, topk_ids.shape[1], n_shared == 6


def _moe_fake(x, topk_ids, topk_weights, w13_packed, w13_scale, w13_global_scale, w2_packed, w2_scale,
              w2_global_scale, shared_w13_packed, shared_w13_scale, shared_w13_global_scale, shared_w2_packed,
              shared_w2_scale, shared_w2_global_scale, swiglu_limit):
    t, d, _, _ = _check_moe("dsv4::nvfp4_moe", x, topk_ids, topk_weights, w13_packed, w13_scale, w13_global_scale,
                            w2_packed, w2_scale, w2_global_scale, shared_w13_packed, shared_w13_scale,
                            shared_w13_global_scale, shared_w2_packed, shared_w2_scale, shared_w2_global_scale)
    return x.new_empty((t, d))


def _moe_rows_fake(x, topk_ids, topk_weights, w13_packed, w13_scale, w13_global_scale, w2_packed, w2_scale,
                   w2_global_scale, shared_w13_packed, shared_w13_scale, shared_w13_global_scale, shared_w2_packed,
                   shared_w2_scale, shared_w2_global_scale, swiglu_limit):
    t, d, k, has_shared = _check_moe(
        "dsv4::nvfp4_moe_rows", x, topk_ids, topk_weights, w13_packed, w13_scale, w13_global_scale, w2_packed,
        w2_scale, w2_global_scale, shared_w13_packed, shared_w13_scale, shared_w13_global_scale, shared_w2_packed,
        shared_w2_scale, shared_w2_global_scale)
    return x.new_empty((t * k + (t if has_shared else 0), d))


for _name, _fn in (("nvfp4_linear", _linear_fake), ("nvfp4_linear_grouped", _linear_grouped_fake),
                   ("nvfp4_linear_multi", _linear_multi_fake),
                   ("nvfp4_fp32_linear_multi", _nvfp4_fp32_linear_multi_fake),
                   ("nvfp4_linear_w4a4", _linear_w4a4_fake),
                   ("nvfp4_moe", _moe_fake), ("nvfp4_moe_rows", _moe_rows_fake)):
    torch.library.register_fake(f"dsv4::{_name}")(_fn)

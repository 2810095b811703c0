"""Fake for dsv4::nvfp4_linear_chain: writes `out` (and leaves `sync` zero), returns nothing."""
import torch

from dsv4_ops.fakes.nvfp4_gemm import _check_weight

_OP = "dsv4::nvfp4_linear_chain"


def _nvfp4_linear_chain_fake(x, w_packed, w_scale, w_global_scale, out, sync):
    n = len(w_packed)
    torch._check(1 <= n <= 4 and len(w_scale) == n and len(w_global_scale) == n,
                 lambda: f"{_OP}: w_packed, w_scale and w_global_scale must be lists of one length, 1 to 4")
    torch._check(x.dtype == torch.bfloat16, lambda: f"{_OP}: x must be bf16, got {x.dtype}")
    cols, sync_numel, lead, shape = 0, 1, None, None
    for i, (w, s, g) in enumerate(zip(w_packed, w_scale, w_global_scale)):
        grouped = w.dim() == 3
        groups = w.shape[0] if grouped else 1
        torch._check(groups > 0, lambda: f"{_OP}: w_packed[{i}] must hold at least one matrix")
        if i == 0:
            lead = x.shape[:-2] if grouped else x.shape[:-1]
            torch._check(not grouped or x.shape[-2] == groups, lambda: f"{_OP}: x.shape[-2] must be G")
            k = x.shape[-1]
        else:
            torch._check(cols % groups == 0 and (cols // groups) % 128 == 0 and shape[-1] % 16 == 0,
                         lambda: f"{_OP}: stage {i} must read whole 128-column chunks of stage {i - 1}'s output")
            sync_numel += cols // 128
            k = cols // groups
        nn = _check_weight(_OP, w, s, k, 1 if grouped else 0)
        torch._check(g.dtype == torch.float32 and g.numel() == groups,
                     lambda: f"{_OP}: w_global_scale[{i}] must be float32 with one value per matrix")
        shape = (*lead, groups, nn) if grouped else (*lead, nn)
        cols = groups * nn
    torch._check(out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(shape),
                 lambda: f"{_OP}: out must be bf16 {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")
    torch._check(sync.dtype == torch.int32 and sync.dim() == 1 and sync.numel() >= sync_numel
                 and sync.is_contiguous(), lambda: f"{_OP}: sync must be contiguous int32 [>= {sync_numel}]")


torch.library.register_fake(_OP)(_nvfp4_linear_chain_fake)

"""Fake for dsv4::hc_sinkhorn: the shape and dtype of logits."""
import torch


def _hc_sinkhorn_fake(logits, iters, eps):
    op = "dsv4::hc_sinkhorn"
    torch._check(logits.dtype == torch.float32, lambda: f"{op}: logits must be float32, got {logits.dtype}")
    torch._check(logits.dim() >= 2 and logits.shape[-1] == logits.shape[-2],
                 lambda: f"{op}: logits must be [..., hc, hc], got {tuple(logits.shape)}")
    torch._check(1 <= logits.shape[-1] <= 8, lambda: f"{op}: hc must be in [1, 8]")
    torch._check(iters >= 1, lambda: f"{op}: iters must be >= 1")
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# A library built before this op existed must still import (other ops keep working).
if hasattr(torch.ops.dsv4, "hc_sinkhorn"):
    torch.library.register_fake("dsv4::hc_sinkhorn")(_hc_sinkhorn_fake)

"""Fake for dsv4::prefetch_l2: writes its one-element marker in place, returns nothing."""
import torch

from dsv4_ops.limits import LIMITS


def _prefetch_l2_fake(after, weights, marker):
    op = "dsv4::prefetch_l2"
    torch._check(marker.dtype == torch.int64 and marker.numel() == 1,
                 lambda: f"{op}: marker must be an int64 tensor of one element")
    torch._check(len(weights) <= LIMITS.prefetch_max_tensors,
                 lambda: f"{op}: at most {LIMITS.prefetch_max_tensors} weights per call")


torch.library.register_fake("dsv4::prefetch_l2")(_prefetch_l2_fake)

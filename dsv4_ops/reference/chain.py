"""NVFP4 linear chain reference (dsv4::nvfp4_linear_chain): the stages' references in order, each rounding its
output to bf16 as the per-op path does."""
import torch

from .nvfp4_gemm import nvfp4_linear_grouped_ref, nvfp4_linear_ref

__all__ = ["nvfp4_linear_chain_ref"]


def nvfp4_linear_chain_ref(x, stages) -> torch.Tensor:
    """stages: (packed, block_scale, global_scale) per stage in the canonical layout (nvfp4_linear_ref's); a 3-d
    packed is a grouped stage (nvfp4_linear_grouped_ref), reading the previous output as [..., G, K]."""
    h = x
    for i, (packed, scale, gs) in enumerate(stages):
        if packed.dim() == 3:
            g = packed.shape[0]
            h = nvfp4_linear_grouped_ref(h if i == 0 else h.unflatten(-1, (g, -1)), packed, scale, gs)
            h = h if i == len(stages) - 1 else h.flatten(-2)
        else:
            h = nvfp4_linear_ref(h, packed, scale, gs)
    return h

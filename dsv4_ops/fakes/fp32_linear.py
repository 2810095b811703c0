"""Fake for dsv4::fp32_linear: one fp32 [..., N_i] output per weight."""
import torch


def fp32_linear_outputs(op, name, x, weight):
    """The checks and outputs of fp32_linear(x, weight) (nvfp4_fp32_linear_multi's fake names its own op / argument)."""
    torch._check(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
                 lambda: f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")
    torch._check(x.dim() >= 1, lambda: f"{op}: x must be [..., K]")
    torch._check(1 <= len(weight) <= 8, lambda: f"{op}: {name} must list 1 to 8 matrices, got {len(weight)}")
    outs = []
    for i, w in enumerate(weight):
        torch._check(w.dtype in (torch.bfloat16, torch.float32),
                     lambda: f"{op}: {name}[{i}] must be bfloat16 or float32, got {w.dtype}")
        torch._check(w.dim() == 2 and w.shape[1] == x.shape[-1],
                     lambda: f"{op}: {name}[{i}] must be [N, K = {x.shape[-1]}], got {tuple(w.shape)}")
        outs.append(x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32))
    return outs


def _fp32_linear_fake(x, weight):
    return fp32_linear_outputs("dsv4::fp32_linear", "weight", x, weight)


torch.library.register_fake("dsv4::fp32_linear")(_fp32_linear_fake)

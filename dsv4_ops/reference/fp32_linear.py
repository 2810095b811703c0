"""fp32 projection reference (dsv4::fp32_linear)."""
import torch


def fp32_linear_ref(x: torch.Tensor, weight: list[torch.Tensor]) -> list[torch.Tensor]:
    """out[i] = float(x) @ float(weight[i])^T, summed in float64 and rounded once to fp32 (the op sums in fp32, in
    an order of its own: compare with a bound on fp32 summation error)."""
    return [(x.double() @ w.double().t()).float() for w in weight]

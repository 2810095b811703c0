"""MoE routing reference (dsv4::router_topk)."""
import torch


def router_topk_ref(scores: torch.Tensor, bias, k: int, renormalize: bool, scale: float, sqrt_softplus: bool = False):
    """(weights fp32 [N, k], indices int64 [N, k]): the k largest scores + bias per row (a stable descending sort:
    NaN first, ties to the lower index), their unbiased scores, / their sum (renormalize), * scale. sqrt_softplus:
    scores are the logits, through dsv4_model.model.moe.Gate's F.softplus(logits).sqrt() first."""
    if sqrt_softplus:
        scores = torch.nn.functional.softplus(scores).sqrt()
    key = scores if bias is None else scores + bias
    indices = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, indices

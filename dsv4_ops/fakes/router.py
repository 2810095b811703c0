"""Fake for dsv4::router_topk: weights fp32 [N, k], indices int64 [N, k]."""
import torch


def _router_topk_fake(scores, bias, k, renormalize, scale, sqrt_softplus=False):
    op = "dsv4::router_topk"
    torch._check(scores.dtype == torch.float32, lambda: f"{op}: scores must be float32, got {scores.dtype}")
    torch._check(scores.dim() == 2, lambda: f"{op}: scores must be [N, E], got {tuple(scores.shape)}")
    torch._check(1 <= scores.shape[1] <= 1024, lambda: f"{op}: E must be in [1, 1024]")
    torch._check(1 <= k <= min(scores.shape[1], 16), lambda: f"{op}: k must be in [1, min(E, 16)], got {k}")
    if bias is not None:
        torch._check(bias.dtype == torch.float32 and bias.dim() == 1 and bias.shape[0] == scores.shape[1],
                     lambda: f"{op}: bias must be float32 [E]")
    n = scores.shape[0]
    return scores.new_empty((n, k)), scores.new_empty((n, k), dtype=torch.long)


torch.library.register_fake("dsv4::router_topk")(_router_topk_fake)

"""mHC references (dsv4::hc_sinkhorn, hc_pre, hc_post_pre)."""
import torch

from .nvfp4_gemm import moe_combine_rows_ref

# ======================================================================================================
# mHC: dsv4::hc_sinkhorn
# ======================================================================================================

def hc_sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits fp32 [..., hc, hc] -> the mixing matrix: row softmax + eps, then Sinkhorn (columns, then
    (iters - 1) x (rows, columns)), each sum + eps (dsv4_model.model.layers.hc_pre's steps)."""
    comb = torch.softmax(logits.float(), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_pre_ref(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight,
               iters: int, hc_eps: float, norm_eps: float, out_eps: float):
    """dsv4::hc_pre as tensor ops in fp32 (dsv4_model.model.layers.hc_pre, then the sublayer's RMSNorm of y when
    norm_weight is given): (y [..., d] in x's dtype, post fp32 [..., hc], comb fp32 [..., hc, hc])."""
    hc = x.shape[-2]
    xf = x.float()
    flat = xf.flatten(-2)
    mixes = (flat @ fn.float().t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = hc_sinkhorn_ref((mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc)), iters, hc_eps)
    y = (pre.unsqueeze(-1) * xf).sum(-2).to(x.dtype)
    if norm_weight is not None:
        yf = y.float()
        y = (norm_weight * (yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + out_eps))).to(x.dtype)
    return y, post, comb


def hc_post_ref(out: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new hc streams (dsv4_model.model.layers.hc_post): stream j = post_j * out + sum_i comb[i, j] * res_i in fp32,
    in out's dtype."""
    mixed = (comb.unsqueeze(-1) * res.float().unsqueeze(-2)).sum(-3)
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


def hc_post_rows_ref(rows: torch.Tensor, ids: torch.Tensor, n_experts: int, lead) -> torch.Tensor:
    """dsv4::hc_post_pre's sublayer output from the MoE's uncombined rows [T*k (+ T), d] (ids [T, k]; the shared row
    is there when rows has T*k + T), shaped lead + (d,): the combine's fp32 sum (moe_combine_rows_ref) rounded once
    to the rows' dtype."""
    tokens, k = ids.shape
    d = rows.shape[-1]
    shared = tokens > 0 and rows.shape[0] == tokens * k + tokens
    return moe_combine_rows_ref(rows, ids, n_experts, shared).reshape(*lead, d)


def hc_post_pre_ref(out, res, post, comb, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps,
                    out_ids=None, out_experts=0):
    """dsv4::hc_post_pre: (h = hc_post_ref(out, res, post, comb), *hc_pre_ref(h, ...)). With out_ids [T, k], out is
    the MoE's uncombined rows [T*k (+ T), d] and the sublayer output their sum (hc_post_rows_ref)."""
    if out_ids is not None:
        out = hc_post_rows_ref(out, out_ids, out_experts, res.shape[:-2])
    h = hc_post_ref(out, res, post, comb)
    return (h, *hc_pre_ref(h, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps))

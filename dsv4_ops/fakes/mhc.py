"""Fakes for dsv4::hc_sinkhorn (the shape and dtype of logits), dsv4::hc_pre (y in x's dtype, post and comb
fp32) and dsv4::hc_post_pre (the new streams like res, then hc_pre's outputs; out either [..., d] or, with out_ids,
the MoE's rows [T*k (+ T), d])."""
import torch


def _hc_sinkhorn_fake(logits, iters, eps):
    op = "dsv4::hc_sinkhorn"
    torch._check(logits.dtype == torch.float32, lambda: f"{op}: logits must be float32, got {logits.dtype}")
    torch._check(logits.dim() >= 2 and logits.shape[-1] == logits.shape[-2],
                 lambda: f"{op}: logits must be [..., hc, hc], got {tuple(logits.shape)}")
    torch._check(1 <= logits.shape[-1] <= 8, lambda: f"{op}: hc must be in [1, 8]")
    torch._check(iters >= 1, lambda: f"{op}: iters must be >= 1")
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


torch.library.register_fake("dsv4::hc_sinkhorn")(_hc_sinkhorn_fake)


def _hc_pre_fake(x, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps):
    op = "dsv4::hc_pre"
    torch._check(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
                 lambda: f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")
    torch._check(x.dim() >= 2, lambda: f"{op}: x must be [..., hc, d]")
    hc, d = x.shape[-2], x.shape[-1]
    torch._check(1 <= hc <= 8, lambda: f"{op}: hc must be in [1, 8]")
    mix = (2 + hc) * hc
    torch._check(fn.dtype in (torch.float32, torch.bfloat16), lambda: f"{op}: fn must be float32 or bfloat16")
    torch._check(fn.dim() == 2 and fn.shape[0] == mix and fn.shape[1] == hc * d,
                 lambda: f"{op}: fn must be [{mix}, {hc * d}], got {tuple(fn.shape)}")
    torch._check(scale.dtype == torch.float32 and tuple(scale.shape) == (3,),
                 lambda: f"{op}: scale must be float32 [3]")
    torch._check(base.dtype == torch.float32 and tuple(base.shape) == (mix,),
                 lambda: f"{op}: base must be float32 [{mix}]")
    if norm_weight is not None:
        torch._check(norm_weight.dtype == torch.float32 and tuple(norm_weight.shape) == (d,),
                     lambda: f"{op}: norm_weight must be float32 [{d}]")
    torch._check(iters >= 1, lambda: f"{op}: iters must be >= 1")
    lead = tuple(x.shape[:-2])
    return (x.new_empty(lead + (d,)), x.new_empty(lead + (hc,), dtype=torch.float32),
            x.new_empty(lead + (hc, hc), dtype=torch.float32))


torch.library.register_fake("dsv4::hc_pre")(_hc_pre_fake)


def _hc_post_pre_fake(out, res, post, comb, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps,
                      out_ids=None, out_experts=0):
    op = "dsv4::hc_post_pre"
    y, post2, comb2 = _hc_pre_fake(res, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, out_eps)
    lead, hc, d = tuple(res.shape[:-2]), res.shape[-2], res.shape[-1]
    torch._check(out.dtype == res.dtype, lambda: f"{op}: out must have res's dtype {res.dtype}, got {out.dtype}")
    if out_ids is None:
        torch._check(out_experts == 0, lambda: f"{op}: out_experts ({out_experts}) is only read with out_ids")
        torch._check(tuple(out.shape) == lead + (d,), lambda: f"{op}: out must be {lead + (d,)} in res's dtype")
    else:  # the MoE's rows [T*k (+ T), d] (mhc_checks.h: check_hc_post)
        tokens = res.numel() // (hc * d)
        torch._check(out_ids.dtype in (torch.int32, torch.int64),
                     lambda: f"{op}: out_ids must be int32 or int64, got {out_ids.dtype}")
        torch._check(out_ids.dim() == 2 and out_ids.shape[0] == tokens,
                     lambda: f"{op}: out_ids must be [T = {tokens} (res's tokens), k], got {tuple(out_ids.shape)}")
        torch._check(1 <= out_experts < 2 ** 31,
                     lambda: f"{op}: out_experts must be in [1, 2^31) with out_ids, got {out_experts}")
        routed = tokens * out_ids.shape[1]
        rows_ok = out.dim() == 2 and out.shape[1] == d and (out.shape[0] == routed or out.shape[0] == routed + tokens)
        torch._check(rows_ok,
                     lambda: f"{op}: with out_ids out must be the expert rows [T*k = {routed} or T*k + T = "
                             f"{routed + tokens}, d = {d}], got {tuple(out.shape)}")
    torch._check(post.dtype == torch.float32 and tuple(post.shape) == lead + (hc,),
                 lambda: f"{op}: post must be float32 {lead + (hc,)}")
    torch._check(comb.dtype == torch.float32 and tuple(comb.shape) == lead + (hc, hc),
                 lambda: f"{op}: comb must be float32 {lead + (hc, hc)}")
    return torch.empty_like(res, memory_format=torch.contiguous_format), y, post2, comb2


torch.library.register_fake("dsv4::hc_post_pre")(_hc_post_pre_fake)

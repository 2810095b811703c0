"""A pure-PyTorch reference of the DSpark forward, transcribed (not imported) from the released DeepSeek code:
`inference/model.py` of DeepSeek-V4-Flash-DSpark / V4-Flash-0731 (`get_dspark_topk_idxs`, `DSparkAttention`,
`DSparkMarkovHead`, `DSparkConfidenceHead`, `DSparkBlock.forward / forward_embed / forward_head`,
`Transformer.forward_spec`), with the V4 `Block`, `Gate`, `Expert`, `MoE`, `hc_split_sinkhorn`, `hc_pre`,
`hc_head`, `apply_rotary_emb`, `sparse_attn` and `act_quant(..., inplace=True)` semantics of the same file and its
kernel.py. It keeps the official structure and its limits: one scalar start_pos for the batch, start_pos == 0 seeds
the rings from a whole prompt and drafts nothing, start_pos > 0 takes one new main position per call.

Weights: a state dict with the checkpoint's `mtp.*` names (routed experts stacked as dsv4 stores them), the shared
embedding and head. Everything here is written out again on purpose, not taken from dsv4_model: the test compares
two independent transcriptions (tests/test_dspark.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def precompute_freqs_cis(rope_dim: int, n: int, theta: float) -> torch.Tensor:
    # window-only layers (compress_ratio 0): base rope_theta, no YaRN
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    return torch.polar(torch.ones(n, rope_dim // 2), torch.outer(torch.arange(n, dtype=torch.float32), freqs))


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, rd: int, inverse: bool = False) -> torch.Tensor:
    """The trailing rd dims of x [b, s, (h,) d] rotated as interleaved complex pairs by freqs_cis [s, rd/2]."""
    nope, rope = x[..., :-rd], x[..., -rd:]
    z = torch.view_as_complex(rope.float().unflatten(-1, (-1, 2)).contiguous())
    f = freqs_cis.conj() if inverse else freqs_cis
    f = f.view(1, z.size(1), *([1] * (z.dim() - 3)), z.size(-1))
    return torch.cat([nope, torch.view_as_real(z * f).flatten(-2).to(x.dtype)], dim=-1)


def act_quant_inplace(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """kernel.py act_quant(x, 64, "ue8m0", inplace=True): FP8 e4m3 round trip, one power-of-two scale per 64."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / 448.0))))
    y = (xb / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return y.flatten(-2).to(x.dtype)


def rms_norm(x, w, eps):
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def hc_split_sinkhorn(mixes, scale, base, hc, iters, eps):
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def get_dspark_topk_idxs(window_size: int, bsz: int, block_size: int, start_pos: int) -> torch.Tensor:
    assert start_pos > 0
    m = torch.cat([torch.arange(min(window_size, start_pos + 1)), window_size + torch.arange(block_size)])
    return m.view(1, 1, -1).expand(bsz, block_size, -1)


def sparse_attn(q, kv, sink, idx, scale):
    """q [b, s, h, d], kv [b, n, d], idx [b, s, k] -> [b, s, h, d]; the sink a logit in the denominator only."""
    b, s, k = idx.shape
    keys = kv.gather(1, idx.reshape(b, -1, 1).expand(-1, -1, kv.size(-1))).view(b, s, k, -1).float()
    sc = torch.einsum("bshd,bskd->bshk", q.float(), keys) * scale
    p = torch.cat([sc, sink.float().view(1, 1, -1, 1).expand(b, s, -1, 1)], -1).softmax(-1)[..., :-1]
    return torch.einsum("bshk,bskd->bshd", p, keys).to(q.dtype)


class RefDSpark:
    """The released DSpark module (forward_spec), on a state dict `sd` and the shared embed / head weights."""

    def __init__(self, sd: dict, cfg, n_stages: int, embed: torch.Tensor, head: torch.Tensor, bsz: int,
                 act_quant: bool = True, max_seq_len: int = 512):
        self.sd, self.c, self.S, self.embed_w, self.head_w = sd, cfg, n_stages, embed, head
        self.sp, self.act_quant = cfg.dspark, act_quant
        self.freqs_cis = precompute_freqs_cis(cfg.rope_head_dim, max_seq_len, cfg.rope_theta)
        dt = embed.dtype
        self.window_kv_cache = [torch.zeros(bsz, cfg.window_size, cfg.head_dim, dtype=dt) for _ in range(n_stages)]

    def w(self, i, name):
        return self.sd[f"mtp.{i}.{name}"]

    def linear(self, x, w):
        return F.linear(x.to(w.dtype), w)

    # DSparkAttention.forward
    def attn(self, i, x, start_pos, main_x):
        c = self.c
        rd, win, H, D = c.rope_head_dim, c.window_size, c.n_heads, c.head_dim
        bsz, seqlen, _ = main_x.size()
        main_kv = rms_norm(self.linear(main_x, self.w(i, "attn.wkv.weight")), self.w(i, "attn.kv_norm.weight"),
                           c.norm_eps)
        main_kv = apply_rotary_emb(main_kv, self.freqs_cis[start_pos:start_pos + seqlen], rd)
        if self.act_quant:
            main_kv = torch.cat([act_quant_inplace(main_kv[..., :-rd]), main_kv[..., -rd:]], -1)
        cache = self.window_kv_cache[i]
        if start_pos == 0:
            if seqlen <= win:
                cache[:bsz, :seqlen] = main_kv
            else:
                cutoff = seqlen % win
                cache[:bsz, cutoff:win], cache[:bsz, :cutoff] = main_kv[:, -win:].split([win - cutoff, cutoff], 1)
            return x
        bsz, block_size, _ = x.size()
        freqs_cis = self.freqs_cis[start_pos + seqlen:start_pos + seqlen + block_size]
        qr = rms_norm(self.linear(x, self.w(i, "attn.wq_a.weight")), self.w(i, "attn.q_norm.weight"), c.norm_eps)
        q = self.linear(qr, self.w(i, "attn.wq_b.weight")).unflatten(-1, (H, D))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + c.norm_eps)
        q = apply_rotary_emb(q, freqs_cis, rd)
        kv = rms_norm(self.linear(x, self.w(i, "attn.wkv.weight")), self.w(i, "attn.kv_norm.weight"), c.norm_eps)
        kv = apply_rotary_emb(kv, freqs_cis, rd)
        if self.act_quant:
            kv = torch.cat([act_quant_inplace(kv[..., :-rd]), kv[..., -rd:]], -1)
        topk_idxs = get_dspark_topk_idxs(win, bsz, block_size, start_pos)
        cache[:bsz, start_pos % win] = main_kv.squeeze(1)
        kv = torch.cat([cache[:bsz], kv], dim=1)
        o = sparse_attn(q, kv, self.w(i, "attn.attn_sink"), topk_idxs, D ** -0.5)
        o = apply_rotary_emb(o, freqs_cis, rd, inverse=True)
        o = o.view(bsz, block_size, c.o_groups, -1)
        wo_a = self.w(i, "attn.wo_a.weight").view(c.o_groups, c.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a.to(o.dtype))
        return self.linear(o.flatten(2), self.w(i, "attn.wo_b.weight"))

    # Block.hc_pre / hc_post
    def hc_pre(self, x, fn, scale, base):
        c = self.c
        shape, dtype = x.size(), x.dtype
        x = x.flatten(2).float()
        rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + c.norm_eps)
        mixes = F.linear(x, fn.float()) * rsqrt
        pre, post, comb = hc_split_sinkhorn(mixes, scale.float(), base.float(), c.hc_mult, c.hc_sinkhorn_iters,
                                            c.hc_eps)
        y = torch.sum(pre.unsqueeze(-1) * x.view(shape), dim=2)
        return y.to(dtype), post, comb

    @staticmethod
    def hc_post(x, residual, post, comb):
        y = post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
        return y.type_as(x)

    # Gate / Expert / MoE (learned router: the stages' layer ids are past n_hash_layers)
    def moe(self, i, x):
        c = self.c
        shape = x.size()
        x = x.view(-1, c.dim)
        scores = F.linear(x.float(), self.w(i, "ffn.gate.weight").float())
        scores = F.softplus(scores).sqrt()
        original = scores
        scores = scores + self.w(i, "ffn.gate.bias")
        indices = scores.topk(c.n_activated_experts, dim=-1)[1]
        weights = original.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True) * c.route_scale

        def expert(xe, w1, w2, w3, wt=None):
            gate, up = self.linear(xe, w1).float(), self.linear(xe, w3).float()
            if c.swiglu_limit > 0:
                up = torch.clamp(up, min=-c.swiglu_limit, max=c.swiglu_limit)
                gate = torch.clamp(gate, max=c.swiglu_limit)
            h = F.silu(gate) * up
            if wt is not None:
                h = wt * h
            return self.linear(h.to(xe.dtype), w2)

        y = torch.zeros_like(x, dtype=torch.float32)
        W1, W2, W3 = (self.w(i, f"ffn.experts.{r}") for r in ("w1", "w2", "w3"))
        for e in range(c.n_routed_experts):
            idx, top = torch.where(indices == e)
            if idx.numel():
                y[idx] += expert(x[idx], W1[e], W2[e], W3[e], weights[idx, top, None]).float()
        z = expert(x, *(self.w(i, f"ffn.shared_experts.{r}.weight") for r in ("w1", "w2", "w3")))
        return (y + z.float()).type_as(x).view(shape)

    # DSparkBlock.forward (the V4 Block.forward with DSparkAttention)
    def block(self, i, x, start_pos, main_x):
        if start_pos == 0:
            self.attn(i, x, start_pos, main_x)  # prefill only seeds the window KV cache
            return x
        c = self.c
        residual = x
        x, post, comb = self.hc_pre(x, self.w(i, "hc_attn_fn"), self.w(i, "hc_attn_scale"), self.w(i, "hc_attn_base"))
        x = rms_norm(x, self.w(i, "attn_norm.weight"), c.norm_eps)
        x = self.attn(i, x, start_pos, main_x)
        x = self.hc_post(x, residual, post, comb)
        residual = x
        x, post, comb = self.hc_pre(x, self.w(i, "hc_ffn_fn"), self.w(i, "hc_ffn_scale"), self.w(i, "hc_ffn_base"))
        x = rms_norm(x, self.w(i, "ffn_norm.weight"), c.norm_eps)
        x = self.moe(i, x)
        return self.hc_post(x, residual, post, comb)

    def forward_embed(self, main_hidden, input_ids):
        main_x = rms_norm(self.linear(main_hidden, self.w(0, "main_proj.weight")), self.w(0, "main_norm.weight"),
                          self.c.norm_eps)
        draft_input_ids = input_ids.new_full([input_ids.size(0), self.sp.block_size], self.sp.noise_token_id)
        draft_input_ids[:, 0] = input_ids
        x = F.embedding(draft_input_ids, self.embed_w)
        return x.unsqueeze(2).repeat(1, 1, self.c.hc_mult, 1), main_x

    def hc_head(self, x, fn, scale, base):
        c = self.c
        shape, dtype = x.size(), x.dtype
        x = x.flatten(2).float()
        rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + c.norm_eps)
        mixes = F.linear(x, fn.float()) * rsqrt
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + c.hc_eps
        return torch.sum(pre.unsqueeze(-1) * x.view(shape), dim=2).to(dtype)

    def markov_head(self, token_ids):
        last = self.S - 1
        embed = F.embedding(token_ids, self.w(last, "markov_head.markov_w1.weight"))
        return F.linear(embed.float(), self.w(last, "markov_head.markov_w2.weight").float()), embed

    def forward_head(self, x, input_ids):
        last = self.S - 1
        x = self.hc_head(x, self.w(last, "hc_head_fn"), self.w(last, "hc_head_scale"), self.w(last, "hc_head_base"))
        logits = F.linear(rms_norm(x, self.w(last, "norm.weight"), self.c.norm_eps).float(), self.head_w.float())
        output_ids = input_ids.new_empty(input_ids.size(0), self.sp.block_size + 1)
        output_ids[:, 0] = input_ids
        markov_embeds = []
        for i in range(self.sp.block_size):
            logits_bias, markov_embed = self.markov_head(output_ids[:, i])
            logits[:, i].add_(logits_bias)
            markov_embeds.append(markov_embed)
            output_ids[:, i + 1] = logits[:, i].argmax(dim=-1)  # sample() at temperature 0
        h = torch.cat([x, torch.stack(markov_embeds, dim=1)], dim=-1)
        confidence = F.linear(h.float(), self.w(last, "confidence_head.proj.weight").float()).squeeze(-1)
        return output_ids[:, 1:], logits, confidence

    def forward_spec(self, input_ids, main_hidden, start_pos):
        """None at start_pos 0 (the rings seeded); else (drafts [b, block], logits, confidence, stage outputs)."""
        h, main_x = self.forward_embed(main_hidden, input_ids)
        outs = []
        for i in range(self.S):
            h = self.block(i, h, start_pos, main_x)
            outs.append(h)
        if start_pos == 0:
            return None
        return (*self.forward_head(h, input_ids), outs)

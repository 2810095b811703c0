"""A differentiable training forward for the DSpark module (dsv4_model/model/dspark.py, docs/dspark.md; issue #51).

`DSpark.draft` is inference-only (window rings, one block per row, no grad). Training runs many blocks at once:
for a batch of sequences the frozen main model gives the residual streams entering the DSpark target layers at
every position (`main_context`); then for anchors `last` [B, A] (each: the last committed position) every block
[anchor = ids[last + 1], noise x (T - 1)] at positions last + 1 .. last + T goes through the stages, its queries
seeing the stage's KV of main_x at positions last - W + 1 .. last (what `DSpark.commit` would have written to the
ring: the same wkv / kv_norm / RoPE / FP8 round trip) and the whole block (non-causal), exactly as
`DSpark._attention` does, but gathered from the sequence instead of a ring. The head's Markov bias is
teacher-forced (`prev` = the true previous token), or, for the equality test, the drafted one (`DSpark.head`).

Nothing here writes a ring or a cache of the DSpark module: the inference path stays as it is.
"""
from __future__ import annotations

import dataclasses

import torch

from dsv4_model.model.dspark import DSpark, DSparkDraft, main_hidden_of
from dsv4_model.model.dspark_config import DSparkConfig
from dsv4_model.model.layers import hc_head, hc_post


def dspark_config_for(cfg, n_stages: int = 3, block_size: int = 5, markov_rank: int = 32,
                      noise_token_id: int = 0):
    """The main model's config with a DSpark of `n_stages` window-only stages fed by its last 3 layers."""
    targets = tuple(range(max(0, cfg.n_layers - 3), cfg.n_layers))
    sp = DSparkConfig(block_size, markov_rank, targets, noise_token_id, stage_ratios=(0,) * n_stages)
    return dataclasses.replace(cfg, dspark=sp.validate(cfg.n_layers, cfg.vocab_size))


@torch.no_grad()
def main_context(model, dspark: DSpark, ids: torch.Tensor) -> torch.Tensor:
    """The frozen main model over ids [B, S] from position 0 -> main_hidden [B, S, n_targets * dim] (the target
    layers' input streams, mean over hc: what prefill_taps commits)."""
    taps = {}

    def tap(layer_id, h):
        if layer_id in dspark.target_layer_ids:
            taps[layer_id] = h

    B, S = ids.shape
    model.streams(ids, torch.full((B,), S, dtype=torch.long, device=ids.device), before_layer=tap)
    return main_hidden_of([taps[i] for i in dspark.target_layer_ids])


def block_streams(dspark: DSpark, model, main_hidden: torch.Tensor, ids: torch.Tensor, last: torch.Tensor,
                  static_moe: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks at anchors last [B, A] (last + 1 < S) over sequences ids [B, S] with main_hidden [B, S, n_t * dim]
    -> (the last stage's streams [B * A, T, hc, dim], the block ids [B * A, T], the anchors' last [B * A]).
    static_moe: the MoE's gather path (inference's); the per-expert loop otherwise (cheaper for many rows)."""
    B, S = ids.shape
    A, T, dev = last.shape[1], dspark.block_size, ids.device
    N = B * A
    rope = model.rope_main
    x = dspark.main_x(main_hidden)
    cs_seq = rope[torch.arange(S, device=dev).clamp(max=rope.shape[0] - 1)].expand(B, -1, -1, -1)
    blk = torch.full((N, T), dspark.noise_token_id, dtype=torch.long, device=dev)
    blk[:, 0] = ids.gather(1, last + 1).reshape(N)
    lastf = last.reshape(N)
    cs = rope[(lastf.unsqueeze(1) + 1 + torch.arange(T, device=dev)).clamp(max=rope.shape[0] - 1)]
    W = dspark.mtp[0].attn.window
    wpos = last.unsqueeze(-1) - (W - 1) + torch.arange(W, device=dev)  # [B, A, W], oldest first (as the ring)
    held = (wpos >= 0).reshape(N, W)
    brow = torch.arange(B, device=dev).view(B, 1, 1)
    mask = torch.cat([held, torch.ones(N, T, dtype=torch.bool, device=dev)], dim=1).unsqueeze(1).expand(-1, T, -1)
    h = model.embed(blk).to(dspark.dtype).unsqueeze(2).repeat(1, 1, dspark.hc, 1)
    for st in dspark.mtp:
        a = st.attn
        kv_seq = dspark.main_kv(st, x, cs_seq)  # [B, S, D]: the stage's KV of every position (commit's values)
        ring = kv_seq[brow, wpos.clamp(min=0)].reshape(N, W, -1)
        ring = torch.where(held.unsqueeze(-1), ring, 0.0)
        xa, post, comb = st._pre(h, st.hc_attn)
        _, q, kv, _ = a._qkv(st.attn_norm(xa), cs)
        o = a._out(a._attend(q, torch.cat([ring, kv], dim=1), mask), cs)
        h = hc_post(o, h, post, comb)
        xf, post, comb = st._pre(h, st.hc_ffn)
        h = hc_post(st.ffn(st.ffn_norm(xf), blk, static=static_moe), h, post, comb)
    return h, blk, lastf


def teacher_forced_head(dspark: DSpark, model, h: torch.Tensor, prev: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head with the Markov bias of given previous tokens prev [N, T] (anchor, then the true tokens) ->
    (fp32 logits [N, T, V], confidence logits [N, T]): DSpark.head's values when prev is what it picked."""
    last = dspark.mtp[-1]
    c = dspark.config
    y = hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, c.hc_eps, c.norm_eps)
    logits = model.head(last.norm(y))
    mk = last.markov_head
    e = mk.markov_w1(prev)
    conf = last.confidence_head.proj(torch.cat([y, e], dim=-1)).squeeze(-1)
    return logits + mk.markov_w2(e), conf


def greedy_head(dspark: DSpark, model, h: torch.Tensor, anchor: torch.Tensor) -> DSparkDraft:
    """The inference head (Markov bias of the drafted tokens, left to right): for the equality test."""
    return dspark.head(model, h, anchor)


def targets_of(ids: torch.Tensor, last: torch.Tensor, T: int) -> torch.Tensor:
    """What each block position drafts: ids[last + 2 + i], i < T -> [B * A, T] (needs last + 1 + T < S)."""
    return ids.gather(1, (last.unsqueeze(-1) + 2 + torch.arange(T, device=ids.device)).reshape(last.shape[0], -1)
                      ).reshape(-1, T)


def dspark_losses(dspark: DSpark, model, main_hidden: torch.Tensor, ids: torch.Tensor, last: torch.Tensor):
    """Teacher-forced training losses at anchors last [B, A]: (cross-entropy per block position [T], the
    confidence head's BCE against whether the position's greedy draft is the target, accuracy per position [T])."""
    T = dspark.block_size
    h, blk, _ = block_streams(dspark, model, main_hidden, ids, last)
    tgt = targets_of(ids, last, T)  # [N, T]
    prev = torch.cat([blk[:, :1], tgt[:, :-1]], dim=1)  # anchor, then the true tokens
    logits, conf = teacher_forced_head(dspark, model, h, prev)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none").view(tgt.shape)
    hit = (logits.detach().argmax(-1) == tgt).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, hit)
    return ce.mean(0), bce, hit.mean(0)

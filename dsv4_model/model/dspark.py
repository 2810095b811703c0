"""The DSpark speculative module of DeepSeek-V4-Flash-0731 / V4-Pro-0813 (docs/dspark.md).

S stages (checkpoint names `mtp.0` .. `mtp.{S-1}`), each a V4 `Block` at a window-only layer id past the main ones
(sliding-window attention, biased-router MoE, mHC). The draft's context is the main model's residual streams
entering the layers `target_layer_ids` (mean over the hc copies), concatenated and projected (stage 0's
`main_proj`, `main_norm`) to `main_x`; each stage keeps a window ring of its own KV of `main_x` (its `wkv`,
`kv_norm`, RoPE at the token's position, the KV FP8 round trip), one row per committed position.

A draft block: ids [anchor, noise x (block_size - 1)] at positions last + 1 .. last + block_size (`last`: the
last committed position, `anchor`: the token after it, not yet committed) -> the shared embedding -> hc copies ->
the S stages, whose attention lets every block query see the ring (positions last - W + 1 .. last) and the whole
block (non-causal) -> the last stage's hc_head and norm -> the shared head (fp32 logits); then left to right the
Markov head adds `markov_w2 @ markov_w1[prev]` to position i's logits and picks token i (greedy: argmax), and the
confidence head gives a raw logit per position from [hidden, markov_w1[prev]].

Decode-style: caches are preallocated buffers, shapes are static and nothing reads values back to the host.
Numerics follow the released inference/model.py (`DSparkAttention`, `DSparkBlock`, `DSparkMarkovHead`,
`DSparkConfidenceHead`); tests/dspark_reference.py transcribes it and tests/test_dspark.py checks this module
against it. The module is not a submodule of the Transformer (`attach`): the main model's state dict, saving
and memory plans stay the main model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_model.model.config import ModelConfig
from dsv4_model.model.layers import Linear, RMSNorm, apply_rope, hc_head, hc_post, wide_argmax
from dsv4_model.model.quant_sim import kv_fake_quant
from dsv4_model.model.transformer import Block, Embedding, _param, draft_head


class DSparkDraft(NamedTuple):
    """One draft block per row: tokens [B, T] (token i: the draft for position last + 2 + i), logits [B, T, V]
    (fp32, Markov bias included), confidence [B, T] (raw logits of the confidence head: sigmoid = the
    predicted chance that the position is accepted)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


class MarkovHead(nn.Module):
    """Low-rank previous-token bias on the shared head's logits: markov_w2 @ markov_w1[prev] (fp32 product)."""

    def __init__(self, vocab_size: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.markov_w1 = Embedding(vocab_size, rank, dtype)
        self.markov_w2 = Linear(rank, vocab_size, torch.float32, fp32=True)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.proj = Linear(dim + rank, 1, torch.float32, fp32=True)  # fp32 math, no bias (as the release's parameter)


class DSparkStage(Block):
    """A stage: the model's own Block at layer id n_layers + i (window-only attention, learned router), with
    stage 0's context projection and the last stage's head parts."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, max_batch: int, *, first: bool,
                 last: bool, n_targets: int, markov_rank: int):
        super().__init__(cfg, layer_id, dtype, max_batch, cfg.window_size)
        if first:
            self.main_proj = Linear(n_targets * cfg.dim, cfg.dim, dtype)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if last:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.hc_head_fn = _param(cfg.hc_mult, cfg.hc_mult * cfg.dim)
            self.hc_head_base = _param(cfg.hc_mult)
            self.hc_head_scale = _param(1)
            self.markov_head = MarkovHead(cfg.vocab_size, markov_rank, dtype)
            self.confidence_head = ConfidenceHead(cfg.dim, markov_rank)


def stage_config(cfg: ModelConfig, n_stages: int) -> ModelConfig:
    """cfg with the stages as its trailing window-only layers (so Block(n_layers + i) finds ratio 0 and a learned
    router) and no DSpark / MTP of its own."""
    ratios = cfg.dspark.stage_ratios or (0,) * n_stages
    return dataclasses.replace(cfg, dspark=None, n_mtp_layers=n_stages,
                               compress_ratios=list(cfg.compress_ratios[:cfg.n_layers]) + list(ratios))


class DSpark(nn.Module):
    """The S stages under `mtp` (state dict = the checkpoint's `mtp.*` names, routed experts stacked as the main
    model's). The shared embedding, head and RoPE table are the main model's, passed to each call."""

    def __init__(self, cfg: ModelConfig, n_stages: int | None = None, *, dtype: torch.dtype = torch.bfloat16,
                 max_batch_size: int = 1, simulate_quant: bool = True, device=None):
        super().__init__()
        sp = cfg.dspark
        if sp is None:
            raise ValueError("DSpark needs a config with the dspark_* keys (ModelConfig.dspark)")
        n = n_stages or sp.n_stages
        if not n:
            raise ValueError("DSpark: the stage count is not in the config; pass n_stages")
        self.config, self.sp, self.n_stages, self.dtype = cfg, sp, n, dtype
        self.block_size, self.noise_token_id = sp.block_size, sp.noise_token_id
        self.target_layer_ids = tuple(sp.target_layer_ids)
        self.max_batch_size, self.hc = max_batch_size, cfg.hc_mult
        ext = stage_config(cfg, n)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.mtp = nn.ModuleList(
                DSparkStage(ext, cfg.n_layers + i, dtype, max_batch_size, first=i == 0, last=i == n - 1,
                            n_targets=len(self.target_layer_ids), markov_rank=sp.markov_rank) for i in range(n))
        self.set_simulate_quant(simulate_quant)
        if self.mtp[0].attn_norm.weight.device.type != "meta":
            self.setup_runtime()

    @property
    def device(self) -> torch.device:
        return self.mtp[0].attn_norm.weight.device

    def shard_experts_(self, shard) -> "DSpark":
        """Expert parallelism: keep this rank's slice of every stage's routed experts (the main model's
        `ExpertShard`; the draft's MoE then sums the ranks' contributions as a main layer's does)."""
        for st in self.mtp:
            st.ffn.shard_experts_(shard)
        return self

    def set_simulate_quant(self, on: bool) -> None:
        self.simulate_quant = bool(on)
        for st in self.mtp:
            st.attn.simulate_quant = self.simulate_quant

    def setup_runtime(self, device=None) -> None:
        """(Re)allocate each stage's window ring [max_batch, W, head_dim] (zeros)."""
        device = torch.device(device) if device is not None else self.device
        self.__dict__["_runtime_epoch"] = self.__dict__.get("_runtime_epoch", 0) + 1  # (Transformer._buffers_named)
        for st in self.mtp:
            st.attn.alloc_runtime(device, self.dtype)

    # ------------------------------------------------------------------ the context
    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """The target layers' input streams, averaged over hc and concatenated [..., n_targets * dim] -> main_x."""
        s0 = self.mtp[0]
        return s0.main_norm(s0.main_proj(main_hidden))

    def main_kv(self, st: DSparkStage, main_x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
        """A stage's KV of main_x [B, S, dim] at the positions of RoPE rows cs [B, S, rd/2, 2] -> [B, S, D]."""
        a = st.attn
        kv = apply_rope(a.kv_norm(a.wkv(main_x)), cs, a.rope_dim)
        return kv_fake_quant(kv, a.rope_dim) if a.simulate_quant else kv

    @torch.no_grad()
    def commit(self, main_hidden: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor,
               rope: torch.Tensor) -> None:
        """Write the committed positions start[b] .. start[b] + lengths[b] - 1 (main_hidden [B, S, n_t * dim],
        rows past lengths[b] ignored: rejected drafts, padding) into every stage's ring; rope: the main model's
        `rope_main` table. A prompt longer than the window keeps its last W positions."""
        B, S, _ = main_hidden.shape
        x = self.main_x(main_hidden)
        pos = (start.unsqueeze(1) + torch.arange(S, device=x.device)).clamp(max=rope.shape[0] - 1)
        cs = rope[pos]
        for st in self.mtp:
            st.attn._write_window(self.main_kv(st, x, cs), lengths, start.unsqueeze(1))

    # ------------------------------------------------------------------ the draft
    def _attention(self, st: DSparkStage, x: torch.Tensor, cs: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] (the block, normed) -> [B, T, dim]: every block query sees the ring's positions
        last - W + 1 .. last and the T block rows."""
        a = st.attn
        B, T, _ = x.shape
        _, q, kv, _ = a._qkv(x, cs)
        W, R = a.window, a.ring
        pos = last.unsqueeze(1) - (W - 1) + torch.arange(W, device=x.device)  # oldest first
        held = pos >= 0
        ring = a.kv_cache[:B].gather(1, pos.remainder(R).unsqueeze(-1).expand(-1, -1, kv.shape[-1]))
        ring = torch.where(held.unsqueeze(-1), ring, 0.0)  # a never-written slot must not be NaN
        keys = torch.cat([ring, kv], dim=1)
        mask = torch.cat([held, torch.ones(B, T, dtype=torch.bool, device=x.device)], dim=1)
        return a._out(a._attend(q, keys, mask.unsqueeze(1).expand(-1, T, -1)), cs)

    def _stage(self, st: DSparkStage, h: torch.Tensor, ids: torch.Tensor, cs: torch.Tensor,
               last: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """One stage over the block's streams h [B, T, hc, dim]; keep: only the first `keep` positions leave it (the
        attention still reads every position's keys: the block is non-causal), so the MoE runs on those alone."""
        x, post, comb = st._pre(h, st.hc_attn)
        h = hc_post(self._attention(st, st.attn_norm(x), cs, last), h, post, comb)
        if keep is not None:
            h, ids = h[:, :keep], ids[:, :keep]
        x, post, comb = st._pre(h, st.hc_ffn)
        return hc_post(st.ffn(st.ffn_norm(x), ids, static=True), h, post, comb)

    @torch.no_grad()
    def draft(self, model, anchor: torch.Tensor, last: torch.Tensor,
              stage_out: list | None = None, pick=None, keep: int | None = None) -> DSparkDraft:
        """A block of block_size drafts per row: anchor [B] (the token at position last + 1), last [B] (the last
        position committed to the rings). model: the main Transformer (embedding, head, RoPE). stage_out: a list
        that receives each stage's output streams [B, T, hc, dim] (tests). pick: as head's. keep: the first `keep`
        drafts only (the ones a step verifies: the same values as the whole block's first ones), so the last
        stage's MoE, the head and the Markov chain skip the positions past them."""
        B, T = anchor.shape[0], self.block_size
        if keep is not None and not 1 <= keep <= T:
            raise ValueError(f"keep: 1 .. block_size={T} drafts, got {keep}")
        ids = torch.full((B, T), self.noise_token_id, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        rope = model.rope_main
        cs = rope[(last.unsqueeze(1) + 1 + torch.arange(T, device=anchor.device)).clamp(max=rope.shape[0] - 1)]
        h = model.embed(ids).to(self.dtype).unsqueeze(2).repeat(1, 1, self.hc, 1)
        for i, st in enumerate(self.mtp):
            h = self._stage(st, h, ids, cs, last, keep if i == len(self.mtp) - 1 else None)
            if stage_out is not None:
                stage_out.append(h)
        return self.head(model, h, anchor, pick)

    def head(self, model, h: torch.Tensor, anchor: torch.Tensor, pick=None) -> DSparkDraft:
        """The last stage's streams h [B, T, hc, dim] (T: the block, or its first drafts) -> DSparkDraft, picked left
        to right (each position's Markov bias reads the token picked before it): pick(logits [B, V], i) -> tokens
        [B] (default: greedy)."""
        last = self.mtp[-1]
        c = self.config
        y = hc_head(h, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, c.hc_eps, c.norm_eps)
        logits = draft_head(model)(last.norm(y))  # the shared head (or the drafters' own): fp32 logits
        mk = last.markov_head
        w2 = draft_markov(mk)
        prev, toks, embs, rows = anchor, [], [], []
        for i in range(h.shape[1]):  # (block_size, or the drafts kept)
            e = mk.markov_w1(prev)
            row = logits[:, i] + w2(e)
            prev = wide_argmax(row) if pick is None else pick(row, i)
            toks.append(prev)
            embs.append(e)
            rows.append(row)
        conf = last.confidence_head.proj(torch.cat([y, torch.stack(embs, dim=1)], dim=-1))
        return DSparkDraft(torch.stack(toks, dim=1), torch.stack(rows, dim=1), conf.squeeze(-1))

    # ------------------------------------------------------------------ testing helper
    @torch.no_grad()
    def init_random_weights(self, seed: int = 0) -> "DSpark":
        """Deterministic random weights with O(1) activations (tests, benchmarks at full size)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif "_scale" in leaf:
                v = 0.5 + torch.rand(p.shape, generator=g)
            elif "_base" in leaf or leaf == "bias" or leaf == "attn_sink":
                v = 0.3 * torch.randn(p.shape, generator=g)
            elif name.endswith("markov_w1.weight"):
                v = torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.copy_(v.to(p.dtype))
        return self


def draft_markov(mk: nn.Module) -> nn.Module:
    """The Markov head's rank -> vocabulary projection the drafts read: markov_w2 as stored (fp32 in the release:
    129280 x 256 = 132 MB, read once per drafted position), or the copy attach_draft_markov gave it (NVFP4 with
    the drafters' NVFP4 head: Engine.set_draft_head)."""
    w2 = mk.__dict__.get("draft_w2")
    return w2 if w2 is not None else mk.markov_w2


def attach_draft_markov(mk: nn.Module, w2: nn.Module | None) -> None:
    """Give the Markov head a drafting copy of markov_w2 (None: its own); a plain attribute, not a submodule (the
    module's state dict stays the checkpoint's)."""
    object.__setattr__(mk, "draft_w2", w2)


def main_hidden_of(taps: list[torch.Tensor]) -> torch.Tensor:
    """The target layers' input streams [..., hc, dim] (in target-id order) -> [..., n_targets * dim]."""
    return torch.cat([t.mean(dim=-2) for t in taps], dim=-1)


def attach(model, dspark: "DSpark | None") -> None:
    """Give the Transformer its DSpark module as a plain attribute (`model.dspark`), not a submodule: the main
    model's state dict, module walks (caches, spare ring slots) and saving stay the main model's."""
    object.__setattr__(model, "dspark", dspark)

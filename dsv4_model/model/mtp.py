"""The multi-token-prediction (MTP) block (docs/speculation.md): a V4 `Block` at layer id n_layers + depth whose
input at position t combines the main model's final streams there with the embedding of token t + 1, so its
logits there predict token t + 2 (speculative decoding's drafts). It has its own caches, hc_head and norm and
shares the main model's embedding and head, so each entry point takes the Transformer, which holds the blocks
as `model.mtp` (checkpoint names `mtp.{depth}.*`).

Entry points, after the main model's own:
  prefill(model, h, next_ids, ...)              the block over a sequence from a position (the prompt; training)
  decode_tokens(model, h, next_ids, positions)  T positions per row from any position (a speculative step's drafts)
  decode_streams(...), logits(model, out)       the same in two parts (the head on the rows a step drafts from)
  verify_tokens(model, tokens, positions)       the main model's decode_tokens and the final streams the block reads
"""

from __future__ import annotations

import torch

from dsv4_model.model.config import ModelConfig
from dsv4_model.model.decode_options import DEFAULT as DEFAULT_OPTIONS, DecodeOptions
from dsv4_model.model.layers import Linear, RMSNorm, hc_post
from dsv4_model.model.transformer import Block, Transformer, _param, draft_head, head_logits


class MTPBlock(Block):
    """A Block with the projections that mix the next token's embedding into its input streams, and its own
    collapse (hc_head_*) and norm before the shared head."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, max_batch: int, max_seq_len: int):
        super().__init__(cfg, layer_id, dtype, max_batch, max_seq_len)
        self.e_proj = Linear(cfg.dim, cfg.dim, dtype)
        self.h_proj = Linear(cfg.dim, cfg.dim, dtype)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_head_fn = _param(cfg.hc_mult, cfg.hc_mult * cfg.dim)
        self.hc_head_base = _param(cfg.hc_mult)
        self.hc_head_scale = _param(1)

    def _inputs(self, model: Transformer, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """The block's input streams: e_proj of the next token's normed embedding onto every stream of
        h_proj(hnorm(h)); h [..., hc, dim], next_ids [...]."""
        return self.e_proj(self.enorm(model.embed(next_ids))).unsqueeze(-2) + self.h_proj(self.hnorm(h))

    def _logits(self, model: Transformer, out: torch.Tensor) -> torch.Tensor:
        """The block's output streams [..., hc, dim] -> fp32 logits (its collapse and norm, the shared head or the
        drafters' head: transformer.draft_head)."""
        return head_logits(out, self, draft_head(model), model.config)


def prefill(model: Transformer, h: torch.Tensor, next_ids: torch.Tensor, lengths: torch.Tensor | None = None,
            start: "int | torch.Tensor" = 0, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `depth` over a sequence from position start (as Transformer.prefill's start): position t combines the
    streams h_t [B, S, hc, dim] (the main model's, or the previous pass's to draft further ahead) with the
    embedding of token t+1 (next_ids [B, S]) and predicts the token after it. Fills the block's cache rows [:B]
    (what decode_tokens then continues). Returns (fp32 logits [B, S, V], the block's output streams
    [B, S, hc, dim]). Tracks gradients where enabled: training drives the block through here."""
    block = model.mtp[depth]
    B, S = next_ids.shape
    if lengths is None:
        lengths = torch.full((B,), S, dtype=torch.long, device=next_ids.device)
    at = model.prefill_at(next_ids.shape, start, None)
    out = block.prefill(block._inputs(model, h, next_ids), next_ids, lengths, model._rope(), at)
    return block._logits(model, out), out


@torch.no_grad()
def decode_tokens(model: Transformer, h: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                  options: DecodeOptions = DEFAULT_OPTIONS, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `depth` over T positions per row from any position (its cache holds each row's positions before):
    position t combines the streams h [B, T, hc, dim] (the main model's there, or an earlier pass's) with the
    embedding of the token after it (next_ids [B, T]) and predicts the token after that. Returns (fp32 logits
    [B, T, V], the block's output streams [B, T, hc, dim]): what prefill gives at those positions, with the
    decode step's static shapes and no host sync (it runs inside the compiled speculative step)."""
    out = decode_streams(model, h, next_ids, positions, options, depth)
    return logits(model, out, depth), out


@torch.no_grad()
def decode_streams(model: Transformer, h: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                   options: DecodeOptions = DEFAULT_OPTIONS, depth: int = 0) -> torch.Tensor:
    """decode_tokens' output streams [B, T, hc, dim] alone (its caches written the same)."""
    block = model.mtp[depth]
    B, T = next_ids.shape
    ids = next_ids.t().reshape(-1)  # rows t * B + b, as Block.decode takes T tokens
    hs = h.transpose(0, 1).reshape(T * B, *h.shape[2:])
    out, pending = block.decode(block._inputs(model, hs, ids), ids,
                                model._token_steps(positions, T, options, scratch=False))
    out = hc_post(pending.out, out, pending.post, pending.comb)
    return out.view(T, B, *out.shape[1:]).transpose(0, 1)


def logits(model: Transformer, out: torch.Tensor, depth: int = 0) -> torch.Tensor:
    """Block `depth`'s output streams [..., hc, dim] -> fp32 logits [..., V] (its collapse, norm and head)."""
    return model.mtp[depth]._logits(model, out)


@torch.no_grad()
def verify_tokens(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor,
                  options: DecodeOptions = DEFAULT_OPTIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformer.decode_tokens (a speculative step verifying its last token and drafts) -> (fp32 logits
    [B, T, V], and the main model's final streams [B, T, hc, dim], which the block reads to draft on)."""
    B, T = tokens.shape
    h = model._decode_tokens_streams(tokens, positions, options)
    return model._logits(h).view(T, B, -1).transpose(0, 1), h.view(T, B, *h.shape[1:]).transpose(0, 1)

"""Chunked prefill: a prompt batch forwarded `chunk` positions at a time (Transformer.prefill from each chunk's
start), so activations are bounded by the chunk rather than the prompt, with the results of one prefill of the
whole prompt (up to fp32 summation order)."""

from __future__ import annotations

import torch

from dsv4_model.model.transformer import Transformer


@torch.no_grad()
def prefill_in_chunks(model: Transformer, tokens: torch.Tensor, lengths: torch.Tensor, chunk: int,
                      all_logits: bool = False, speculate: bool = False):
    """tokens [B, S] (right-padded rows of `lengths` [B], on the model's device) from position 0.

    Returns fp32 logits [B, V] at each row's last token ([B, S, V] with all_logits); with speculate, the MTP
    block's cache is filled too (position t reads the streams at t and token t + 1) and the result is (logits
    [B, V], the final streams at each row's last token [B, hc, dim]; all_logits is then ignored), as Engine's
    prefill."""
    B, S = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    outs, last = [], None
    for s in range(0, S, chunk):
        e = min(S, s + chunk)
        h = model.streams(tokens[:, s:e], (lengths - s).clamp(0, e - s), start=s)
        if speculate:
            nxt = tokens[:, s + 1:e + 1]  # one position short in the last chunk: no token after the prompt
            if nxt.shape[1]:
                model.mtp_forward(h[:, :nxt.shape[1]], nxt, (lengths - 1 - s).clamp(0, nxt.shape[1]), start=s)
        if all_logits and not speculate:
            outs.append(model._logits(h))
            continue
        here = h[rows, (lengths - 1 - s).clamp(0, e - s - 1)]
        ends = ((lengths - 1 >= s) & (lengths - 1 < e)).view(B, 1, 1)
        last = here if last is None else torch.where(ends, here, last)
    if all_logits and not speculate:
        return torch.cat(outs, dim=1)
    logits = model._logits(last)
    return (logits, last) if speculate else logits

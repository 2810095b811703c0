"""Chunked prefill: a prompt batch forwarded `chunk` positions at a time (Transformer.prefill from each chunk's
start), so activations are bounded by the chunk rather than the prompt, with the results of one prefill of the
whole prompt (up to fp32 summation order)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # not imported at run time: ExportedEngine uses padded_chunks before loading the op library
    from dsv4_model.model.transformer import Transformer


def _ends_in(lengths: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """[B] bool: whether row b's last token is among positions s .. e - 1."""
    return (lengths - 1 >= s) & (lengths - 1 < e)


@torch.no_grad()
def prefill_in_chunks(model: "Transformer", tokens: torch.Tensor, lengths: torch.Tensor, chunk: int,
                      all_logits: bool = False, speculate: bool = False):
    """tokens [B, S] (right-padded rows of `lengths` [B], on the model's device) from position 0.

    Returns fp32 logits [B, V] at each row's last token ([B, S, V] with all_logits); with speculate, the MTP
    block's cache is filled too (position t reads the streams at t and token t + 1) and the result is (logits
    [B, V], the final streams at each row's last token [B, hc, dim]; all_logits is then ignored), as Engine's
    prefill."""
    from dsv4_model.model import mtp  # here, not at the top: it loads the op library (see above)

    B, S = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    outs, last = [], None
    for s in range(0, S, chunk):
        e = min(S, s + chunk)
        h = model.streams(tokens[:, s:e], (lengths - s).clamp(0, e - s), start=s)
        if speculate:
            nxt = tokens[:, s + 1:e + 1]  # one position short in the last chunk: no token after the prompt
            if nxt.shape[1]:
                mtp.prefill(model, h[:, :nxt.shape[1]], nxt, (lengths - 1 - s).clamp(0, nxt.shape[1]), start=s)
        if all_logits and not speculate:
            outs.append(model._logits(h))
            continue
        here = h[rows, (lengths - 1 - s).clamp(0, e - s - 1)]
        last = here if last is None else torch.where(_ends_in(lengths, s, e).view(B, 1, 1), here, last)
    if all_logits and not speculate:
        return torch.cat(outs, dim=1)
    logits = model._logits(last)
    return (logits, last) if speculate else logits


def padded_chunks(tokens: torch.Tensor, lengths: torch.Tensor, chunk: int,
                  step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A prompt batch through a fixed-shape chunk step (an exported or compiled graph: tensor starts, the last
    chunk right-padded): step(tokens [B, chunk], lengths [B], start [B]) -> logits [B, V] at each row's last
    token in the chunk. Returns each row's logits from the chunk holding its last token."""
    B, S = tokens.shape
    out = None
    for s in range(0, S, chunk):
        part = tokens.new_zeros(B, chunk)
        part[:, :min(chunk, S - s)] = tokens[:, s:s + chunk]
        logits = step(part, (lengths - s).clamp(0, chunk), torch.full_like(lengths, s))
        out = logits if out is None else torch.where(_ends_in(lengths, s, s + chunk).unsqueeze(1), logits, out)
    return out

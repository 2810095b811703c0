"""Greedy speculative decoding with the MTP block (docs/speculation.md), eager: per step the main model verifies
the last token and K drafts in one pass (Transformer.decode_tokens_streams), the drafts matching its greedy
choices are accepted on the device, and the MTP block drafts K more from the last accepted position. Rejected
tokens are not undone: the model's window rings have K spare slots and its compressor states are indexed by
position (Transformer(spare_window_slots >= K)), so what they wrote is overwritten before anything reads it.
The output is the plain greedy decode's."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpeculationStats:
    rows: int
    steps: int = 0  # verification passes
    emitted: int = 0  # tokens those passes emitted over all rows (bonus tokens included)
    accepted: list[int] = field(default_factory=list)  # per draft position: rows that accepted it
    offered: list[int] = field(default_factory=list)  # per draft position: rows whose earlier drafts all passed

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / max(1, self.steps * self.rows)

    def acceptance(self) -> list[float]:
        return [a / o if o else float("nan") for a, o in zip(self.accepted, self.offered)]


def _check(model, k: int, need: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"speculate must be an int >= 1, got {k!r}")
    if not model.config.n_mtp_layers:
        raise ValueError("speculative decoding needs the model's MTP block (n_mtp_layers >= 1)")
    if model.spare_window_slots < k:
        raise ValueError(f"speculate={k} needs a model built with spare_window_slots >= {k}, "
                         f"got {model.spare_window_slots}")
    if need > model.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens + 2 x speculate = {need} positions exceed max_seq_len="
                         f"{model.max_seq_len}")


@torch.no_grad()
def _draft(model, streams: torch.Tensor, first: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """k drafts per row: the MTP block at positions pos, pos + 1, ... on streams [B, hc, dim] (then its own
    output streams) and the token after each position (first, then each draft) -> [B, k]."""
    drafts, tok, s = [], first, streams
    for j in range(k):
        logits, out = model.mtp_decode_tokens(s.unsqueeze(1), tok.unsqueeze(1), pos + j)
        tok, s = logits[:, 0].argmax(-1), out[:, 0]
        drafts.append(tok)
    return torch.stack(drafts, dim=1)


@torch.no_grad()
def speculative_greedy(model, prompt: torch.Tensor, max_new_tokens: int, k: int,
                       lengths: torch.Tensor | None = None) -> tuple[list[list[int]], SpeculationStats]:
    """Greedy continuation of prompt [B, L] (right-padded rows: lengths) by max_new_tokens tokens per row with k
    MTP drafts per step. Returns (the new tokens per row, SpeculationStats)."""
    B, L = prompt.shape
    dev = model.device
    prompt = prompt.to(dev)
    lengths = torch.full((B,), L, device=dev) if lengths is None else lengths.to(dev)
    _check(model, k, int(lengths.max()) + max_new_tokens + 2 * k)
    rows = torch.arange(B, device=dev)
    h = model.streams(prompt, lengths)
    y = model._logits(h[rows, lengths - 1]).argmax(-1)  # the first new token, at position lengths
    if L > 1:  # the MTP block's cache over the prompt: position t reads (h_t, token t + 1)
        model.mtp_forward(h[:, :-1], prompt[:, 1:], lengths - 1)
    drafts = _draft(model, h[rows, lengths - 1], y, lengths - 1, k)
    pos = lengths.clone()  # where y goes
    out = [[int(t)] for t in y.tolist()]
    stats = SpeculationStats(rows=B, accepted=[0] * k, offered=[0] * k)
    while min(len(o) for o in out) < max_new_tokens:
        logits, hs = model.decode_tokens_streams(torch.cat([y.unsqueeze(1), drafts], dim=1), pos)
        g = logits.argmax(-1)  # [B, k + 1]: the greedy token after each verified position
        n_acc = (drafts == g[:, :k]).int().cumprod(dim=1).sum(dim=1)  # leading drafts that match
        # the MTP block at the verified positions (its cache for the committed ones), the first draft read at the
        # last accepted position; the rest chained from there
        m_logits, m_out = model.mtp_decode_tokens(hs, g, pos)
        first = m_logits[rows, n_acc].argmax(-1)
        nxt = torch.cat([first.unsqueeze(1), _draft(model, m_out[rows, n_acc], first, pos + n_acc + 1, k - 1)],
                        dim=1) if k > 1 else first.unsqueeze(1)
        y, drafts, pos = g[rows, n_acc], nxt, pos + n_acc + 1
        g_host, n_host = g.tolist(), n_acc.tolist()  # the step's one host read
        for b in range(B):
            out[b].extend(g_host[b][: n_host[b] + 1])
            for j in range(k):
                stats.offered[j] += j <= n_host[b]
                stats.accepted[j] += j < n_host[b]
        stats.steps += 1
        stats.emitted += sum(n + 1 for n in n_host)
    return [o[:max_new_tokens] for o in out], stats

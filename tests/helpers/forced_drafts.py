"""Drafts forced to chosen tokens (speculation tests): token(b, t) -> the token the MTP block drafts from row b's
position t (its draft for token t + 2), or None to keep the block's own. Wraps the two places a step's drafting
logits come from: mtp.decode_tokens ([B, T, V] at positions + j: the chained drafts, the first ones after prefill)
and speculative.draft_chain's first logits ([B, V] at pos - 1: the head on the verified row each row drafts from)."""
from dsv4_model.model import mtp
from dsv4_model.runtime import speculative


def force_drafts(monkeypatch, token) -> None:
    real_tokens, real_chain = mtp.decode_tokens, speculative.draft_chain

    def force(logits, b, j, t):
        v = token(b, t)
        if v is not None:
            logits[b, j, v] = 1e9

    def decode_tokens(model, h, next_ids, positions, *a, **k):
        logits, out = real_tokens(model, h, next_ids, positions, *a, **k)
        for b in range(logits.shape[0]):
            for j in range(logits.shape[1]):
                force(logits, b, j, int(positions[b]) + j)
        return logits, out

    def draft_chain(model, logits, streams, pos, *a, **k):
        logits = logits.clone().unsqueeze(1)
        for b in range(logits.shape[0]):
            force(logits, b, 0, int(pos[b]) - 1)
        return real_chain(model, logits[:, 0], streams, pos, *a, **k)

    monkeypatch.setattr(mtp, "decode_tokens", decode_tokens)
    monkeypatch.setattr(speculative, "draft_chain", draft_chain)

"""Greedy DSpark speculation, eager, without an engine: dsv4_model.runtime.dspark_speculative's steps (prefill_taps,
dspark_step) in a plain loop with one host read per step and the whole block verified. The tests' oracle for those
steps (generate(..., speculate=k) is the served path)."""
import torch

from dsv4_model.runtime.dspark_speculative import check_dspark_model, dspark_step, prefill_taps
from dsv4_model.runtime.speculative import SpeculationStats


@torch.no_grad()
def dspark_greedy(model, prompt: torch.Tensor, max_new_tokens: int,
                  lengths: torch.Tensor | None = None) -> tuple[list[list[int]], SpeculationStats]:
    """Greedy continuation of prompt [B, L] (right-padded rows: lengths) by max_new_tokens per row, drafting with
    model.dspark. Returns (the new tokens per row, SpeculationStats with K = block_size, every pass kept with
    its confidence: `judged`)."""
    dspark = check_dspark_model(model)
    K = dspark.block_size
    B, L = prompt.shape
    dev = model.device
    prompt = prompt.to(dev)
    lengths = torch.full((B,), L, device=dev) if lengths is None else lengths.to(dev)
    if int(lengths.max()) + max_new_tokens + 2 * K > model.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens + 2 x block_size = {int(lengths.max()) + max_new_tokens + 2 * K}"
                         f" positions exceed max_seq_len={model.max_seq_len}")
    rows = torch.arange(B, device=dev)
    y = prefill_taps(model, dspark, prompt, lengths).argmax(-1)  # the first new token, at position lengths
    first = dspark.draft(model, y, lengths - 1)
    drafts, confidence = first.tokens, first.confidence.sigmoid()
    pos = lengths.clone()
    out = [[int(t)] for t in y.tolist()]
    stats = SpeculationStats(K, judged=[])
    while min(len(o) for o in out) < max_new_tokens:
        judged = (confidence * 1000).round().long().tolist()  # the drafts this step verifies
        emitted, n_acc, drafts, _, confidence, _ = dspark_step(model, dspark, y, drafts, pos)
        y, pos = emitted[rows, n_acc], pos + n_acc + 1
        e_host, n_host = emitted.tolist(), n_acc.tolist()  # the step's one host read
        for b in range(B):
            out[b].extend(e_host[b][: n_host[b] + 1])
        stats.count(n_host, judged)
    return [o[:max_new_tokens] for o in out], stats

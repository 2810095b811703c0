"""Greedy speculative decoding, eager, without an engine: the steps of dsv4_model.runtime.speculative
(first_drafts, verify_step) in a plain loop with one host read per step. The tests' oracle for those steps
(generate(..., speculate=k) is the served path)."""
import torch

from dsv4_model.model import mtp
from dsv4_model.model.decode_options import DecodeOptions
from dsv4_model.runtime.speculative import Sampler, SpeculationStats, check_model, first_drafts, verify_step


@torch.no_grad()
def speculative_greedy(model, prompt: torch.Tensor, max_new_tokens: int, k: int,
                       lengths: torch.Tensor | None = None) -> tuple[list[list[int]], SpeculationStats]:
    """Greedy continuation of prompt [B, L] (right-padded rows: lengths) by max_new_tokens tokens per row with k
    MTP drafts per step, eager and without an engine (generate(..., speculate=k) is the served path). Returns
    (the new tokens per row, SpeculationStats)."""
    B, L = prompt.shape
    dev = model.device
    prompt = prompt.to(dev)
    lengths = torch.full((B,), L, device=dev) if lengths is None else lengths.to(dev)
    check_model(model, k)
    if int(lengths.max()) + max_new_tokens + 2 * k > model.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens + 2 x speculate = {int(lengths.max()) + max_new_tokens + 2 * k}"
                         f" positions exceed max_seq_len={model.max_seq_len}")
    opts = DecodeOptions()
    zeros = torch.zeros(B, dtype=torch.long, device=dev)
    s = Sampler("greedy", zeros.float(), zeros, zeros.float() + 1, zeros, zeros)
    rows = torch.arange(B, device=dev)
    h = model.streams(prompt, lengths)
    y = model._logits(h[rows, lengths - 1]).argmax(-1)  # the first new token, at position lengths
    if L > 1:  # the MTP block's cache over the prompt: position t reads (h_t, token t + 1)
        mtp.prefill(model, h[:, :-1], prompt[:, 1:], lengths - 1)
    drafts, q = first_drafts(model, h[rows, lengths - 1], y, lengths - 1, k, s, opts)
    pos = lengths.clone()  # where y goes
    out = [[int(t)] for t in y.tolist()]
    stats = SpeculationStats(k)
    while min(len(o) for o in out) < max_new_tokens:
        emitted, n_acc, drafts, q, _ = verify_step(model, y, drafts, q, pos, s, opts)
        y, pos = emitted[rows, n_acc], pos + n_acc + 1
        e_host, n_host = emitted.tolist(), n_acc.tolist()  # the step's one host read
        for b in range(B):
            out[b].extend(e_host[b][: n_host[b] + 1])
        stats.count(n_host)
    return [o[:max_new_tokens] for o in out], stats

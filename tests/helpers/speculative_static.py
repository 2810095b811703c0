"""generate(speculate=K)'s former static loop, kept as the tests' reference for the speculative scheduler: one batch
prefilled together (the MTP block's cache too), its first tokens and drafts, then speculative steps until every row
has ended, on the SpeculativeRunner's own start / step path (no scheduler)."""
from __future__ import annotations

import torch

from dsv4_model.runtime.generate import right_padded
from dsv4_model.runtime.speculative import sampling_mode
from dsv4_model.runtime.speculative_generate import speculative_steps


@torch.no_grad()
def static_speculative(engine, runner, ids: list[list[int]], params, max_new_tokens: int, stops: set[int]):
    """-> (token ids per row, finish reasons, SpeculationStats)."""
    runner.prepare(len(ids), sampling_mode(params))  # before prefill: warm-up steps write the caches
    engine.reset()
    padded, lengths = right_padded(ids)
    logits, last = engine.prefill(padded, lengths=lengths, speculate=True)
    runner.begin(lengths, params)
    first = runner.sample_first(logits)
    runner.start(last)
    rows, stats, _, _ = speculative_steps(runner, first.tolist(), [len(p) for p in ids], max_new_tokens, stops,
                                          None, None, 0)
    return rows.out, rows.reasons, stats

"""generate(speculate=K)'s former static loop, kept as the tests' reference for the speculative scheduler: one batch
prefilled together (the MTP block's cache too), its first tokens and drafts, then speculative steps until every row
has ended, on the runner's own begin / start / step path (no scheduler), the host keeping up to two steps in
flight."""
from __future__ import annotations

import torch

from dsv4_model.runtime.generate import RowSink, right_padded
from dsv4_model.runtime.speculative import SpeculationStats, sampling_mode


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


def speculative_steps(runner, first: list[int], lengths: list[int], max_new_tokens: int, stops: set[int], stream,
                      tok, row0: int) -> tuple[RowSink, SpeculationStats, int, list[int]]:
    """The host side of a batch's speculative steps (an MTP or a DSpark runner, begun and started): emit the first
    tokens, then keep up to two steps in flight, reading each one's [rows, k + 2] tensor once (pinned, event) and
    emitting what every row accepted; rows that end are retired (their position stays). Returns (the rows' tokens
    and finish reasons, the acceptance counts, the steps launched, each row's position after its last token)."""
    B, k, on_cuda = len(first), runner.k, runner.device.type == "cuda"
    pinned = [torch.empty(B, k + 2, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
    events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
    stats = SpeculationStats(k)
    pos = list(lengths)  # where each row's last emitted token goes
    retired_at: list[int | None] = [None] * B  # the first step launched after the row finished

    def retire(b: int) -> None:
        runner.retire(b)
        retired_at[b] = launched

    rows = RowSink(B, stops, stream, tok, row0, on_finish=retire)

    def launch(slot: int) -> None:
        pinned[slot].copy_(runner.step(), non_blocking=on_cuda)
        if on_cuda:
            events[slot].record()

    launched = read = 0
    first_host = first
    for b in range(B):
        rows.emit(b, first_host[b], max_new_tokens, "length")
    while True:
        # up to two steps in flight ahead of the host while some row still needs tokens
        while launched - read < 2 and not rows.done() and runner.can_step():
            launch(launched % 2)
            launched += 1
        if read == launched:
            break
        if on_cuda:
            events[read % 2].synchronize()
        host = pinned[read % 2].tolist()
        read += 1
        counted = []
        for b in range(B):
            n = host[b][k + 1]
            if retired_at[b] is None or read <= retired_at[b]:  # (read - 1: the index of this step)
                pos[b] += n + 1
            if rows.reasons[b] is None:
                counted.append(n)
                for t in host[b][: n + 1]:
                    if rows.reasons[b] is None:
                        rows.emit(b, t, max_new_tokens, "length")
        stats.count(counted)
        runner.settle(max(pos), launched - read)
    for b in range(B):
        if rows.reasons[b] is None:  # the caches are full before max_new_tokens
            rows.finish(b, "max_seq_len")
    return rows, stats, launched, pos

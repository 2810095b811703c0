"""DSpark speculative steps on static buffers: a `DecodeRunner` whose step verifies the last token and K DSpark drafts
(`dspark_speculative.dspark_step`: one multi-token decode of the main model reading the DSpark target layers'
streams, greedy acceptance, the accepted positions committed to the DSpark rings, the next block drafted), advancing
each live row by what it accepted. Compiled and captured like the plain step, one CUDA graph per batch bucket; the
host reads one [rows, K + 2] tensor per step (the emitted tokens, then their count), as for MTP
(`speculative_runner.py`).

Use: `prepare(B)` before prefill, `dspark_speculative.prefill_taps` (prefill seeding the DSpark rings), then
`begin(positions, params)`, `start(first_tokens)` (the first drafts), `step()` per step, `retire(row)` when a row
ends."""
from __future__ import annotations

import torch

from dsv4_model.runtime.compiled import DecodeRunner
from dsv4_model.runtime.dspark_speculative import check_dspark_model, dspark_step


class DSparkRunner(DecodeRunner):
    def __init__(self, model, k: int, **options):
        self.dspark = check_dspark_model(model, k)
        if options.get("regional"):
            raise ValueError("DSpark speculative steps compile whole (regional=False)")
        self.k = k
        super().__init__(model, **options)
        R = self.max_rows
        self.drafts = torch.zeros(R, k, dtype=torch.long, device=self.device)
        self.live = torch.zeros(R, dtype=torch.long, device=self.device)  # 1: a live row (0: padding, or ended)

    @property
    def mode_name(self) -> str:
        return f"{super().mode_name}, DSpark speculate {self.k}"

    def _key(self, n: int):
        return (n, "dspark")

    def _inputs(self, n: int) -> tuple:
        return (self.tokens[:n], self.positions[:n], self.live[:n], self.drafts[:n])

    def _step_impl(self, tokens, positions, live, drafts):
        emitted, n_acc, nxt = dspark_step(self.model, self.dspark, tokens, drafts, positions, self.step_options)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        tokens.copy_(emitted[rows, n_acc])
        positions.add_((n_acc + 1) * live)  # padding and ended rows stay where they are
        drafts.copy_(nxt.tokens[:, : self.k])
        return (torch.cat([emitted, n_acc.unsqueeze(1)], dim=1),)

    def _reset_buffers(self) -> None:
        super()._reset_buffers()
        self.drafts.zero_()
        self.live.zero_()

    @torch.no_grad()
    def begin(self, positions, params) -> None:
        super().begin(positions, params)
        self.live[: self.rows] = 1

    @torch.no_grad()
    def start(self, first: torch.Tensor) -> None:
        """The first tokens [rows] (at each row's position, from the prefill's logits) and the first drafts,
        drafted from them (eager: once per batch)."""
        n = self.rows
        self.tokens[:n].copy_(first)
        self.drafts[:n].copy_(self.dspark.draft(self.model, first, self.positions[:n] - 1).tokens[:, : self.k])

    def retire(self, row: int) -> None:
        """Row `row` has ended: steps launched from now on leave its position where it is."""
        self.live[row] = 0

    def can_step(self) -> bool:
        """A step writes positions up to its last token's + 2k."""
        return self._next_pos + 2 * self.k < self.model.max_seq_len

    def settle(self, max_position: int, in_flight: int) -> None:
        """The largest row position read back, and the steps launched after the read: the next step's bound."""
        self._next_pos = max_position + (self.k + 1) * in_flight

    @torch.no_grad()
    def step(self, replay: bool = True) -> torch.Tensor:
        """One step of the live batch -> [rows, k + 2] int64: row b emitted tokens [:n_b + 1] of its first k + 1
        columns, n_b (its accepted drafts) in the last. A static buffer in graph modes."""
        if not self.can_step():
            raise ValueError(f"DSpark step from position {self._next_pos}: the caches hold max_seq_len="
                             f"{self.model.max_seq_len} positions and a step may write {2 * self.k} past it")
        self._next_pos += self.k + 1
        return self._run(replay)[0][: self.rows]

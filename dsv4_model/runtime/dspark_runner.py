"""DSpark speculative steps on static buffers: a `DecodeRunner` whose step verifies the last token and K DSpark drafts
(`dspark_speculative.dspark_step`: one multi-token decode of the main model reading the DSpark target layers'
streams, greedy acceptance, the accepted positions committed to the DSpark rings, the next block drafted), advancing
each live row by what it accepted. Compiled and captured like the plain step, one CUDA graph per batch bucket; the
host reads one [rows, K + 2] tensor per step (the emitted tokens, then their count), as for MTP
(`speculative_runner.py`).

Use (as `speculative_runner.SpeculativeRunner`): `prepare(B)` before prefill, `dspark_speculative.prefill_taps` (prefill seeding the DSpark rings), then
`begin(positions, params)`, `start(first_tokens)` (the first drafts), `step()` per step, `retire(row)` when a row
ends."""
from __future__ import annotations

import torch

from dsv4_model.runtime.dspark_speculative import check_dspark_model, dspark_step
from dsv4_model.runtime.speculative_runner import DraftingRunner


class DSparkRunner(DraftingRunner):
    def __init__(self, model, k: int, **options):
        self.dspark = check_dspark_model(model, k)
        super().__init__(model, k, **options)

    @property
    def mode_name(self) -> str:
        return f"{super().mode_name}, DSpark speculate {self.k}"

    def _key(self, n: int):
        return (n, "dspark")

    def _inputs(self, n: int) -> tuple:
        return (self.tokens[:n], self.positions[:n], self.live[:n], self.drafts[:n])

    def _step_impl(self, tokens, positions, live, drafts):
        emitted, n_acc, nxt = dspark_step(self.model, self.dspark, tokens, drafts, positions, self.step_options,
                                          live)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        tokens.copy_(emitted[rows, n_acc])
        positions.add_((n_acc + 1) * live)  # padding and ended rows stay where they are
        drafts.copy_(nxt.tokens[:, : self.k])
        return (torch.cat([emitted, n_acc.unsqueeze(1)], dim=1),)

    @torch.no_grad()
    def start(self, first: torch.Tensor) -> None:
        """The first tokens [rows] (at each row's position, from the prefill's logits) and the first drafts,
        drafted from them (eager: once per batch)."""
        n = self.rows
        self.tokens[:n].copy_(first)
        self.drafts[:n].copy_(self.dspark.draft(self.model, first, self.positions[:n] - 1).tokens[:, : self.k])

    @torch.no_grad()
    def start_rows(self, rows: list[int], streams, last: list[int], hold: torch.Tensor, state: torch.Tensor) -> None:
        """The first drafts of `rows`, each of which has just sampled its first token (sample_rows) after its
        prompt's last position last[i] (committed to the DSpark rings by the prefill); the row decodes from
        last[i] + 1. The draft runs over rows [:max(rows) + 1] (it only reads the rings: the others' drafts are
        kept). streams: unused (the MTP runner's first drafts read them)."""
        n = max(rows) + 1
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        at = torch.tensor(last, dtype=torch.long, device=self.device)
        pos = self._ride(n, hold, state)[0].index_copy(0, idx, at)
        drafts = self.dspark.draft(self.model, self.tokens[:n], pos).tokens[:, : self.k]
        self.drafts.index_copy_(0, idx, drafts.index_select(0, idx))
        self.positions.index_copy_(0, idx, at + 1)

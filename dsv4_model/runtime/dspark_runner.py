"""DSpark speculative steps on static buffers: a `DraftingRunner` whose step verifies the last token and K DSpark
drafts (`dspark_speculative.dspark_step`: one multi-token decode of the main model reading the DSpark target layers'
streams, acceptance on the device (greedy, or the rejection rule when sampling), the accepted positions committed to
the DSpark rings, the next block drafted), advancing each live row by what it accepted. Compiled and captured like
the plain step, one CUDA graph per (batch bucket, sampling mode); the host reads one [rows, 2K + 2] tensor per step
(the emitted tokens, their count, as for MTP in `speculative_runner.py`, then the confidence head's predicted chance
of acceptance of each draft the step verified, in thousandths: what `SpeculationStats` sets against the measured
acceptance). The scheduler drives it
(`speculative_scheduler.py`: prefill chunks commit the rings, `start_rows` drafts a row's first block, `launch`
steps)."""
from __future__ import annotations

import torch

from dsv4_model.runtime.dspark_speculative import check_dspark_model, draft_block, dspark_step
from dsv4_model.runtime.speculative_runner import DraftingRunner


class DSparkRunner(DraftingRunner):
    def __init__(self, model, k: int, **options):
        self.dspark = check_dspark_model(model, k)
        self.draws_per_step = k + 1 + self.dspark.block_size  # k acceptances, the correction, the block's drafts
        super().__init__(model, k, **options)
        self.confidence = torch.zeros(self.max_rows, k, device=self.device)

    @property
    def mode_name(self) -> str:
        return f"{super().mode_name}, DSpark speculate {self.k}"

    def _inputs(self, n: int) -> tuple:
        return (*super()._inputs(n), self.confidence[:n])

    def _step_impl(self, tokens, positions, live, temperature, top_k, top_p, seed, offset, drafts, q, confidence):
        s = self._sampler(temperature, top_k, top_p, seed, offset)
        emitted, n_acc, nxt, nq, nconf = dspark_step(self.model, self.dspark, tokens, drafts, positions,
                                                     self.step_options, live, s, q)
        judged = (confidence * 1000).round().long()  # the verified drafts' (drafted by the step before)
        out, = self._advance(tokens, positions, live, offset, drafts, q, emitted, n_acc, nxt, nq)
        confidence.copy_(nconf)
        return (torch.cat([out, judged], dim=1),)

    def _first_drafts(self, idx: torch.Tensor, streams, pos: torch.Tensor, s):
        # the block drafted from each row's first token (the draft only reads the rings the prefill committed)
        return draft_block(self.model, self.dspark, self.tokens[:pos.shape[0]], pos, self.k, s, 0)

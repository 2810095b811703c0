"""DSpark speculative steps on static buffers: a `DraftingRunner` whose step verifies the last token and K DSpark
drafts (`dspark_speculative.dspark_step`: one multi-token decode of the main model reading the DSpark target layers'
streams, acceptance on the device (greedy, or the rejection rule when sampling), the accepted positions committed to
the DSpark rings, the next block drafted), advancing each live row by what it accepted. Compiled and captured like
the plain step, one CUDA graph per (batch bucket, sampling mode); the host reads one [rows, 2K + 2] tensor per step
(the emitted tokens, their count, as for MTP in `speculative_runner.py`, then the confidence head's predicted chance
of acceptance of each draft the step verified, in thousandths: what `SpeculationStats` sets against the measured
acceptance; -1 for a draft the cut left out).

cut (0: off): a row's block is cut before its first draft predicted below `cut`, on the device inside the step
(docs/dspark.md, "The confidence cut"): the drafts after it are not offered, and the positions after it go to no
routed expert, so the verification reads fewer experts; the step's shape does not change. The scheduler drives it
(`speculative_scheduler.py`: prefill chunks commit the rings, `start_rows` drafts a row's first block, `launch`
steps)."""
from __future__ import annotations

import torch

from dsv4_model.runtime.dspark_speculative import check_dspark_model, draft_block, dspark_step
from dsv4_model.runtime.speculative_runner import DraftingRunner


class DSparkRunner(DraftingRunner):
    reach_per_draft = 1  # a step writes the verified k + 1 positions only (drafting reads the rings, writes nothing)

    def __init__(self, model, k: int, cut: float = 0.0, **options):
        if not isinstance(cut, (int, float)) or isinstance(cut, bool) or not 0.0 <= cut <= 1.0:
            raise ValueError(f"cut must be a predicted chance in [0, 1] (0: off), got {cut!r}")
        self.dspark = check_dspark_model(model, k)
        self.cut = float(cut)
        self.draws_per_step = k + 1 + self.dspark.block_size  # k acceptances, the correction, the block's drafts
        super().__init__(model, k, **options)
        self.confidence = torch.zeros(self.max_rows, k, device=self.device)

    @property
    def mode_name(self) -> str:
        return f"{super().mode_name}, DSpark speculate {self.k}" + (f", cut {self.cut:g}" if self.cut else "")

    def _inputs(self, n: int) -> tuple:
        return (*super()._inputs(n), self.confidence[:n])

    def _step_impl(self, tokens, positions, live, temperature, top_k, top_p, seed, offset, drafts, q, confidence):
        s = self._sampler(temperature, top_k, top_p, seed, offset)
        limit = None
        judged = (confidence * 1000).round().long()  # the drafts' (drafted by the step before)
        if self.cut:
            kept = (confidence >= self.cut).int().cumprod(dim=1)
            limit = kept.sum(dim=1)
            judged = torch.where(kept.bool(), judged, -1)
        emitted, n_acc, nxt, nq, nconf, logits = dspark_step(self.model, self.dspark, tokens, drafts, positions,
                                                     self.step_options, live, s, q, limit)
        out, logits = self._advance(tokens, positions, live, offset, drafts, q, emitted, n_acc, nxt, nq, logits)
        confidence.copy_(nconf)
        return torch.cat([out, judged], dim=1), logits

    def _first_drafts(self, idx: torch.Tensor, streams, pos: torch.Tensor, s):
        # the block drafted from each row's first token (the draft only reads the rings the prefill committed)
        return draft_block(self.model, self.dspark, self.tokens[:pos.shape[0]], pos, self.k, s, 0)

"""Speculative decode steps on static buffers (dsv4_model.runtime.speculative holds the step's math): a
`DecodeRunner` whose step verifies the last token and K drafts, accepts on the device, drafts K more and advances
each row by what it accepted. Compiled and captured like the plain step, one CUDA graph per (batch bucket,
sampling mode); the host reads one [rows, K + 2] tensor per step (the emitted tokens, then their count). The
verification's logits [rows, K + 1, V] are the step's second output (`last_logits`), read only for logprobs.

Use: `prepare(B, mode)` before prefill, prefill with the MTP block's cache (Engine.prefill(...,
speculate=True)), `begin(positions, params)`, `sample_first(logits)`, `start(last_streams)`, then `step()` while
`can_step()`, telling the runner the rows' positions read back (`settle`) so it can bound the next step's."""
from __future__ import annotations

import torch

from dsv4_model.model.to_device import device_longs, to_device
from dsv4_model.runtime.compiled import DecodeRunner
from dsv4_model.runtime.speculative import (SAMPLING_MODES, Sampler, check_model, first_drafts, sampling_mode,
                                            verify_step)


class DraftingRunner(DecodeRunner):
    """What the speculative runners share (MTP's below, DSpark's in dspark_runner.py): k drafts per row on static
    buffers, live rows (ended ones stay where they are), the host's bound on the positions a step writes, and the
    step's [rows, k + 2] output (DSpark's adds the drafts' confidence: `width`)."""

    draws_per_step: int  # the Philox draws a step makes per row (a subclass's): step j's are offsets j * this + i
    reach_per_draft = 2  # a step from position p writes below p + reach_per_draft * k (MTP: the verified k + 1
    # positions, then the chained drafts' own; a subclass whose drafting writes nothing needs less)
    confidence: torch.Tensor | None = None  # the drafts' predicted chance of acceptance [R, k] (a drafter that has one)

    def __init__(self, model, k: int, **options):
        if options.get("regional"):
            raise ValueError("speculative steps compile whole (regional=False)")
        self.k = k
        self.sampling = "greedy"
        super().__init__(model, **options)
        R = self.max_rows
        self.drafts = torch.zeros(R, k, dtype=torch.long, device=self.device)
        self.live = torch.zeros(R, dtype=torch.long, device=self.device)  # 1: a row of the batch (not padding)
        self.q: torch.Tensor | None = None  # the drafts' distributions [R, k, V], allocated for sampled modes

    def _key(self, n: int):
        return (n, self.sampling)

    def _inputs(self, n: int) -> tuple:
        q = None if self.sampling == "greedy" else self.q[:n]
        return (self.tokens[:n], self.positions[:n], self.live[:n], *self.sampler.rows(n), self.drafts[:n], q)

    def _sampler(self, temperature, top_k, top_p, seed, offset) -> Sampler:
        return Sampler(self.sampling, temperature, top_k, top_p, seed, offset * self.draws_per_step)

    def _advance(self, tokens, positions, live, offset, drafts, q, emitted, n_acc, nxt, nq, logits) -> tuple:
        """A step's state after its verdict: each row's last emitted token and position (by what it accepted),
        the next drafts; -> the step's outputs: [rows, k + 2] and the verification's logits [rows, k + 1, V]."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        tokens.copy_(emitted[rows, n_acc])
        positions.add_((n_acc + 1) * live)  # padding and ended rows stay where they are
        offset.add_(1)
        drafts.copy_(nxt)
        if q is not None:
            q.copy_(nq)
        return torch.cat([emitted, n_acc.unsqueeze(1)], dim=1), logits

    @torch.no_grad()
    def prepare(self, rows: int, mode: str | None = None) -> int:
        """Compile / capture the bucket of `rows` for sampling mode `mode` (the current one if None)."""
        if mode is not None:
            self._set_mode(mode)
        return super().prepare(rows)

    def _set_mode(self, mode: str) -> None:
        if mode not in SAMPLING_MODES:
            raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
        self.sampling = mode
        if mode != "greedy" and self.q is None:
            self.q = torch.zeros(self.max_rows, self.k, self.model.config.vocab_size, device=self.device)

    @property
    def width(self) -> int:
        """Columns of a step's output per row: the emitted tokens (k + 1), the count, then the confidence in
        thousandths of each of the k drafts the step verified where the drafter predicts it."""
        return self.k + 2 + (self.k if self.confidence is not None else 0)

    def _reset_buffers(self) -> None:
        super()._reset_buffers()
        self.drafts.zero_()
        self.live.zero_()
        if self.confidence is not None:
            self.confidence.zero_()

    @torch.no_grad()
    def begin(self, positions, params) -> None:
        self._set_mode(sampling_mode(params))
        super().begin(positions, params)
        self.live[: self.rows] = 1

    def retire(self, row: int) -> None:
        """Row `row` has finished: steps launched from now on leave its position where it is (a finished row
        riding along would otherwise run ahead by up to k + 1 per step and end the others' room early)."""
        self.live[row] = 0

    @property
    def reach(self) -> int:
        """Positions past a row's that a step may write (MTP: 2k, the verified k + 1 and the chained drafts')."""
        return self.reach_per_draft * self.k

    def can_step(self) -> bool:
        """Whether a step fits the caches: it writes positions below its last token's + reach."""
        return self._next_pos + self.reach < self.model.max_seq_len

    def settle(self, max_position: int, in_flight: int) -> None:
        """The largest row position read back, and the steps launched after the read: the next step's bound."""
        self._next_pos = max_position + (self.k + 1) * in_flight

    @torch.no_grad()
    def step(self, replay: bool = True) -> torch.Tensor:
        """One speculative step of the live batch -> [rows, width] int64: row b emitted tokens [:n_b + 1] of
        its first k + 1 columns, n_b (its accepted drafts) in column k + 1 (then the drafts' confidence where the
        drafter predicts it). A static buffer in graph modes."""
        if not self.can_step():
            raise ValueError(f"speculative step from position {self._next_pos}: the caches hold max_seq_len="
                             f"{self.model.max_seq_len} positions and a step may write {self.reach} past it")
        self._next_pos += self.k + 1
        out, logits = self._run(replay)
        self.last_logits = logits[: self.rows]
        return out[: self.rows]


    # ------------------------------------------------------------------ rows joining and leaving (the scheduler)
    def set_mode(self, mode: str) -> None:
        """The sampling mode of the steps from now on (its buckets prepared: prepare(rows, mode))."""
        self._set_mode(mode)

    def _ride(self, n: int, hold: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [:n]' positions for a pass inside a running batch -> (positions, room, state) on the device: state
        (host) 1 or 2: the row's own, 0: hold (host); a position without room for a step's writes (reach ahead)
        becomes 0 (room False: what that row holds is lost, and the scheduler stops reusing it)."""
        st = to_device(state[:n], self.device)
        pos = torch.where(st > 0, self.positions[:n], to_device(hold[:n], self.device))
        room = pos + self.reach < self.model.max_seq_len
        return torch.where(room, pos, 0), room, st

    @torch.no_grad()
    def launch(self, rows: int, hold: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One speculative step of rows [:rows] inside a running batch, padded to their bucket (prepared for the
        current mode): state [bucket] (host) 2: the row steps, 1: it rides along at its own position, 0: at
        hold[r]. Returns the bucket's [bucket, width] as step()'s, the count -1 for a row without room for a step
        (it rode along at position 0 instead); the verification's logits [bucket, k + 1, V] stay in last_logits."""
        n = self.bucket(rows)
        if (self.compile or self.cuda_graphs) and self._key(n) not in self._ready:
            raise RuntimeError(f"step {self._key(n)} is not prepared: prepare it before any row holds a sequence")
        self.padded, self.rows = n, n
        pos, room, st = self._ride(n, hold, state)
        self.positions[:n].copy_(pos)
        self.live[:n].copy_(((st == 2) & room).long())
        out, self.last_logits = self._run()
        k = self.k
        count = torch.where(room, out[:, k + 1], -1).unsqueeze(1)
        return torch.cat([out[:, :k + 1], count, out[:, k + 2:]], dim=1)


    @torch.no_grad()
    def start_rows(self, rows: list[int], streams: torch.Tensor | None, last: list[int], hold: torch.Tensor,
                   state: torch.Tensor) -> None:
        """The first drafts of `rows`, each of which has just sampled its first token (sample_rows) after its
        prompt's last position last[i]; the row decodes from last[i] + 1. streams: the main streams there
        ([len(rows), hc, dim]; what the MTP block reads, None for DSpark). The drafter runs over rows
        [:max(rows) + 1]: the others ride along (hold / state as launch's) and keep their drafts."""
        n = max(rows) + 1
        idx = device_longs(rows, self.device)
        at = device_longs(last, self.device)
        pos = self._ride(n, hold, state)[0].index_copy(0, idx, at)
        drafts, q, confidence = self._first_drafts(idx, streams, pos, self._sampler(*self.sampler.rows(n)))
        self.drafts.index_copy_(0, idx, drafts.index_select(0, idx))
        if q is not None:
            self.q.index_copy_(0, idx, q.index_select(0, idx))
        if confidence is not None:
            self.confidence.index_copy_(0, idx, confidence.index_select(0, idx))
        self.positions.index_copy_(0, idx, at + 1)
        self.sampler.offset.index_fill_(0, idx, 2)  # the first token drew at offset 0, these drafts at 1

    def _first_drafts(self, idx: torch.Tensor, streams: torch.Tensor | None, pos: torch.Tensor, s: Sampler):
        """rows [:len(pos)]' first k drafts, their q (None when greedy) and their confidence (None: the drafter
        predicts none) from the last prompt positions pos (a subclass's)."""
        raise NotImplementedError


class SpeculativeRunner(DraftingRunner):
    def __init__(self, model, k: int, **options):
        check_model(model, k)
        self.draws_per_step = 2 * k + 1  # k acceptances, the correction, k drafts
        super().__init__(model, k, **options)

    @property
    def mode_name(self) -> str:
        return f"{super().mode_name}, speculate {self.k}"

    def _step_impl(self, tokens, positions, live, temperature, top_k, top_p, seed, offset, drafts, q):
        s = self._sampler(temperature, top_k, top_p, seed, offset)
        emitted, n_acc, nxt, nq, logits = verify_step(self.model, tokens, drafts, q, positions, s, self.step_options,
                                                      live)
        return self._advance(tokens, positions, live, offset, drafts, q, emitted, n_acc, nxt, nq, logits)

    def _first_drafts(self, idx: torch.Tensor, streams: torch.Tensor, pos: torch.Tensor, s: Sampler):
        # the MTP block at each row's last prompt position, on the main streams there
        h = streams.new_zeros(pos.shape[0], *streams.shape[1:]).index_copy(0, idx, streams)
        return (*first_drafts(self.model, h, self.tokens[:pos.shape[0]], pos, self.k, s, self.step_options), None)

    @torch.no_grad()
    def start(self, last_streams: torch.Tensor) -> None:
        """The first drafts, after sample_first: the MTP block at each row's last prompt position on the main
        streams there [rows, hc, dim] (eager: once per batch)."""
        n = self.rows
        t, k, p, seed, off = self.sampler.rows(n)
        s = self._sampler(t, k, p, seed, off)
        drafts, q = first_drafts(self.model, last_streams, self.tokens[:n], self.positions[:n] - 1, self.k, s,
                                 self.step_options)
        self.drafts[:n].copy_(drafts)
        if q is not None:
            self.q[:n].copy_(q)
        off.add_(1)

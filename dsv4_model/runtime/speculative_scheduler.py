"""Continuous batching with speculative decoding (the MTP block or DSpark, docs/speculation.md): the Scheduler's
iterations with a speculative step (verify the last token and K drafts, draft K more) in place of the decode step,
so a generating row emits 1 .. K + 1 tokens per iteration.

What changes against the plain scheduler (docs/speculation.md, "Speculative steps in the scheduler"):
- prefill chunks fill the drafter's state too (the MTP block's cache / DSpark's rings); the iteration a prompt
  ends, its row samples its first token and drafts its first K (`start_rows`);
- a generating row's position advances on the device by what it accepted, so the host knows it only after the
  read; the step keeps generating rows at their own positions and puts every other row at the host's (`state`);
- a row that rides along accepts nothing: it writes its position's K + 1 slots ahead, as a step that rejects every
  draft, which the row's own next chunk or step rewrites first (the model's rings have K spare slots);
- a step writes up to the runner's reach past a row's position (MTP: 2K, its chained drafts write too; DSpark: K):
  prompts leave that room (refused above max_seq_len - reach), and a row that reaches it ends with "max_seq_len".
"""
from __future__ import annotations

import torch

from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.scheduler import Scheduler, _Flight, _Row, prepare_buckets
from dsv4_model.runtime.speculative import SAMPLING_MODES, SpeculationStats, sampling_mode
from dsv4_model.runtime.step_plan import StepPlan


def prepare_modes(runner, rows: int | None, modes: tuple[str, ...]) -> int:
    """prepare_buckets for each sampling mode (under torchrun every rank prepares the same: warm-ups are collective)."""
    for mode in modes:
        runner.set_mode(mode)
        rows = prepare_buckets(runner, rows)
    return rows


class SpeculativeScheduler(Scheduler):
    """A Scheduler whose decode steps are speculative with `k` drafts (an Engine whose model was built with
    spare_window_slots >= k): method "mtp" (its MTP block) or "dspark" (its DSpark module).
    modes: the sampling modes prepared (compiled / captured) up front, cheapest first ("greedy", "sample",
    "filter"); each iteration runs the cheapest that serves its rows, and a request no prepared mode serves is
    refused. `speculation`: the acceptance counts. dspark_cut: DSpark's confidence cut (dspark_runner.py; 0: off)."""

    def __init__(self, engine, k: int, *, method: str = "mtp", modes: tuple[str, ...] = ("greedy", "filter"),
                 dspark_cut: float = 0.0, **options):
        if method not in ("mtp", "dspark"):
            raise ValueError(f"method must be 'mtp' or 'dspark', got {method!r}")
        if dspark_cut and method != "dspark":
            raise ValueError("dspark_cut: the confidence cut is DSpark's (method='dspark'); the MTP block predicts none")
        self.dspark_cut = dspark_cut
        if not modes or any(m not in SAMPLING_MODES for m in modes):
            raise ValueError(f"modes must be a non-empty tuple of {SAMPLING_MODES}, got {modes!r}")
        self.k, self.method = k, method
        # the MTP block's state at position t reads token t + 1: a snapshot for prompts sharing m tokens is taken at
        # m - 1, where it holds nothing of token m (DSpark's rings hold each position's own streams)
        self.snapshot_lag = int(method == "mtp")
        self.modes = tuple(m for m in SAMPLING_MODES if m in modes)
        self.speculation = SpeculationStats(k)
        super().__init__(engine, **options)
        self.limit = self.max_seq_len - self.runner.reach  # a step at position p writes below p + reach
        R = self.runner.max_rows
        self._hold_host = [torch.zeros(R, dtype=torch.long, pin_memory=self._on_cuda) for _ in range(2)]
        self._state_host = [torch.zeros(R, dtype=torch.long, pin_memory=self._on_cuda) for _ in range(2)]
        self._first_rows: list[_Row] = []  # rows whose first drafts this iteration's plan makes

    def _make_runner(self, engine):
        if self.method == "mtp":
            return engine.speculative_runner(self.k)
        return engine.dspark_runner(self.k, cut=self.dspark_cut) if self.dspark_cut else engine.dspark_runner(self.k)

    def _prepare(self, rows: int | None) -> int:
        return prepare_modes(self.runner, rows, self.modes)

    def _decode_width(self) -> int:
        return self.runner.width

    def _check(self, req: Request) -> None:
        super()._check(req)
        if req.prompt_logprobs is not None and self.method == "dspark":  # its chunks commit taps, not streams
            raise ValueError("prompt_logprobs: not with DSpark speculation")
        if len(req.prompt) > self.limit:
            raise ValueError(f"prompt: {len(req.prompt)} tokens leave no room for speculative steps (at most "
                             f"max_seq_len - {self.runner.reach} = {self.limit}: a step writes {self.runner.reach} "
                             f"positions past a row's)")
        need = sampling_mode([req.params])
        if SAMPLING_MODES.index(need) > SAMPLING_MODES.index(self.modes[-1]):
            raise ValueError(f"sampling: this server's speculative steps are prepared for {self.modes} only, and "
                             f"these parameters need {need!r}")

    # ------------------------------------------------------------------ planning
    def _chunk_planned(self, plan: StepPlan, parts, done: list[_Row]) -> None:
        """The drafter's inputs over the chunk (MTP: position t reads token t + 1, one short on a prompt's last
        position, drafted on from its first token by start_rows; DSpark: the chunk's positions committed to its
        rings); for the rows it ends, their first drafts."""
        if self.method == "dspark":
            plan.dspark = True
        else:
            tokens, lengths, start = plan.prefill
            nxt = torch.zeros_like(tokens)
            nlen = torch.zeros_like(lengths)
            for row, n, i in parts:
                s = row.filled - n
                follow = row.req.prompt[s + 1:s + n + 1]
                nxt[i, :len(follow)] = torch.tensor(follow, dtype=torch.long)
                nlen[i] = len(follow)
            plan.mtp_next = (nxt, nlen)
        self._first_rows = list(done)
        if not done:
            return
        plan.first_last = [len(r.req.prompt) - 1 for r in done]
        top = max(r.index for r in done) + 1
        ending = {r.index for r in done}
        plan.first_hold = torch.tensor([0 if r.index in ending else r.harmless_position(self.limit)
                                        for r in self.rows[:top]], dtype=torch.long)
        plan.first_state = torch.tensor([int(r.phase == "decode") for r in self.rows[:top]], dtype=torch.long)
        for r in done:
            r.pending = 1  # its first token

    def _plan_decode(self, plan: StepPlan, flight: _Flight, slot: int) -> None:
        # a row steps while its known tokens and one per unread step or first token stay under its cap (a row past
        # it finishes on a read already launched)
        live = [r for r in self._decoding if len(r.req.token_ids) + r.pending < r.cap]
        params = [r.req.params for r in self._first_rows + live]
        self._first_rows = []
        if params:
            need = SAMPLING_MODES.index(sampling_mode(params))
            plan.mode = next(m for m in self.modes if SAMPLING_MODES.index(m) >= need)
        if not live:
            return
        n = live[-1].index + 1
        bucket = self.runner.bucket(n)
        hold, state = self._hold_host[slot], self._state_host[slot]
        hold[:bucket].zero_()
        state[:bucket].zero_()
        for r in self.rows[:bucket]:
            if r.phase == "decode":
                state[r.index] = 1
            else:
                hold[r.index] = r.harmless_position(self.limit)
        for r in live:
            state[r.index] = 2
            r.pending += 1
        plan.decode_rows, plan.positions, plan.state = n, hold[:bucket], state[:bucket]
        flight.decode = [(r.index, r.req) for r in live]
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(live)
        self.stats.decode_bucket_rows += bucket

    # ------------------------------------------------------------------ reading
    def _decode_logits(self, plan: StepPlan, flight: _Flight, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the verification's K + 1 positions: the token emitted at each was decided from its main-model logits
        return plan.decode_logits[i], flight.decode_ids[i, :self.k + 1]

    def _take(self, row: _Row, req: Request, t: int, now: float, logprob=None) -> None:
        if row.req is req:  # (a row taken over since: the newcomer's count started at 0)
            row.pending -= 1
        super()._take(row, req, t, now, logprob)

    def _free(self, row: _Row, reason: str, now: float) -> None:
        # A step of the request still unread has written positions the host does not know yet (the host learns a
        # row's position from the read), and the steps the row rides along in from now write over them: what the
        # row holds is no sequence to continue.
        if row.pending > 0:
            row.owner = None
        super()._free(row, reason, now)

    def _read_decode(self, flight: _Flight, now: float) -> None:
        """Each row's [width]: its emitted tokens [:n + 1], then n (-1: the row had no room and rode at 0), then
        (DSpark) the verified drafts' confidence in thousandths."""
        by_row = flight.decode_ids.tolist()
        k, rows, eos = self.k, self.rows, self.eos
        for i, out in enumerate(by_row):
            if out[k + 1] < 0 and rows[i].req is None:
                rows[i].owner = None  # its caches were overwritten at position 0
        counted, judged = [], []
        for i, req in flight.decode:
            row = rows[i]
            if row.req is not req or req.finish_reason is not None:
                continue
            row.pending -= 1
            n = by_row[i][k + 1]
            if n < 0:
                row.owner = None
                self._free(row, "max_seq_len", now)
                continue
            counted.append(n)
            judged.append(by_row[i][k + 2:])
            for j, t in enumerate(by_row[i][:n + 1]):
                row.seq.append(t)
                row.filled = len(row.seq) - 1  # where the latest token goes (the next step feeds it)
                logprob = self._logprob(flight, "decode", req, j)
                if t in req.stop_ids or (t in eos and not req.ignore_eos):
                    self._stopped(row, req, t, now, logprob)
                elif req.add_token(t, now, logprob):
                    self._free(row, "stop", now)
                elif len(req.token_ids) >= row.cap:
                    self._free(row, "length" if len(req.token_ids) >= req.max_tokens else "max_seq_len", now)
                else:
                    continue
                if j < n:  # ended inside the accepted run: the device fed tokens past seq's end
                    row.owner = None
                break
        self.speculation.count(counted, judged if self.runner.confidence is not None else None)

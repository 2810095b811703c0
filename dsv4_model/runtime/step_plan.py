"""What one scheduler iteration runs on the device, as data: the rows admitted (their sampling parameters), the
cache rows copied (prefix snapshots: into an admitted row before the chunk, out of a chunk's row after it), one
prefill chunk, the rows that sample their first token from it, and one decode step (rows and positions).

The scheduler decides a plan on the host, then runs it. Under torchrun (expert parallelism) rank 0 decides and
broadcasts the plan as two int64 tensors (a 2-value header, then the body), and every other rank runs the same
plan (`follow`): the ranks execute the same collectives in the same order and never disagree, with no pickled
objects per step. The sampled ids are equal on every rank (same logits, same seeds), so they stay on the device.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch

from dsv4_model.model.to_device import device_longs
from dsv4_model.runtime.sampling import SamplingParams, seed_key


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(i)))[0]


@dataclass
class StepPlan:
    admits: list[tuple[int, SamplingParams]] = field(default_factory=list)
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # tokens [B, S], lengths [B], start [B]
    first_rows: list[int] = field(default_factory=list)
    first_slots: list[int] = field(default_factory=list)  # each first row's row of the prefill logits
    swaps: list[tuple[int, int]] = field(default_factory=list)  # cache rows exchanged around the prefill
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) cache rows copied before the prefill
    keeps: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) cache rows copied after the prefill
    decode_rows: int = 0  # the step runs rows [:decode_rows] (padded to their bucket)
    protect: list[int] = field(default_factory=list)  # riding rows whose compressor states the step must not keep
    positions: torch.Tensor | None = None  # host [bucket]
    stop: bool = False
    # speculative steps (dsv4_model.runtime.speculative_scheduler): the steps' sampling
    # mode, the MTP block's inputs over the prefill chunk (next ids [B, S], next lengths [B]), each first row's
    # last prompt position, and how the rows ride along: state [bucket] (host) 2 steps, 1 rides at its own
    # position, 0 at `positions` (for the first drafts: first_hold / first_state over rows [:highest first + 1])
    mode: str | None = None
    mtp_next: tuple[torch.Tensor, torch.Tensor] | None = None
    dspark: bool = False  # the chunk commits its positions to the DSpark rings (DSpark speculation)
    first_last: list[int] = field(default_factory=list)
    first_hold: torch.Tensor | None = None
    first_state: torch.Tensor | None = None
    state: torch.Tensor | None = None
    # prompt log-probabilities over the chunk: (chunk rows scored, next ids [B, S], next lengths [B], k), run
    # through Engine.prefill_scored (every rank: the same path); the scores stay on the plan (`scores`)
    score: tuple[list[int], torch.Tensor, torch.Tensor, int] | None = None

    def run(self, engine, runner) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the plan on this rank -> (first ids [len(first_rows)], decode ids [decode_rows]), device tensors. The
        logits they were sampled from stay on the plan (prefill_logits [B, V], decode_logits [decode_rows, V]) until
        the next step overwrites them."""
        for row, params in self.admits:
            runner.sampler.set_row(row, params)
        if self.copies:  # admitted rows continue from a prefix snapshot
            engine.copy_rows(self.copies)
        if self.mode is not None:
            runner.set_mode(self.mode)
        first = ids = None
        if self.prefill is not None:
            if self.swaps:  # the chunk's rows down to rows [:B], and back after it
                engine.swap_rows(self.swaps)
            drafting = self.mtp_next is not None or self.dspark
            streams = None
            if self.score is not None:  # (not with DSpark: the scheduler refuses prompt logprobs there)
                self.prefill_logits, streams, self.scores = engine.prefill_scored(*self.prefill, self.score,
                                                                                 mtp_next=self.mtp_next)
            elif drafting:
                self.prefill_logits, streams = engine.prefill_at(*self.prefill, mtp_next=self.mtp_next,
                                                                 dspark=self.dspark)
            else:
                self.prefill_logits = engine.prefill_at(*self.prefill)
            if self.swaps:
                engine.swap_rows(self.swaps)
            if self.keeps:  # the state of a prompt's prefix where the chunk ended, kept in a free row
                engine.copy_rows(self.keeps)
            if self.first_rows:
                first = runner.sample_rows(self.prefill_logits, self.first_rows, self.first_slots)
                if drafting:
                    at = None if streams is None else streams.index_select(
                        0, device_longs(self.first_slots, streams.device))  # (a list index would sync)
                    runner.start_rows(self.first_rows, at, self.first_last, self.first_hold, self.first_state)
        if self.decode_rows:
            restore = engine.protect_rows(self.protect) if self.protect else None
            if self.state is None:
                ids = runner.launch(self.decode_rows, self.positions)
            else:
                ids = runner.launch(self.decode_rows, self.positions, self.state)
            self.decode_logits = runner.last_logits
            if restore is not None:
                restore()
        return first, ids

    # ------------------------------------------------------------------ wire format
    def encode(self) -> torch.Tensor:
        """[stop, n_admit, B, S, n_first, decode_rows, n_positions, n_swaps, n_protect, mode, draft_in (1 MTP,
        2 DSpark), n_first_ctx, has_state, n_score, score_k, n_copies, n_keeps] + admits (row, temperature bits,
        top_k, top_p bits, seed) + first rows + first slots + swap pairs + copy pairs + keep pairs + protect +
        first_last + first_hold + first_state + scored rows
        + lengths, starts, tokens + MTP next lengths, next ids + scored next lengths, next ids + positions +
        state."""
        from dsv4_model.runtime.speculative import SAMPLING_MODES

        B, S = (0, 0) if self.prefill is None else tuple(self.prefill[0].shape)
        npos = 0 if self.positions is None or not self.decode_rows else self.positions.shape[0]
        mode = 0 if self.mode is None else 1 + SAMPLING_MODES.index(self.mode)
        nctx = 0 if self.first_hold is None else self.first_hold.shape[0]
        has_state = int(self.state is not None and npos > 0)
        score = self.score if self.score is not None and B else None
        head = [int(self.stop), len(self.admits), B, S, len(self.first_rows), self.decode_rows, npos, len(self.swaps),
                len(self.protect), mode, 2 if self.dspark else int(self.mtp_next is not None), nctx, has_state,
                -1 if score is None else len(score[0]), 0 if score is None else score[3], len(self.copies),
                len(self.keeps)]
        adm = [v for row, p in self.admits
               for v in (row, _f2i(p.temperature), p.top_k, _f2i(p.top_p), seed_key(p.seed))]
        swaps = [v for pair in self.swaps + self.copies + self.keeps for v in pair]
        last = self.first_last if self.mtp_next is not None or self.dspark else []
        ctx = [] if not nctx else self.first_hold.tolist() + self.first_state.tolist()
        scored = [] if score is None else list(score[0])
        parts = [torch.tensor(head + adm + self.first_rows + self.first_slots + swaps + self.protect + last + ctx
                              + scored, dtype=torch.long)]
        if self.prefill is not None:
            tokens, lengths, start = self.prefill
            parts += [lengths.long(), start.long(), tokens.long().reshape(-1)]
            if self.mtp_next is not None:
                parts += [self.mtp_next[1].long(), self.mtp_next[0].long().reshape(-1)]
            if score is not None:
                parts += [score[2].long(), score[1].long().reshape(-1)]
        if npos:
            parts.append(self.positions.long())
            if has_state:
                parts.append(self.state.long())
        return torch.cat(parts)

    @classmethod
    def decode(cls, t: torch.Tensor) -> "StepPlan":
        from dsv4_model.runtime.speculative import SAMPLING_MODES

        v = t.tolist()
        stop, na, B, S, nf, dr, npos, nsw, npr, mode, draft_in, nctx, has_state, nscore, score_k, ncp, nkp = v[:17]
        i = 17
        admits = []
        for _ in range(na):
            row, temp, top_k, top_p, seed = v[i:i + 5]
            admits.append((row, SamplingParams(_i2f(temp), top_k, _i2f(top_p), seed)))
            i += 5
        first, slots = v[i:i + nf], v[i + nf:i + 2 * nf]
        i += 2 * nf
        pairs = [(v[i + 2 * j], v[i + 2 * j + 1]) for j in range(nsw + ncp + nkp)]
        swaps, copies, keeps = pairs[:nsw], pairs[nsw:nsw + ncp], pairs[nsw + ncp:]
        i += 2 * len(pairs)
        protect = v[i:i + npr]
        i += npr
        plan = cls(admits, None, first, slots, swaps, copies, keeps, dr, protect, None, bool(stop))
        plan.mode = SAMPLING_MODES[mode - 1] if mode else None
        plan.dspark = draft_in == 2  # (the chunk's drafting inputs: 1 the MTP block's, 2 DSpark's taps)
        if draft_in:
            plan.first_last = v[i:i + nf]
            i += nf
        if nctx:
            plan.first_hold, plan.first_state = t[i:i + nctx], t[i + nctx:i + 2 * nctx]
            i += 2 * nctx
        scored = v[i:i + max(nscore, 0)]
        i += max(nscore, 0)
        if B:
            lengths, start = t[i:i + B], t[i + B:i + 2 * B]
            tokens = t[i + 2 * B:i + 2 * B + B * S].view(B, S)
            plan.prefill = (tokens, lengths, start)
            i += 2 * B + B * S
            if draft_in == 1:
                plan.mtp_next = (t[i + B:i + B + B * S].view(B, S), t[i:i + B])
                i += B + B * S
            if nscore >= 0:
                plan.score = (scored, t[i + B:i + B + B * S].view(B, S), t[i:i + B], score_k)
                i += B + B * S
        if npos:
            plan.positions = t[i:i + npos]
            i += npos
            if has_state:
                plan.state = t[i:i + npos]
        return plan


_PLAN_GROUPS: dict = {}


def plan_group(group=None, *, separate: bool | None = None):
    """The group rank 0's plans travel through: `group` itself (None: the default group) when it is gloo's, else a
    gloo group of the same ranks, made once by every rank at the same point (the scheduler's set-up on rank 0,
    `follow` on the others, both before their first collective). Over NCCL a follower's broadcast would queue on
    its GPU behind the step still running there and reading the plan on the host would wait for that step; through
    gloo it receives plan n + 1 while its GPU runs step n. separate=True: the gloo group even over gloo (tests)."""
    import torch.distributed as dist

    if separate is None:
        separate = dist.get_backend(group) != "gloo"
    if not separate:
        return group
    key = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if key not in _PLAN_GROUPS:  # (by its ranks: None and the world group are one group, and ids get reused)
        _PLAN_GROUPS[key] = dist.new_group(ranks=list(key), backend="gloo")
    return _PLAN_GROUPS[key]


def forget_plan_groups() -> None:
    """Drop the plan groups made so far (the process group they belong to is being destroyed)."""
    _PLAN_GROUPS.clear()


def broadcast_plan(plan: StepPlan | None, group=None, pin: bool = False) -> StepPlan:
    """Rank 0 of `group` (a gloo group: `plan_group`) sends `plan`; every other rank receives it (pass None). Two
    broadcasts of host tensors: the body's length, the body (received into pinned memory with pin: the plan's
    positions and tokens then reach the GPU without a stream sync)."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not None else 0
    sending = dist.get_rank(group) == 0
    body = plan.encode() if sending else None
    n = torch.tensor([body.numel() if sending else 0], dtype=torch.long)
    dist.broadcast(n, src, group=group)
    if not sending:
        body = torch.empty(int(n.item()), dtype=torch.long, pin_memory=pin)
    dist.broadcast(body, src, group=group)
    return plan if sending else StepPlan.decode(body)


def follow(engine, rows: int | None = None, group=None, speculate: int = 0, modes: tuple[str, ...] = (),
           method: str = "mtp", dspark_cut: float = 0.0) -> int:
    """A rank other than 0: run the plans rank 0's Scheduler(engine, rows=, group=) broadcasts until it sends stop
    (Scheduler.close). Prepares the same buckets first (their warm-up steps are collectives too); speculate /
    modes / method / dspark_cut: those of rank 0's SpeculativeScheduler. Returns the plans run."""
    from dsv4_model.runtime.scheduler import prepare_buckets

    wire = plan_group(group)  # (before any collective: rank 0's scheduler makes it at the same point)
    if speculate:
        from dsv4_model.runtime.speculative_scheduler import prepare_modes

        dspark = method == "dspark"
        runner = engine.dspark_runner(speculate, cut=dspark_cut) if dspark else engine.speculative_runner(speculate)
        prepare_modes(runner, rows, modes)
    else:
        runner = engine.runner()
        prepare_buckets(runner, rows)
    engine.reset()
    n = 0
    with torch.no_grad():
        while True:
            plan = broadcast_plan(None, wire, pin=engine.device.type == "cuda")
            if plan.stop:
                return n
            if plan.score is not None:  # the same prefill path as rank 0's; the scores are rank 0's to read
                plan.score = ([],) + plan.score[1:]
            plan.run(engine, runner)
            n += 1

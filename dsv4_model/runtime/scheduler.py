"""Continuous batching: requests join and leave a running batch between decode steps.

The cache rows are slots. Each iteration (`Scheduler.step`):
  1. cancelled requests end and free their rows;
  2. waiting requests take free rows (a row whose cached sequence the prompt extends is reused: only the new
     tokens are prefilled; a prefix snapshot the prompt extends is copied into the row taken);
  3. one prefill chunk runs for rows still reading their prompt (each row's chunks are `max_prefill_tokens` long
     from its own start, several rows per chunk while the budget lasts; a chunk ends at a snapshot position the
     request asked for, and the row's state there is copied into a free row), and the rows that finish their
     prompt sample their first token;
  4. one decode step runs for the rows that are generating, in the smallest bucket holding the highest of them;
  5. the host reads the previous iteration's ids (one device -> host copy per iteration), emits tokens and ends
     requests, while the device runs this iteration's work.

Rows never move. A row inside the decode bucket that is not generating (free, or between its prompt's chunks)
rides along at the position where its next token would go: what the step writes there (window ring, compressor
state, an entry closing there) is what that row's next prefill or decode rewrites before anything reads it, so
it changes nothing (docs/architecture.md, "Continuous batching"). The price: a bucket may hold idle rows
when live rows are not the lowest ones; new requests take the lowest free rows to keep buckets small.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import numbers
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from dsv4_model.model.checks import check_positive_int
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.step_plan import StepPlan, broadcast_plan, plan_group

DEFAULT_MAX_PREFILL_TOKENS = 2048
# a shorter prefix is not worth a snapshot: its prefill costs about what an extra chunk boundary does
DEFAULT_SNAPSHOT_MIN_TOKENS = 256
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's chat API allows 20)


def prepare_buckets(runner, rows: int | None) -> int:
    """Compile / capture the runner's buckets up to that of `rows` (default all), before any row holds a sequence
    (their warm-up steps write cache rows at position 0). Returns rows."""
    rows = runner.max_rows if rows is None else rows
    if not 1 <= rows <= runner.max_rows:
        raise ValueError(f"rows must be in [1, max_batch_size={runner.max_rows}], got {rows}")
    top = runner.bucket(rows)
    runner.prepare_all([b for b in runner.buckets if b <= top] or [top])
    return rows


@dataclass
class _Row:
    """One cache row. `seq` holds the tokens at positions [0, filled) once every fed id has been read back (and
    the latest sampled one after them); `owner` is the request whose sequence that is, kept after it ends so a
    later prompt that extends it can reuse the caches. A free row that is `shared` holds a prefix snapshot (its
    owner a negative id; `seq` the tokens a prompt must start with to use it: `filled` of them, one more where
    the drafter's state at the last position reads the token after it): admissions copy it rather than take it,
    while another free row is left."""

    index: int
    req: Request | None = None
    phase: str = "free"  # "free" | "prefill" | "decode"
    filled: int = 0  # the next position this row's sequence writes
    seq: list[int] = field(default_factory=list)
    owner: int | None = None
    produced: int = 0  # tokens of `req` launched: its first (from prefill) and one per decode step
    cap: int = 0  # tokens `req` may produce: max_tokens, or fewer where max_seq_len ends it
    pending: int = 0  # speculative steps: launches of `req` not read yet (each gives it one token or more)
    last_used: float = 0.0
    shared: bool = False
    key: int = 0  # a snapshot's: hash of seq (compared with _prefix_key before the tokens are)

    def harmless_position(self, limit: int) -> int:
        """Where the row rides along in a step it is not generating in: its sequence's end, or 0 from `limit` on
        (max_seq_len; a speculative step's writes need 2k more room): nothing continues a row there, so it is no use
        for reuse either (what it holds is lost)."""
        if self.filled >= limit:
            self.owner = None
            return 0
        return self.filled


@dataclass
class _Flight:
    """What one iteration launched and the host has not read yet: [(row, request)] and their ids."""

    first: list[tuple[int, Request]] = field(default_factory=list)
    first_ids: torch.Tensor | None = None
    decode: list[tuple[int, Request]] = field(default_factory=list)
    decode_ids: torch.Tensor | None = None
    event: object = None
    # logprobs: ("first" | "decode", request) -> its first entry in lp_host (chosen [m], top values [m, K], top ids
    # [m, K]); a speculative step's row has one entry per verified position
    lp_index: dict = field(default_factory=dict)
    lp_host: tuple | None = None
    # prompt logprobs of this iteration's chunk: (request, (chosen [m], top values [m, k], top ids [m, k]) on the host)
    prompt_lp: list = field(default_factory=list)

    def empty(self) -> bool:
        return not self.first and not self.decode and not self.prompt_lp


def _marks(req: Request) -> tuple[int, ...]:
    """The prompt positions a request's snapshots are wanted at: asked for, and learned (Request fields)."""
    return req.snapshot_at + req.learned_snapshot_at if req.learned_snapshot_at else req.snapshot_at


def _prefix_key(req: Request, m: int) -> int:
    """A hash of req.prompt[:m], made once per (request, m) and kept on the request."""
    keys = req.__dict__.setdefault("_prefix_keys", {})
    if m not in keys:
        keys[m] = hash(tuple(req.prompt[:m]))
    return keys[m]


def common_prefix(a: list[int], b: list[int]) -> int:
    """len of the longest common prefix of two id lists (slices compare in C: a bisection, not a Python loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def eos_ids(config) -> frozenset[int]:
    """The ids that end a completion: eos_token_id and, where the config lists several, each of them."""
    return frozenset({int(config.eos_token_id), *map(int, getattr(config, "eos_token_ids", ()))})


def _ended(req: Request) -> str:
    """A cancelled request's finish reason: "error" where its own callback raised (Request.callback_error)."""
    return "cancelled" if req.callback_error is None else "error"

ENGINE_BUSY = ("engine: another Scheduler on this engine holds requests (a server, or a generate() on another "
               "thread): submit to that one, or wait until it is idle")
_CLAIMS = threading.Lock()  # an engine changes hands one scheduler at a time
DRAIN_WAIT_S = 10.0  # how long a taker waits for an owner without requests to finish its step (one step's time)


@dataclass
class SchedulerStats:
    iterations: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    snapshots: int = 0  # prefix snapshots kept
    snapshot_hits: int = 0  # admissions that continued from a copy of one (also counted in reuse_hits)
    decode_rows: int = 0  # sum over decode steps of the rows generating
    decode_bucket_rows: int = 0  # sum over decode steps of the bucket's rows


class Scheduler:
    """Serves `Request`s on `engine` (an Engine: `model`, `runner()`, `prefill_at`, `get_tokenizer`).

    submit() from any thread; step() / run_until_idle() / serve_forever() on one thread. max_prefill_tokens: prompt
    tokens per iteration (a long prompt delays the generating rows by at most one chunk per token they emit).
    reuse: keep finished rows' sequences for prompts that extend them (evicted least recently used). snapshots: keep
    the prefix states requests ask for (Request.snapshot_at, at least snapshot_min_tokens long) in free rows, for
    later prompts that share them (with reuse, on an engine that copies cache rows). rows: use cache
    rows [:rows] only (default all; the buckets compiled / captured are those up to rows'). tokenizer: the requests'
    text (default the engine's). group: under torchrun, the process group whose rank 0 runs this scheduler while the
    other ranks run `step_plan.follow(engine, rows, group)`: each iteration's plan is broadcast (close() ends them).
    """

    def __init__(self, engine, *, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, reuse: bool = True,
                 snapshots: bool = True, snapshot_min_tokens: int = DEFAULT_SNAPSHOT_MIN_TOKENS,
                 rows: int | None = None, tokenizer=None, group=None, distributed: bool = False):
        check_positive_int(max_prefill_tokens, "max_prefill_tokens")
        check_positive_int(snapshot_min_tokens, "snapshot_min_tokens")
        self.snapshots = snapshots and reuse and hasattr(engine, "copy_rows")
        self.snapshot_min_tokens = snapshot_min_tokens
        self.engine = engine
        self._lock = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self.rows: list[_Row] = []
        self._flight: _Flight | None = None
        self._stopping = self._in_step = False
        self._step_thread: int | None = None
        self._await_owner_drain()
        with _CLAIMS:
            self._acquire()
        try:
            self._setup(engine, max_prefill_tokens, reuse, rows, tokenizer, group, distributed)
        except BaseException:
            with _CLAIMS:  # nobody drives the engine now: the next scheduler to submit takes it
                if getattr(engine, "_dsv4_scheduler", lambda: None)() is self:
                    engine._dsv4_scheduler = None
            raise

    def _setup(self, engine, max_prefill_tokens, reuse, rows, tokenizer, group, distributed) -> None:
        self.max_prefill_tokens = max_prefill_tokens
        self.reuse = reuse
        self.max_seq_len = engine.max_seq_len
        self.vocab_size = engine.vocab_size
        self.eos = eos_ids(engine.config)  # (a config may list several: HF's eos_token_id as a list)
        self.tokenizer = tokenizer if tokenizer is not None else engine.get_tokenizer()
        self.group, self.distributed = group, distributed or group is not None
        # (before the runner's first collective: the followers make it at the same point, step_plan.follow)
        self._wire = plan_group(group) if self.distributed else None
        self.runner = self._make_runner(engine)
        self.rows = [_Row(i) for i in range(self._prepare(rows))]
        self._admits: list[tuple[int, object]] = []  # sampler rows to set in the next plan
        self._copies: list[tuple[int, int]] = []  # (snapshot row, admitted row) to copy in the next plan
        self._snapshot_ids = itertools.count(-1, -1)
        self.on_step = None  # called on the scheduler's thread after each step (a server delivers its events then)
        self._closed = False
        model = getattr(engine, "model", None)
        self._ratios = sorted(model.compressor_ratios()) if hasattr(model, "compressor_ratios") else []
        self._decoding: list[_Row] = []  # rows in phase "decode", by index (the hot loop's list)
        self._prefilling: list[_Row] = []  # rows in phase "prefill", in order of admission
        self._any_cancel = threading.Event()  # set by Request.cancel(): only then are the rows searched
        self.stats = SchedulerStats()
        self._on_cuda = self.runner.device.type == "cuda"
        self._pos_host = [torch.zeros(self.runner.max_rows, dtype=torch.long, pin_memory=self._on_cuda)
                          for _ in range(2)]
        # each flight's ids read back: the first tokens [rows], then the decode step's [rows, *decode_shape]
        width = 1 + self._decode_width()
        self._ids_host = [torch.zeros(width * self.runner.max_rows, dtype=torch.long, pin_memory=self._on_cuda)
                          for _ in range(2)]
        self._slot = 0
        engine.reset()

    def _acquire(self) -> None:
        """Make this scheduler the one that drives the engine's cache rows (under _CLAIMS). generate() makes a
        scheduler per call, a server holds one: one of them may take the engine from another only while that one
        holds no request and runs no step; what the taker kept in the caches for reuse is then forgotten (the
        other wrote them)."""
        ref = getattr(self.engine, "_dsv4_scheduler", None)
        cur = ref() if ref is not None else None
        if cur is self:
            return
        if cur is not None:
            with cur._lock:
                if cur._in_step or cur._holds_requests() or not cur._drained():
                    raise RuntimeError(ENGINE_BUSY)
        with self._lock:
            for r in self.rows:
                r.owner, r.seq, r.filled = None, [], 0
        self.engine.reset()
        self.engine._dsv4_scheduler = weakref.ref(self)

    # ------------------------------------------------------------------ callers
    def submit(self, req: Request) -> Request:
        """Queue `req` (checked here: a bad request raises ValueError and is not queued; a Request runs once)."""
        if self._stopping:
            raise RuntimeError("this scheduler is stopped (stop() is final): make a new one")
        if req.timings.submitted:
            raise ValueError("request: already submitted (a Request runs once: make a new one for another run)")
        self._check(req)
        req.timings.submitted = time.perf_counter()
        req.start_text(self.tokenizer)
        req._on_cancel = self._any_cancel.set
        if req.cancelled:  # cancelled before it got here: its cancel() had no scheduler to wake
            self._any_cancel.set()
        self._await_owner_drain()
        with _CLAIMS:  # owning the engine and queueing at once: no other scheduler takes it in between
            try:
                self._acquire()
            except RuntimeError:
                req.timings.submitted = None  # not queued: it may go to the scheduler that holds the engine
                raise
            with self._lock:
                if self._stopping:  # stopped since the check above: its loop would never run this request
                    req.timings.submitted = None
                    raise RuntimeError("this scheduler is stopped (stop() is final): make a new one")
                self._waiting.append(req)
                self._lock.notify()
        return req

    def _check(self, req: Request) -> None:
        vocab = self.vocab_size
        if not req.prompt:
            raise ValueError("prompt: needs at least one token")
        if len(req.prompt) > self.max_seq_len:
            raise ValueError(f"prompt: {len(req.prompt)} tokens exceed max_seq_len={self.max_seq_len}")
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} outside [0, vocab_size={vocab})")
        if req.prompt_logprobs is not None and not hasattr(self.engine, "prefill_scored"):
            raise ValueError("prompt_logprobs: this engine (an exported package) has no scored prefill")
        if req.prompt_logprobs is not None and not (isinstance(req.prompt_logprobs, int) and not
                                                    isinstance(req.prompt_logprobs, bool)
                                                    and 0 <= req.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs: must be an int in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs!r}")
        if not (req.prompt_logprobs is not None and req.max_tokens == 0):  # scoring a prompt may generate nothing
            check_positive_int(req.max_tokens, "max_tokens")
        req.params.validate()
        if not isinstance(req.snapshot_at, (tuple, list)) or any(
                isinstance(p, bool) or not isinstance(p, numbers.Integral) or not 0 < p < len(req.prompt)
                for p in req.snapshot_at):
            raise ValueError(f"snapshot_at: must be prompt positions p with 0 < p < len(prompt)={len(req.prompt)}, "
                             f"got {req.snapshot_at!r}")
        req.snapshot_at = tuple(int(p) for p in req.snapshot_at)
        if any(not isinstance(s, str) or not s for s in req.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if req.logprobs is not None and not (isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool)
                                             and 0 <= req.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: must be an int in [0, {MAX_LOGPROBS}], got {req.logprobs!r}")

    def _await_owner_drain(self) -> None:
        """Before _acquire (without _CLAIMS held, so no other submit waits on this one): the engine's scheduler
        whose last request ended inside a step (its caller has the answer) while the step, and the read of the
        step launched behind it, have not is draining, not busy: wait for that, at most DRAIN_WAIT_S (one step's
        time). Not from the owner's own step (a callback of its request): that step waits on this call."""
        ref = getattr(self.engine, "_dsv4_scheduler", None)
        cur = ref() if ref is not None else None
        if cur is None or cur is self or cur._step_thread == threading.get_ident():
            return
        with cur._lock:
            cur._lock.wait_for(lambda: cur._holds_requests() or (not cur._in_step and cur._drained()),
                               timeout=DRAIN_WAIT_S)

    def _drained(self) -> bool:
        """No step's results left to read: none launched, or this scheduler is stopped (it never reads again; the
        next scheduler starts from reset caches)."""
        return self._flight is None or self._stopping

    def _holds_requests(self) -> bool:
        return bool(self._waiting) or any(r.req is not None for r in self.rows)

    def idle(self) -> bool:
        with self._lock:
            waiting = bool(self._waiting)
        return not waiting and self._flight is None and all(r.req is None for r in self.rows)

    # ------------------------------------------------------------------ the loop
    def run_until_idle(self) -> None:
        """Step until nothing is left. A step that raises (Ctrl-C, out of memory) ends every request this
        scheduler holds with "error" (no caller waits forever) and stops it; the exception propagates."""
        try:
            while not self.idle():
                self.step()
        except BaseException:
            self._end_all("error")
            raise

    def serve_forever(self, poll_s: float = 0.05, heartbeat_s: float = 5.0) -> None:
        """Step while there is work, sleep on the queue while there is none, until stop(). Under torchrun an idle
        scheduler sends an empty plan every heartbeat_s (the following ranks wait in a broadcast, which would
        otherwise time out), and close()s at the end."""
        quiet_since = time.monotonic()
        try:
            while not self._stopping:
                if not self.idle():
                    self.step()
                    quiet_since = time.monotonic()
                    continue
                with self._lock:
                    if not self._waiting and not self._stopping:
                        self._lock.wait(poll_s)
                if self.distributed and time.monotonic() - quiet_since > heartbeat_s:
                    broadcast_plan(StepPlan(), self._wire)
                    quiet_since = time.monotonic()
        except BaseException:
            self._end_all("error")
            raise
        finally:
            self.close()
        self._end_all("cancelled")  # stopped: what it still held ends, so no caller waits forever

    def _end_all(self, reason: str) -> None:
        """The scheduler's end (the loop died: "error"; it was stopped: "cancelled"): every request it holds ends
        with `reason` and its row is freed, so no caller waits forever and another scheduler may take the engine;
        the callers hear it now (on_step: the loop runs no more steps to deliver it); later submits raise. The
        caches keep nothing for reuse (a step may have failed half way, or be launched and never read)."""
        now = time.perf_counter()
        with self._lock:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        for req in waiting:
            req.finish(reason, now)
        for row in self.rows:
            if row.req is not None:
                self._free(row, reason, now)
            row.owner = None
        self._flight = None
        if self.on_step is not None:
            self.on_step()

    def stop(self) -> None:
        """serve_forever returns after its current step, ending what it still holds ("cancelled"); final: later
        submits raise."""
        with self._lock:
            self._stopping = True
            self._lock.notify()

    def close(self) -> None:
        """Under torchrun: tell the following ranks to return (after the last step; once)."""
        if self.distributed and not self._closed:
            self._closed = True
            broadcast_plan(StepPlan(stop=True), self._wire)

    @torch.no_grad()
    def step(self) -> None:
        with self._lock:
            self._in_step = True  # (another scheduler may not take the engine mid-step: _acquire)
            self._step_thread = threading.get_ident()
        try:
            self._step()
        finally:
            with self._lock:
                self._in_step = False
                self._step_thread = None
                self._lock.notify_all()  # (a scheduler in _await_owner_drain waits for this step to end)

    def _step(self) -> None:
        now = time.perf_counter()
        self._end_cancelled(now)
        self._admit(now)
        flight = self._launch()
        if self._flight is not None:
            self._read(self._flight)
        self._flight = None if flight.empty() else flight
        self.stats.iterations += 1
        if self.on_step is not None:
            self.on_step()

    # ------------------------------------------------------------------ admission
    def _end_cancelled(self, now: float) -> None:
        if not self._any_cancel.is_set():
            return
        self._any_cancel.clear()
        with self._lock:
            gone = [r for r in self._waiting if r.cancelled]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            r.finish(_ended(r), now)
        for row in self.rows:
            if row.req is not None and row.req.cancelled:
                self._free(row, _ended(row.req), now)

    def _admit(self, now: float) -> None:
        """Waiting requests into free rows, in order; one whose prefix snapshot another row's prefill is about to
        keep waits for it (n samples of a prompt, conversations sharing a system prompt: the prefix is prefilled
        once) while those behind it go on."""
        deferred = 0
        while True:
            with self._lock:
                if len(self._waiting) <= deferred:
                    return
                first = self._waiting[deferred]
                if self._awaits_snapshot(first):
                    deferred += 1
                    continue
                row, start, copy = self._place(first.prompt, reuse=first.prompt_logprobs is None)
                if row is None:
                    return
                req = first
                del self._waiting[deferred]
                row.req = req  # (under the lock: idle() never sees the request in neither place)
            if self.snapshots and req.prompt_logprobs is None:
                self._learn_prefix(req, row, start)  # (before the row's kept sequence is replaced)
            if start == 0:
                row.owner, row.seq, row.filled = req.id, [], 0
            else:
                self.stats.reuse_hits += 1
                self.stats.reused_tokens += start
                req.reused_tokens = start
                src = row if copy is None or copy[0] is row else copy[0]  # whose caches the request continues
                self.stats.snapshot_hits += src.shared
                if copy is not None:  # the snapshot stays for others
                    self._plan_copy(copy[0].index, copy[1].index)
                    if copy[0] is row:  # the request takes its row; the snapshot moves up, out of the bucket
                        kept = copy[1]
                        kept.owner, kept.seq, kept.filled = row.owner, list(row.seq), row.filled
                        kept.shared, kept.pending, kept.key = True, 0, row.key
                    copy[1].last_used = copy[0].last_used = now
                row.owner, row.seq, row.filled = req.id, src.seq[:start], start
            row.req, row.phase, row.produced, row.pending, row.last_used = req, "prefill", 0, 0, now
            row.shared = False
            self._prefilling.append(row)
            row.cap = min(req.max_tokens, 1 + self.max_seq_len - len(req.prompt))
            req.timings.admitted = now
            self._admits.append((row.index, req.params))

    def _plan_copy(self, src: int, dst: int) -> None:
        """Copy row src into row dst before the next prefill. A plan's copies read every source before writing any
        row (Transformer.copy_rows_), so a source an earlier copy of this plan wrote is read
        where that copy read it, and a later copy into the same row replaces the earlier one."""
        origin = dict((d, s) for s, d in self._copies)
        self._copies = [(s, d) for s, d in self._copies if d != dst] + [(origin.get(src, src), dst)]

    def _awaits_snapshot(self, req: Request) -> bool:
        """Whether a free row exists and a row still prefilling will keep a snapshot of a longer prefix of req's
        prompt than a kept snapshot gives it: then req waits for it rather than prefill it again. A scheduling
        hint: prefixes compare by hashes (made once per request and position; this runs for waiting requests every
        iteration), a collision costs a wait, never tokens (_reusable compares the tokens)."""
        if not self.snapshots or req.prompt_logprobs is not None or not self._prefilling \
                or all(r.req is not None for r in self.rows):
            return False
        lag, prompt = self.snapshot_lag, req.prompt
        have = max((r.filled for r in self.rows if r.shared and r.owner is not None and r.req is None
                    and len(prompt) > max(r.filled, len(r.seq) - 1) and _prefix_key(req, len(r.seq)) == r.key),
                   default=0)
        for row in self._prefilling:
            for m in _marks(row.req):
                if have < m - lag and row.filled < m - lag and m - lag >= self.snapshot_min_tokens \
                        and len(prompt) > max(m - lag, m - 1) and _prefix_key(req, m) == _prefix_key(row.req, m):
                    return True
        return False

    def _learn_prefix(self, req: Request, row: _Row, start: int) -> None:
        """A prompt that shares a prefix of at least snapshot_min_tokens beyond what it continues from with another
        row's sequence (kept, or a request's prompt) asks for a snapshot there: a third prompt that shares it then
        continues from a copy (prefixes the requests did not mark: raw completions, a shared document, a prompt
        sent again)."""
        prompt, floor, lag = req.prompt, start + self.snapshot_min_tokens, self.snapshot_lag
        if len(prompt) <= floor + lag:
            return
        best = 0
        for r in self.rows:
            if r.owner is None:
                continue
            seq = r.seq if r.req is None or r is row else r.req.prompt  # (row: what it kept until now)
            k = max(best, floor - 1)  # the position it must share to beat best and reach floor: probed first
            if len(seq) > k and k < len(prompt) and seq[k] == prompt[k] and seq[:k] == prompt[:k]:
                best = common_prefix(prompt, seq)
        m = min(best, len(prompt) - 1)
        if m - lag >= max(floor, self.snapshot_min_tokens) and m not in _marks(req):
            req.learned_snapshot_at = tuple(sorted({*req.learned_snapshot_at, m}))

    def _place(self, prompt: list[int], reuse: bool = True) -> tuple[_Row | None, int, tuple[_Row, _Row] | None]:
        """(row, first position to prefill, (src, dst) rows to copy first or None) for a prompt: a free row whose
        sequence it extends (the longest), else a fresh row (`_fresh`). A prefix snapshot stays: it is copied into
        a fresh row (src = the snapshot, dst = row), or, where that row would lie outside the decode bucket the
        live rows need and the snapshot inside it, the prompt takes the snapshot's row and the snapshot is copied
        up into the other (src = row); where it is the last free row it is taken. reuse=False: no kept sequence is
        continued (a scored prompt needs every position's logits)."""
        free = [r for r in self.rows if r.req is None]
        if not free:
            return None, 0, None
        if self.reuse and reuse:
            best, best_len = None, 0
            for r in free:
                n = self._reusable(r, prompt)
                if n > best_len or (n and n == best_len and best.shared and not r.shared):
                    best, best_len = r, n
            if best is not None:
                if best.shared and len(free) > 1:
                    dst = self._fresh([r for r in free if r is not best])
                    if dst.index >= self._limit() > best.index:
                        return best, best_len, (best, dst)
                    return dst, best_len, (best, dst)
                return best, best_len, None
        return self._fresh(free), 0, None

    def _limit(self) -> int:
        """Rows below this are inside the decode bucket the live rows need with one more: the bucket of one more
        live row, or the one the highest live row's steps run already."""
        busy = [r.index for r in self.rows if r.req is not None]
        limit = self.runner.bucket(len(busy) + 1)
        return max(limit, self.runner.bucket(max(busy) + 1)) if busy else limit

    def _fresh(self, free: list[_Row]) -> _Row:
        """A row for a prompt prefilled from its start (or a snapshot's copy): a free row inside the decode bucket
        the live rows need (one the step covers already, or the bucket of one more live row): the lowest empty
        one, else the least recently used (what it kept is evicted). A warm row higher up is not taken: a request
        there would make every step run a larger bucket (after a burst of requests all rows are warm, and a lone
        request on row 31 would step bucket 32)."""
        limit = self._limit()
        within = [r for r in free if r.index < limit] or free[:1]
        empty = [r for r in within if r.owner is None]
        if empty:
            return empty[0]
        return min(within, key=lambda r: r.last_used)

    def _reusable(self, row: _Row, prompt: list[int]) -> int:
        """Prompt positions row's caches already hold: the whole written sequence when the prompt extends it, else 0
        (a shorter shared prefix is no use: positions written after it have overwritten the window ring and
        compressor state it needs; a prefix snapshot keeps a row's state at a chosen position for that)."""
        n = row.filled
        if row.owner is None or n == 0 or len(row.seq) < n or n >= self.max_seq_len:
            return 0
        if row.shared:  # a snapshot: the prompt starts with its key and goes on past it
            key = row.seq
            return n if len(prompt) > max(n, len(key) - 1) and prompt[:len(key)] == key else 0
        # the whole sequence, and at least one new token (its logits): continuing from an earlier position would
        # read window-ring slots and compressor state rows that later positions have overwritten. (List slices
        # compare in C: a per-token Python loop over every free row's sequence costs ms per admission.)
        return n if len(prompt) > n and prompt[:n] == row.seq[:n] else 0

    def _free(self, row: _Row, reason: str, now: float) -> None:
        req = row.req
        if row.phase == "decode":
            self._decoding.remove(row)
        elif row.phase == "prefill":
            self._prefilling.remove(row)
        row.req, row.phase, row.last_used = None, "free", now
        if not self.reuse:
            row.owner = None
        req.finish(reason, now)

    # ------------------------------------------------------------------ device work
    def _launch(self) -> _Flight:
        """Decide this iteration's device work on the host (a StepPlan), broadcast it under torchrun, run it, and
        start the copy of its ids to the host."""
        flight = _Flight()
        slot = self._slot
        self._slot ^= 1
        plan = StepPlan(self._admits, copies=self._copies)
        self._admits, self._copies = [], []
        self._plan_prefill(plan, flight)
        self._plan_decode(plan, flight, slot)
        if plan.admits or plan.prefill is not None or plan.decode_rows:
            if self.distributed:
                broadcast_plan(plan, self._wire)
            flight.first_ids, flight.decode_ids = plan.run(self.engine, self.runner)
            self._logprobs(plan, flight)
            if flight.prompt_lp:
                flight.prompt_lp = [(req, tuple(t.to("cpu", non_blocking=self._on_cuda) for t in sc))
                                    for req, sc in zip(flight.prompt_lp, plan.scores)]
        host = self._ids_host[slot]
        nf = len(flight.first)
        if nf:
            host[:nf].copy_(flight.first_ids, non_blocking=self._on_cuda)
        flight.first_ids = host[:nf]
        if flight.decode:  # rows [:highest live + 1]: read by row index
            nd = flight.decode_ids.numel()
            dst = host[nf:nf + nd].view(flight.decode_ids.shape)
            dst.copy_(flight.decode_ids, non_blocking=self._on_cuda)
            flight.decode_ids = dst
        if self._on_cuda and not flight.empty():
            flight.event = torch.cuda.Event()
            flight.event.record()
        return flight

    def _logprobs(self, plan: StepPlan, flight: _Flight) -> None:
        """For the requests that asked: each sampled token's log-probability and the top k, from the logits it was
        drawn from, computed on the device and copied with the ids (no sync of its own)."""
        rows, ids, keys = [], [], []
        for j, (i, req) in enumerate(flight.first):
            if req.logprobs is not None:
                slot = plan.first_slots[j]
                rows.append(plan.prefill_logits[slot:slot + 1])
                ids.append(flight.first_ids[j:j + 1])
                keys.append(("first", req))
        for i, req in flight.decode:
            if req.logprobs is not None:
                logits, emitted = self._decode_logits(plan, flight, i)
                rows.append(logits)
                ids.append(emitted)
                keys.append(("decode", req))
        if not rows:
            return
        k = max(req.logprobs for _, req in keys)
        lp = torch.log_softmax(torch.cat(rows).float(), dim=-1)
        chosen = lp.gather(1, torch.cat(ids).view(-1, 1)).squeeze(1)
        top = lp.topk(k, dim=-1) if k else None
        flight.lp_host = tuple(t.to("cpu", non_blocking=self._on_cuda) for t in
                               ((chosen,) + ((top.values, top.indices) if k else ())))
        starts = [0]
        for r in rows[:-1]:
            starts.append(starts[-1] + r.shape[0])
        flight.lp_index = dict(zip(keys, starts))

    def _decode_logits(self, plan: StepPlan, flight: _Flight, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's logits of the decode step [m, V] and the tokens drawn from them [m] (device tensors): one."""
        return plan.decode_logits[i:i + 1], flight.decode_ids[i:i + 1]

    def _logprob(self, flight: _Flight, kind: str, req: Request, j: int = 0):
        """req's logprob entry for its j-th token of this flight's `kind` (None: it asked for none)."""
        n = flight.lp_index.get((kind, req))
        if n is None:
            return None
        n += j
        chosen = float(flight.lp_host[0][n])
        if not req.logprobs:
            return chosen, []
        vals, idx = flight.lp_host[1][n, :req.logprobs].tolist(), flight.lp_host[2][n, :req.logprobs].tolist()
        return chosen, list(zip(idx, vals))

    def _plan_prefill(self, plan: StepPlan, flight: _Flight) -> None:
        budget = self.max_prefill_tokens
        parts: list[tuple[_Row, int]] = []
        keeps: list[tuple[_Row, _Row]] = []  # (a chunk's row, the free row its state is copied into after it)
        for row in self._prefilling:
            n = min(len(row.req.prompt) - row.filled, self.max_prefill_tokens)
            mark = self._snapshot_mark(row, n)
            dst = None if mark is None else self._snapshot_row([d for _, d in keeps])
            if dst is not None:  # the chunk ends where the snapshot is taken
                n = mark - self.snapshot_lag - row.filled
            if parts and n > budget:
                break
            parts.append((row, n))
            if dst is not None:
                dst.owner, dst.seq, dst.filled = next(self._snapshot_ids), row.req.prompt[:mark], row.filled + n
                dst.shared, dst.pending, dst.last_used = True, 0, time.perf_counter()
                dst.key = _prefix_key(row.req, mark)
                keeps.append((row, dst))
            budget -= n
            if budget <= 0:
                break
        if not parts:
            return
        plan.keeps = [(row.index, dst.index) for row, dst in keeps]
        self.stats.snapshots += len(keeps)
        slot = self._place_chunk(plan, [r.index for r, _ in parts])
        B = max(slot.values()) + 1
        S = max(n for _, n in parts)
        tokens = torch.zeros(B, S, dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        # a row not in the chunk starts where its sequence ends (a row "from position 0" would restart its state)
        start = torch.tensor([min(r.filled, self.max_seq_len - 1) for r in self.rows[:B]], dtype=torch.long)
        for row, n in parts:
            s, i = row.filled, slot[row.index]
            tokens[i, :n] = torch.tensor(row.req.prompt[s:s + n])
            lengths[i], start[i] = n, s
            row.seq.extend(row.req.prompt[s:s + n])
            row.filled += n
        plan.prefill = (tokens, lengths, start)
        scored = [(row, n) for row, n in parts if row.req.prompt_logprobs is not None]
        if scored:  # the token after each scored position: the prompt's next (none after its last)
            nxt = torch.zeros_like(tokens)
            nlen = torch.zeros_like(lengths)
            for row, n in scored:
                s, i = row.filled - n, slot[row.index]
                follow = row.req.prompt[s + 1:s + n + 1]
                nxt[i, :len(follow)] = torch.tensor(follow, dtype=torch.long)
                nlen[i] = len(follow)
            plan.score = ([slot[r.index] for r, _ in scored], nxt, nlen, max(r.req.prompt_logprobs for r, _ in scored))
            flight.prompt_lp = [r.req for r, _ in scored]
        self.stats.prefill_chunks += 1
        self.stats.prefill_tokens += sum(n for _, n in parts)
        done = [row for row, _ in parts if row.filled == len(row.req.prompt)]
        self._chunk_planned(plan, [(row, n, slot[row.index]) for row, n in parts], done)
        if done:
            plan.first_rows = [r.index for r in done]
            plan.first_slots = [slot[r.index] for r in done]
            flight.first = [(r.index, r.req) for r in done]
            for r in done:
                r.phase, r.produced = "decode", 1
                self._prefilling.remove(r)
                bisect.insort(self._decoding, r, key=lambda x: x.index)

    # a snapshot for prompts sharing m tokens is taken at m - snapshot_lag: the MTP block's state at a position
    # reads the token after it (a subclass's)
    snapshot_lag = 0

    def _snapshot_mark(self, row: _Row, n: int) -> int | None:
        """The first prefix length m its request asked a snapshot for whose position (m - snapshot_lag) the row's
        next n prompt tokens reach (at least snapshot_min_tokens; none of prompt[:m] kept yet), or None."""
        marks = _marks(row.req)
        if not self.snapshots or not marks:
            return None
        prompt, lag = row.req.prompt, self.snapshot_lag
        for m in sorted(marks):
            if row.filled < m - lag <= row.filled + n and m - lag >= self.snapshot_min_tokens and not any(
                    r.shared and r.owner is not None and len(r.seq) == m and r.key == _prefix_key(row.req, m)
                    and r.seq == prompt[:m] for r in self.rows):
                return m
        return None

    def _snapshot_row(self, taken: list[_Row]) -> _Row | None:
        """A free row to keep a snapshot in (not one `taken` by this chunk's): the highest empty one (low rows stay
        for requests: smaller buckets), else the least recently used free row above the decode bucket, else below
        it (what it kept is evicted); None when no row is free."""
        free = [r for r in self.rows if r.req is None and all(r is not t for t in taken)]
        if not free:
            return None
        empty = [r for r in free if r.owner is None]
        if empty:
            return empty[-1]
        limit = self._limit()
        return min([r for r in free if r.index >= limit] or free, key=lambda r: r.last_used)

    def _make_runner(self, engine):
        return engine.runner()

    def _prepare(self, rows: int | None) -> int:
        return prepare_buckets(self.runner, rows)

    def _chunk_planned(self, plan: StepPlan, parts: list[tuple[_Row, int, int]], done: list[_Row]) -> None:
        """After a prefill chunk is planned: (row, tokens, its row in the call) of each part (their `filled` moved
        past the chunk), the rows whose prompts it ends. (A speculative scheduler adds the MTP block's inputs.)"""

    def _decode_width(self) -> int:
        """Ids per row a decode step gives the host."""
        return 1

    def _place_chunk(self, plan: StepPlan, rows: list[int]) -> dict[int, int]:
        """{row: its row in the prefill call}. A chunk computes every row below its highest, so when its k rows are
        not rows [:k] and the engine can exchange cache rows, rows >= k trade places with the free ones below k
        for the call (plan.swaps: there and back), and the call computes k rows."""
        k, held = len(rows), set(rows)
        if max(rows) < k or not hasattr(self.engine, "swap_rows"):
            return {r: r for r in rows}
        low = iter(t for t in range(k) if t not in held)
        plan.swaps = [(r, next(low)) for r in sorted(rows) if r >= k]
        return {**{r: r for r in rows if r < k}, **dict(plan.swaps)}

    def _plan_decode(self, plan: StepPlan, flight: _Flight, slot: int) -> None:
        live = [r for r in self._decoding if r.produced < r.cap]
        if not live:
            return
        n = live[-1].index + 1
        bucket = self.runner.bucket(n)
        if len(live) == bucket:
            pos = [r.filled for r in live]
        else:  # rows not generating ride along where their writes are harmless
            pos = [r.harmless_position(self.max_seq_len) for r in self.rows[:bucket]]
            pos += [0] * (bucket - len(pos))  # rows past this scheduler's (generate() with fewer): none of ours
            for r in live:
                pos[r.index] = r.filled
            # a riding row at a position that closes a compressor window would shift its compressor state past
            # the window its next chunk reads: the step must leave those states as they were
            is_live = {r.index for r in live}
            plan.protect = [i for i, p in enumerate(pos[:len(self.rows)]) if i not in is_live and p > 0
                            and any((p + 1) % m == 0 for m in self._ratios)]
        host = self._pos_host[slot]
        host[:bucket] = torch.tensor(pos, dtype=torch.long)
        plan.decode_rows, plan.positions = n, host[:bucket]
        flight.decode = [(r.index, r.req) for r in live]
        for r in live:
            r.filled += 1
            r.produced += 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(live)
        self.stats.decode_bucket_rows += bucket

    # ------------------------------------------------------------------ host side of the results
    def _read(self, flight: _Flight) -> None:
        if flight.event is not None:
            flight.event.synchronize()
        now = time.perf_counter()
        for req, (chosen, vals, ids) in flight.prompt_lp:
            k = req.prompt_logprobs
            req.prompt_token_logprobs.extend(
                (c, list(zip(i[:k], v[:k]))) for c, v, i in zip(chosen.tolist(), vals.tolist(), ids.tolist()))
        for (i, req), t in zip(flight.first, flight.first_ids.tolist()):
            if req.finish_reason is None:  # (one cancelled meanwhile was counted without it)
                req.timings.first_token = now
            self._take(self.rows[i], req, t, now, self._logprob(flight, "first", req))
        if flight.decode:
            self._read_decode(flight, now)

    def _read_decode(self, flight: _Flight, now: float) -> None:
        """The decode step's ids [rows]: one token per generating row."""
        by_row = flight.decode_ids.tolist()
        rows, eos = self.rows, self.eos
        for i, req in flight.decode:  # the hot loop: one pass per generating row per step
            t, row = by_row[i], rows[i]
            if row.owner == req.id:
                row.seq.append(t)  # fed to the row's next step, if it runs one
            if row.req is not req or req.finish_reason is not None:
                continue
            if t in req.stop_ids or (t in eos and not req.ignore_eos):
                self._stopped(row, req, t, now, self._logprob(flight, "decode", req) if flight.lp_index else None)
                continue
            if req._plain:  # no text, no callback: the ids and times alone
                req.token_ids.append(t)
                req.token_times.append(now)
            elif req.add_token(t, now, self._logprob(flight, "decode", req) if flight.lp_index else None):
                self._free(row, "stop", now)
                continue
            if len(req.token_ids) >= row.cap:
                self._free(row, "length" if len(req.token_ids) >= req.max_tokens else "max_seq_len", now)

    def _stopped(self, row: _Row, req: Request, t: int, now: float, logprob=None) -> None:
        """req ends on stop id / EOS t (not kept); its logprob entry, where it asked for them, is kept."""
        if logprob is not None:
            req.stop_token = t
            req.token_logprobs.append(logprob)
        self._free(row, "stop", now)

    def _take(self, row: _Row, req: Request, t: int, now: float, logprob=None) -> None:
        """Token t sampled for request req in `row` (its first, from the prefill logits)."""
        if row.owner == req.id:
            row.seq.append(t)
        if row.req is not req or req.finish_reason is not None:
            return
        if req.max_tokens == 0:  # a scored prompt: nothing to generate
            self._free(row, "length", now)
            return
        if t in req.stop_ids or (t in self.eos and not req.ignore_eos):
            self._stopped(row, req, t, now, logprob)
        elif req.add_token(t, now, logprob):
            self._free(row, "stop", now)
        elif len(req.token_ids) >= row.cap:
            self._free(row, "length" if len(req.token_ids) >= req.max_tokens else "max_seq_len", now)

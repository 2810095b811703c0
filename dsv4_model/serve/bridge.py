"""The scheduler on a thread of its own, and the way back to the event loop.

A `Stream` is one HTTP request's view of its `Request`s: the scheduler thread's on_token / on_finish callbacks
collect events, and at the end of each scheduler step one loop.call_soon_threadsafe hands all of them to the event
loop's queues (one wake-up per step, not per token; the only thing done on that thread, so a slow client never
slows the batch). Admission (429 past max_waiting, 503 while draining) happens here, before a
request reaches the scheduler."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.scheduler import Scheduler
from dsv4_model.serve.protocol import APIError


@dataclass
class Event:
    choice: int
    token_id: int | None  # None: the request ended (finish) or held-back text came out
    text: str
    done: bool = False
    logprob: tuple | None = None  # (log-probability, [(id, log-probability)]) of token_id, when asked for


class Stream:
    """Events of a group of requests (an HTTP request's choices), consumed on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, special_text: dict[int, str], sink: "StepSink | None" = None):
        self.loop = loop
        self.sink = sink  # None: each event wakes the loop itself
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.requests: list[Request] = []
        self.prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens (n choices of a prompt count it once)
        self._special = special_text  # ids the detokenizer skips but the output parser must see

    def bind(self, req: Request, choice: int, prompt: int = 0) -> Request:
        """req as choice `choice` of the group, a choice of prompt `prompt` (usage counts each prompt once)."""
        self.prompt_tokens[prompt] = len(req.prompt)
        put = self.queue.put_nowait
        special = self._special
        if self.sink is not None:
            call = self.sink.later(self.loop)
        else:
            call = self.loop.call_soon_threadsafe

        def on_token(r, token_id, text):
            if token_id in special:
                text = special[token_id] + (text or "")
            lp = r.token_logprobs[-1] if token_id is not None and r.logprobs is not None else None
            call(put, Event(choice, token_id, text or "", logprob=lp))

        def on_finish(r):
            call(put, Event(choice, None, "", done=True))

        req.on_token, req.on_finish = on_token, on_finish
        self.requests.append(req)
        return req

    def cancel(self) -> None:
        for r in self.requests:
            if not r.done:
                r.cancel()


class StepSink:
    """Events the scheduler thread produced during a step, per event loop, delivered when the step ends (the
    scheduler's on_step hook): one call_soon_threadsafe per loop and step."""

    def __init__(self):
        self._pending: dict[asyncio.AbstractEventLoop, list] = {}

    def later(self, loop: asyncio.AbstractEventLoop):
        """call(fn, arg) for `loop`: queued until flush()."""
        def call(fn, arg):
            self._pending.setdefault(loop, []).append((fn, arg))
        return call

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, calls in pending.items():
            try:
                loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError:  # the loop closed (shutdown): nobody is waiting
                pass


def _run_all(calls) -> None:
    for fn, arg in calls:
        fn(arg)


class SchedulerThread:
    """Runs `scheduler.serve_forever()` on a daemon thread; counts live requests for admission and metrics."""

    def __init__(self, scheduler: Scheduler, max_waiting: int, on_finish=None):
        self.scheduler = scheduler
        self.max_waiting = max_waiting
        self._on_finish = on_finish  # metrics, called on the scheduler thread
        self._live: set[Request] = set()
        self._lock = threading.Lock()
        self.draining = False
        self.sink = StepSink()
        scheduler.on_step = self.sink.flush  # the events of a step reach the event loop together
        self._thread = threading.Thread(target=scheduler.serve_forever, name="dsv4-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._lock:
            waiting = sum(1 for r in self._live if r.timings.admitted is None)
            return len(self._live) - waiting, waiting

    def submit_all(self, reqs: list[Request], repeats: frozenset[int] = frozenset()) -> None:
        """All of an HTTP request's choices or none (429 / 503 / 400 from the scheduler's checks; a request of more
        choices than the queue ever holds is the app's 400 before this). repeats: positions in reqs of choices
        whose prompt an earlier one carries (n > 1): the metrics count a prompt once."""
        if self.draining:
            raise APIError(503, "the server is shutting down", kind="service_unavailable")
        if not self.alive:
            raise APIError(503, "the scheduler thread has stopped", kind="service_unavailable")
        with self._lock:
            waiting = sum(1 for r in self._live if r.timings.admitted is None)
            if waiting + len(reqs) > self.max_waiting:
                raise APIError(429, f"too many requests waiting ({waiting}, at most {self.max_waiting})",
                               kind="rate_limit_exceeded", headers={"Retry-After": "1"})
            for r in reqs:
                self._live.add(r)
        for i, r in enumerate(reqs):
            r.on_finish = self._finisher(r.on_finish, i not in repeats)
            try:
                self.scheduler.submit(r)
            except (ValueError, RuntimeError) as e:  # a bad request; the scheduler stopped or its engine busy
                for s in reqs[:i]:
                    s.cancel()
                with self._lock:
                    self._live.difference_update(reqs[i:])
                if isinstance(e, RuntimeError):
                    raise APIError(503, str(e), kind="service_unavailable") from None
                raise APIError(400, str(e), "prompt" if str(e).startswith("prompt") else None) from None

    def _finisher(self, extra, count_prompt: bool):
        def on_finish(r: Request):
            with self._lock:
                self._live.discard(r)
            if self._on_finish is not None:
                self._on_finish(r, count_prompt)
            if extra is not None:
                extra(r)
        return on_finish

    def drain(self, timeout_s: float) -> int:
        """Stop admitting, let live requests finish for up to timeout_s, cancel the rest, stop the thread.
        Returns how many were cancelled."""
        self.draining = True
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if not self._live:
                    break
            time.sleep(0.02)
        with self._lock:
            rest = list(self._live)
        for r in rest:
            r.cancel()
        for r in rest:
            r.wait(5.0)
        self.scheduler.stop()
        self._thread.join(10.0)
        return len(rest)

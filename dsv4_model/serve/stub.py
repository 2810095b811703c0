"""A stand-in for the Scheduler with no model: each step gives every running request its next scripted token at
once. It does the host side a real step does (detokenization, stop strings, callbacks, timings) so the server's
front-end cost can be measured alone (bench/bench_serve.py --stub) and the chat path tested with outputs chosen
in advance (tests/test_serve_chat_v4.py)."""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.scheduler import SchedulerStats


class StubScheduler:
    """script(req) -> the token ids the request "generates" (cycled up to max_tokens; eos ends it).
    logprobs(req, token_id) -> (its log-probability, [(id, log-probability)] most likely first): scripted entries
    for requests that ask for them (None: such requests are refused; there is no model)."""

    def __init__(self, tokenizer, script: Callable[[Request], list[int]], *, max_rows: int = 64,
                 max_seq_len: int = 4096, logprobs: Callable[[Request, int], tuple] | None = None):
        self.tokenizer = tokenizer
        self.script = script
        self.logprobs = logprobs
        self.max_rows = max_rows
        self.max_seq_len = max_seq_len
        self.vocab_size = tokenizer.vocab_size
        self.eos = tokenizer.eos_id
        self.stats = SchedulerStats()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[tuple[Request, list[int]]] = []
        self._lock = threading.Condition()
        self._stopping = False
        self.on_step: Callable[[], None] | None = None  # called at the end of every step (the server's flush)

    def submit(self, req: Request) -> Request:
        if not req.prompt or len(req.prompt) > self.max_seq_len:
            raise ValueError("prompt: empty or longer than max_seq_len")
        if (req.logprobs is not None and self.logprobs is None) or req.prompt_logprobs is not None:
            raise ValueError("logprobs: the stub scheduler has no model to give log-probabilities")
        req.timings.submitted = time.perf_counter()
        req.start_text(self.tokenizer)
        with self._lock:
            self._waiting.append(req)
            self._lock.notify()
        return req

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()

    def serve_forever(self) -> None:
        while not self._stopping:
            with self._lock:
                while not self._waiting and not self._running and not self._stopping:
                    self._lock.wait(0.05)
                now = time.perf_counter()
                while self._waiting and len(self._running) < self.max_rows:
                    req = self._waiting.popleft()
                    req.timings.admitted = now
                    self._running.append((req, self.script(req)))
            self.step()

    def step(self) -> None:
        now = time.perf_counter()
        self.stats.iterations += 1
        still = []
        for req, ids in self._running:
            if req.cancelled:
                req.finish("cancelled", now)
                continue
            n = len(req.token_ids)
            t = ids[n % len(ids)]
            if req.timings.first_token is None:
                req.timings.first_token = now
            lp = None if req.logprobs is None else self._entry(req, t)
            if t in req.stop_ids or (t == self.eos and not req.ignore_eos):  # as the scheduler stops
                if lp is not None:  # kept last, as the scheduler keeps a stop token's
                    req.stop_token = t
                    req.token_logprobs.append(lp)
                req.finish("stop", now)
            elif req.add_token(t, now, lp):
                req.finish("stop", now)
            elif n + 1 >= req.max_tokens:
                req.finish("length", now)
            else:
                still.append((req, ids))
        self._running = still
        if self.on_step is not None:
            self.on_step()

    def _entry(self, req: Request, t: int) -> tuple:
        lp, top = self.logprobs(req, t)
        return lp, list(top)[:req.logprobs]

"""A generation request as the scheduler sees it: prompt ids, its own sampling parameters and stops, and what it
has produced so far (token ids, incremental text, finish reason, timings). Host-side only: no tensors."""
from __future__ import annotations

import itertools
import operator
import threading
from dataclasses import dataclass, field
from typing import Callable

from dsv4_model.checkpoint.tokenizer import StreamDecoder
from dsv4_model.runtime.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "max_seq_len", "cancelled", "error")

# on_token(request, token_id, text): every emitted token in order; `text` is the text it adds ("" while a UTF-8
# character or a possible stop string is incomplete; None without a tokenizer). A final call with token_id None
# carries held-back text when the request ends.
TokenCallback = Callable[["Request", "int | None", "str | None"], None]

_ids = itertools.count()


@dataclass
class Timings:
    """perf_counter() seconds: submitted, given a row, first token read, finished."""

    submitted: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.submitted

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from submission."""
        return None if self.first_token is None else self.first_token - self.submitted


@dataclass(eq=False)
class Request:
    """prompt: token ids (BOS included when wanted). max_tokens: generated tokens at most. stop_ids: ids that end
    the request (not returned; the model's EOS is added by the scheduler unless ignore_eos). stop: strings that end
    it (the text is cut before the match; the ids keep the token that completed it)."""

    prompt: list[int]
    params: SamplingParams = SamplingParams()
    max_tokens: int = 16
    stop_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # k >= 0: each token's log-probability and the k most likely (None: off)
    # k >= 0: each prompt token's (the first excepted) log-probability after the tokens before it and the k most
    # likely there (None: off; the prompt is then prefilled whole, never continued from a kept row); with it
    # max_tokens may be 0 (score the prompt, generate nothing)
    prompt_logprobs: int | None = None
    # prompt positions (0 < p < len(prompt)) whose state the scheduler keeps in a free row, where it has one: a later
    # prompt that starts with prompt[:p] continues from a copy of it (a shared system prompt; the part of a thinking-
    # mode chat prompt the next turn repeats). Each costs the prompt one prefill chunk boundary there.
    snapshot_at: tuple[int, ...] = ()
    on_token: TokenCallback | None = None
    on_finish: Callable[["Request"], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))

    # results
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    timings: Timings = field(default_factory=Timings)
    token_times: list[float] = field(default_factory=list)
    reused_tokens: int = 0  # prompt tokens whose caches a kept row (a finished sequence, a prefix snapshot) held
    # snapshot positions the scheduler added: the end of a prefix this prompt shares with another row's sequence
    learned_snapshot_at: tuple[int, ...] = ()
    # with logprobs: per kept token, (its log-probability, [(id, log-probability)] of the `logprobs` most likely),
    # from the model's distribution before temperature / top-k / top-p
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # with prompt_logprobs: per prompt token from the second, as token_logprobs' entries (the model's distribution)
    prompt_token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # with logprobs, a request that a stop id or EOS ended: that token (not in token_ids); its entry is the last of
    # token_logprobs (a scorer reading "the generated token's" log-probability finds it there, as from vLLM)
    stop_token: int | None = None
    stop_string_hit: bool = False  # a stop string was found (the text is cut where it begins)
    # the first exception an on_token / on_finish callback raised: it ends this request ("error") at the next step
    # boundary, never the others in the batch
    callback_error: Exception | None = None

    def __post_init__(self):
        if isinstance(self.prompt, (str, bytes)):
            raise ValueError("prompt: token ids (a list of ints), got text: encode it first (engine.get_tokenizer())")
        try:  # operator.index: ints of any kind (numpy, torch scalars), never a float or a digit string
            self.prompt = [operator.index(t) for t in self.prompt]
        except TypeError:
            raise ValueError(f"prompt: token ids must be ints, got {self.prompt[:4]!r}...") from None
        ids = [self.stop_ids] if isinstance(self.stop_ids, int) else self.stop_ids
        self.stop_ids = frozenset(operator.index(t) for t in ids)
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # one string: one stop
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params: a SamplingParams, got {type(self.params).__name__}")
        for name in ("on_token", "on_finish"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"{name}: must be callable, got {type(getattr(self, name)).__name__}")
        self._cancel = threading.Event()
        self._on_cancel: Callable[[], None] | None = None  # the scheduler's wake-up
        self._done = threading.Event()
        self._decoder: StreamDecoder | None = None
        self._shown = 0  # characters of `text` already streamed

    # ------------------------------------------------------------------ caller side
    def cancel(self) -> None:
        """From any thread: the request ends ("cancelled") and frees its row at the next step boundary."""
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    # ------------------------------------------------------------------ scheduler side
    def start_text(self, tokenizer) -> None:
        self._decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        # add_token would only append
        self._plain = self._decoder is None and self.on_token is None and self.logprobs is None

    def add_token(self, token_id: int, now: float, logprob=None) -> bool:
        """Keep token_id (not a stop id) and its logprob entry; stream it. True when a stop string ended the
        request."""
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if logprob is not None:
            self.token_logprobs.append(logprob)
        if self._decoder is None:
            if self.on_token is not None:
                self._call(self.on_token, token_id, None)
            return False
        self.text += self._decoder.push(token_id)
        hit = self._cut_at_stop()
        self._stream(token_id, final=hit)
        return hit

    def finish(self, reason: str, now: float) -> None:
        if self.finish_reason is not None:
            return
        if self.callback_error is not None:  # its own callback raised (and cancelled it): whatever ended it next
            reason = "error"
        if self._decoder is not None and reason != "stop":
            self.text += self._decoder.flush()
            if self._cut_at_stop() and reason in ("length", "max_seq_len"):
                reason = "stop"  # the held-back end completed a stop string: the text ends as a stop's does
        self.finish_reason = reason
        self.timings.finished = now
        if self._decoder is not None:
            self._stream(None, final=True)
        if self.on_finish is not None:
            self._call(self.on_finish)
        self._done.set()

    def _call(self, fn, *args) -> None:
        try:
            fn(self, *args)
        except Exception as e:  # the caller's code: its request ends, the scheduler and the batch go on
            if self.callback_error is None:
                self.callback_error = e
            self.cancel()

    def _cut_at_stop(self) -> bool:
        if not self.stop:
            return False
        # a match may straddle what was already shown only by what was held back, so search from there
        lo = max(0, self._shown - max(len(s) for s in self.stop))
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stop_string_hit = True
        return True

    def _held_back(self) -> int:
        """Characters at the end of `text` that may begin a stop string: not streamed yet."""
        for n in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                return n
        return 0

    def _stream(self, token_id: int | None, final: bool) -> None:
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self._shown:end]
        self._shown = max(self._shown, end)
        if self.on_token is not None and (token_id is not None or delta):
            self._call(self.on_token, token_id, delta)

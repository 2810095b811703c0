"""Batched generation: ragged prefill, then one decode step per token with streaming and per-row stops.

Per step the host reads exactly one thing: the sampled ids, copied asynchronously into pinned memory and
waited on through an event. Step k+1 is launched before the ids of step k are read (the sampled ids are
fed back on the device), so host-side work (stop checks, detokenization, streaming) overlaps the GPU.
A row that stops keeps riding along in the batch (its results are discarded) until every row is done.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv4_model.model.checks import check_positive_int
from dsv4_model.runtime.compiled import DecodeRunner
from dsv4_model.runtime.sampling import SamplingParams, seed_key
from dsv4_model.checkpoint.tokenizer import StreamDecoder

# stream(row, token_id, text): called for every emitted token in order; `text` is the decoded increment
# ("" while a multi-byte character is incomplete; None without a tokenizer). At the end of a row, a final
# call with token_id None carries any held-back text.
StreamCallback = Callable[[int, "int | None", "str | None"], None]


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids per prompt (stop tokens not included)
    texts: list[str] | None  # decoded `token_ids` (the engine's tokenizer, or the one passed)
    # "stop" (EOS / stop id), "length" (max_new_tokens) or "max_seq_len" (cut short: the caches are full)
    finish_reasons: list[str]
    prompt_lengths: list[int]
    prefill_seconds: float = 0.0  # up to the first sampled ids on the host (time to first token)
    decode_seconds: float = 0.0  # the rest of the generation
    decode_steps: int = 0
    mode: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps (every token after each row's first) per second of decode."""
        n = sum(max(0, len(t) - 1) for t in self.token_ids)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0


def right_padded(ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one right-padded int64 [B, longest] batch and their lengths [B] (CPU tensors)."""
    padded = torch.zeros(len(ids), max(len(p) for p in ids), dtype=torch.long)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    return padded, torch.tensor([len(p) for p in ids], dtype=torch.long)


class RowSink:
    """The emitted tokens of a batch's rows as the host reads them: stop ids, the per-row cap, streaming (with
    held-back text flushed at a row's end) and the finish reasons. on_finish(row) runs when a row ends."""

    def __init__(self, B: int, stops: set[int], stream, tok, row0: int, on_finish=None):
        self.out: list[list[int]] = [[] for _ in range(B)]
        self.reasons: list[str | None] = [None] * B
        self.decoders = [StreamDecoder(tok) for _ in range(B)] if tok is not None else None
        self.stops, self.stream, self.row0, self.on_finish = stops, stream, row0, on_finish

    def emit(self, b: int, t: int, cap: int, why_at_cap: str) -> None:
        """Token t of row b (a live row): a stop id ends it, else it is kept and streamed; cap tokens end it."""
        if t in self.stops:
            self.finish(b, "stop")
            return
        self.out[b].append(t)
        if self.stream is not None:
            self.stream(self.row0 + b, t, self.decoders[b].push(t) if self.decoders is not None else None)
        if len(self.out[b]) >= cap:
            self.finish(b, why_at_cap)

    def finish(self, b: int, why: str) -> None:
        self.reasons[b] = why
        if self.on_finish is not None:
            self.on_finish(b)
        if self.stream is not None and self.decoders is not None:
            rest = self.decoders[b].flush()
            if rest:
                self.stream(self.row0 + b, None, rest)

    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def record(self, result: "GenerationResult", tok, seconds: tuple[float, float, float], steps: int) -> None:
        """Append the batch to result: its rows, and the time from start to the first token's read to the end."""
        result.token_ids.extend(self.out)
        result.finish_reasons.extend(self.reasons)
        if result.texts is not None:
            result.texts.extend(tok.decode(t) for t in self.out)
        t0, t_first, t_end = seconds
        result.prefill_seconds += t_first - t0
        result.decode_seconds += t_end - t_first
        result.decode_steps += steps


def generate(engine, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_token_ids=None, stream: StreamCallback | None = None, *,
             tokenizer=None, add_bos: bool = True, speculate: int = 0, stop=None,
             speculate_method: str = "auto", dspark_cut: float = 0.0) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens for each prompt.

    prompts: list of strings (encoded with the checkpoint's tokenizer, BOS first) or list of token-id lists.
    Sampling: temperature 0 = greedy; else temperature / top_k (0 = off) / top_p (1 = off); prompt i draws
    with seed `seed + i`, so results do not depend on how prompts are batched. A row stops at the config's
    EOS or any id in `stop_token_ids`, or at any of the strings `stop` (its text cut before the match; an Engine's
    generation only). More prompts than `max_batch_size` flow through the rows as they free up (an Engine: the
    Scheduler), or run in consecutive batches (an exported package, speculate).
    Every row can generate at most max_seq_len - (longest prompt of its batch) + 1 tokens: a row cut short
    there ends with finish reason "max_seq_len" (say so to the user; the CLI does on stderr).
    speculate: K >= 1 MTP drafts per step (dsv4_model.runtime.speculative; an Engine whose model was built with
    spare_window_slots >= K), 0 = off. Greedy output is the plain greedy decode's; sampled output follows its
    distribution. A step may write 2K positions past its row's, so rows stop 2K positions earlier at
    max_seq_len. result.extra["speculation"]: the SpeculationStats (acceptance per draft position).
    speculate_method: "mtp" (the MTP block), "dspark" (the DSpark module of a V4-Flash-0731-style checkpoint,
    docs/dspark.md: K <= its block size) or "auto" (DSpark when the model carries it). dspark_cut: DSpark's
    confidence cut (a block cut before its first draft predicted below it: fewer experts read per step; 0: off;
    docs/dspark.md, "The confidence cut").
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    check_positive_int(max_new_tokens, "max_new_tokens")
    for name, v in (("top_k", top_k), ("seed", seed)):  # never rounded: 1.5 is not a seed
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name} must be an int, got {v!r}")
    texts_in = all(isinstance(p, str) for p in prompts)
    if not texts_in and not all(isinstance(p, (list, tuple)) for p in prompts):
        raise ValueError("prompts must be all strings or all token-id lists")
    # id prompts get texts too: the caller may want the words without a second decode pass
    tok = tokenizer if tokenizer is not None else engine.get_tokenizer()
    try:  # ids of any int kind, never a float or a digit string
        ids = [tok.encode(p, add_bos=add_bos) for p in prompts] if texts_in else \
            [[operator.index(t) for t in p] for p in prompts]
    except TypeError:
        raise ValueError("prompts: token ids must be ints") from None
    if any(len(p) == 0 for p in ids):
        raise ValueError("every prompt needs at least one token")
    from dsv4_model.runtime.scheduler import eos_ids

    extra = [stop_token_ids] if isinstance(stop_token_ids, int) else (stop_token_ids or ())
    stops = set(eos_ids(engine.config)) | {operator.index(t) for t in extra}
    base = SamplingParams(float(temperature), top_k, float(top_p), seed).validate()
    base = SamplingParams(base.temperature, base.top_k, base.top_p, seed_key(base.seed))  # int64: seed + i stays valid
    method = speculate_method_of(engine, speculate_method) if speculate else None
    if dspark_cut and method != "dspark":
        raise ValueError("dspark_cut: the confidence cut is DSpark's, and this run "
                         + ("drafts with the MTP block" if speculate else "does not speculate (speculate=0)"))
    if method == "dspark":
        runner = engine.dspark_runner(speculate, cut=dspark_cut)  # (it checks the model for `speculate` drafts)
    elif speculate:
        if not hasattr(engine, "speculative_runner"):
            raise ValueError("speculate needs an Engine (an exported package has no MTP step)")
        runner = engine.speculative_runner(speculate)
    elif speculate != 0:
        raise ValueError(f"speculate must be an int >= 0, got {speculate!r}")
    else:
        runner = engine.runner()

    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())  # one string is one stop (as vLLM's stop=)
    if engine.can_prefill_at:
        return _generate_scheduled(engine, runner, ids, base, max_new_tokens, stops, stream, tok, stop, speculate,
                                   method, dspark_cut)
    if stop:
        raise ValueError("stop: stop strings need generation under the Scheduler (an Engine, or a package with "
                         "prefill_chunk entries)")
    result = GenerationResult([], [] if tok is not None else None, [], [len(p) for p in ids], mode=runner.mode_name)
    for start in range(0, len(ids), runner.max_rows):
        chunk = ids[start : start + runner.max_rows]
        params = [SamplingParams(base.temperature, base.top_k, base.top_p, base.seed + start + i)
                  for i in range(len(chunk))]
        _generate_batch(engine, runner, chunk, params, max_new_tokens, stops, stream, tok, start, result)
    return result


SPECULATE_METHODS = ("auto", "mtp", "dspark")


def speculate_method_of(engine, method: str) -> str:
    """"mtp" or "dspark" for generate's speculate_method ("auto": DSpark when the model carries the module)."""
    if method not in SPECULATE_METHODS:
        raise ValueError(f"speculate_method must be one of {SPECULATE_METHODS}, got {method!r}")
    has_dspark = getattr(getattr(engine, "model", None), "dspark", None) is not None
    if method == "auto":
        return "dspark" if has_dspark else "mtp"
    if method == "dspark" and not has_dspark:
        raise ValueError("speculate_method='dspark': this model carries no DSpark module (a V4-Flash-0731-style "
                         "checkpoint does: docs/dspark.md)")
    return method


@torch.no_grad()
def _generate_scheduled(engine, runner, ids: list[list[int]], base: SamplingParams, max_new_tokens: int,
                        stops: set[int], stream, tok, stop: tuple[str, ...] = (), speculate: int = 0,
                        method: str | None = None, dspark_cut: float = 0.0) -> GenerationResult:
    """The prompts as requests of one Scheduler (continuous batching): more prompts than rows flow through the
    rows as they free up, and each row stops on its own (its cap is its own prompt's, not the longest's).
    speculate: K drafts per step by `method` ("mtp" | "dspark"; a SpeculativeScheduler prepared for the
    prompts' one sampling mode)."""
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.scheduler import Scheduler

    from dsv4_model.runtime.speculative import sampling_mode

    for p in ids:  # the scheduler checks too, but this message names generate()'s argument
        if len(p) > engine.max_seq_len:
            raise ValueError(f"prompt of {len(p)} tokens exceeds max_seq_len={engine.max_seq_len}")
    rows = min(len(ids), runner.max_rows)
    ranks = _ranks()
    if ranks and ranks[0] != 0:  # torchrun: rank 0 schedules, this rank runs its plans, then gets its result
        from dsv4_model.runtime.step_plan import follow

        follow(engine, rows, speculate=speculate, modes=(sampling_mode([base]),) if speculate else (),
               method=method or "mtp", dspark_cut=dspark_cut)
        return _result_from_rank0(engine, None, None)
    options = dict(max_prefill_tokens=getattr(engine, "prefill_chunk", 8192), rows=rows, tokenizer=tok,
                   distributed=bool(ranks))
    if speculate:
        from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler

        reach = speculate * (1 if method == "dspark" else 2)  # (the runner's reach: DSpark's drafting writes nothing)
        for p in ids:  # (the scheduler checks too; this names generate()'s argument and the room a step needs)
            if len(p) > engine.max_seq_len - reach:
                raise ValueError(f"prompt of {len(p)} tokens leaves no room for speculate={speculate} (at most "
                                 f"max_seq_len - {reach} = {engine.max_seq_len - reach})")
        sched = SpeculativeScheduler(engine, speculate, method=method, modes=(sampling_mode([base]),),
                                     dspark_cut=dspark_cut, **options)
    else:
        sched = Scheduler(engine, **options)
    t0 = time.perf_counter()
    reqs = []
    def relay(i: int):
        def on_token(req, t, text):
            try:
                stream(i, t, text)
            except Exception:  # the caller's stream failed: the whole call ends (re-raised below)
                for r in reqs:
                    r.cancel()
                raise
        return on_token

    for i, p in enumerate(ids):
        params = SamplingParams(base.temperature, base.top_k, base.top_p, base.seed + i)
        reqs.append(sched.submit(Request(p, params, max_new_tokens, stop_ids=frozenset(stops), stop=stop,
                                         on_token=None if stream is None else relay(i))))
    try:
        sched.run_until_idle()
    finally:
        sched.close()
    failed = next((r.callback_error for r in reqs if r.callback_error is not None), None)
    if failed is not None:
        raise failed
    t_end = time.perf_counter()
    firsts = [r.timings.first_token for r in reqs if r.timings.first_token is not None]
    t_first = min(firsts) if firsts else t_end
    texts = None if tok is None else [r.text if stop else tok.decode(r.token_ids) for r in reqs]
    result = GenerationResult([r.token_ids for r in reqs], texts,
                              [r.finish_reason for r in reqs], [len(p) for p in ids], t_first - t0, t_end - t_first,
                              sched.stats.decode_steps, sched.runner.mode_name, {"scheduler": sched.stats})
    if speculate:
        result.extra["speculation"] = sched.speculation
    # prompt i held row i: decode() may continue each row where generation stopped
    lengths = [sched.rows[i].filled for i in range(len(ids))] if len(ids) <= rows else None
    if ranks:
        return _result_from_rank0(engine, result, lengths)
    _set_lengths(engine, lengths)
    return result


def _ranks() -> tuple[int, int] | None:
    """(rank, world size) of a torchrun group of 2+ ranks, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _set_lengths(engine, lengths) -> None:
    if lengths is None:
        engine.reset()
    else:
        engine.set_lengths(lengths)


def _result_from_rank0(engine, result, lengths):
    """Every rank returns rank 0's result (one pickled object at the end, not per step)."""
    import torch.distributed as dist

    box = [(result, lengths)]
    dist.broadcast_object_list(box, src=0)
    result, lengths = box[0]
    _set_lengths(engine, lengths)
    return result


@torch.no_grad()
def _generate_batch(engine, runner: DecodeRunner, ids: list[list[int]], params: list[SamplingParams],
                    max_new_tokens: int, stops: set[int], stream, tok, row0: int, result: GenerationResult):
    B = len(ids)
    lengths = [len(p) for p in ids]
    max_len = engine.max_seq_len
    if max(lengths) > max_len:
        raise ValueError(f"prompt of {max(lengths)} tokens exceeds max_seq_len={max_len}")
    # All rows step together, so the longest prompt bounds the positions every row may reach.
    cap = min(max_new_tokens, max_len - max(lengths) + 1)
    device = runner.device
    on_cuda = device.type == "cuda"

    runner.prepare(B)  # compile / capture first: warm-up writes cache rows that prefill then rewrites
    t0 = time.perf_counter()
    engine.reset()
    padded, lens_t = right_padded(ids)
    logits = engine.prefill(padded, lengths=lens_t)
    runner.begin(lens_t, params)
    first = runner.sample_first(logits)

    pinned = [torch.empty(B, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
    events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]

    def launch_copy(src: torch.Tensor, k: int) -> None:
        pinned[k % 2].copy_(src, non_blocking=on_cuda)
        if on_cuda:
            events[k % 2].record()

    rows = RowSink(B, stops, stream, tok, row0)

    launch_copy(first, 0)
    launched = 0  # decode steps launched; step k's ids sit in slot k % 2
    k = 0
    t_first = None
    while True:
        if launched < cap - 1:  # keep the GPU one step ahead of the host
            _, nxt = runner.step()
            launched += 1
            launch_copy(nxt, launched)
        if on_cuda:
            events[k % 2].synchronize()
        host = pinned[k % 2].tolist()
        if t_first is None:
            t_first = time.perf_counter()
        for b in range(B):
            if rows.reasons[b] is None:
                rows.emit(b, host[b], cap, "length" if cap == max_new_tokens else "max_seq_len")
        if rows.done() or k >= launched:
            break
        k += 1
    if on_cuda:
        events[launched % 2].synchronize()  # a step launched ahead of a finished batch
    t_end = time.perf_counter()
    engine.set_lengths([n + launched for n in lengths])  # every row: its prompt and `launched` decode steps

    rows.record(result, tok, (t0, t_first, t_end), k)

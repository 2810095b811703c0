"""Continuous batching (dsv4_model.runtime.scheduler): requests joining and leaving a running batch get the tokens
they get alone; cancellation, reuse of a finished row's caches, interleaved prefill chunks, stops."""
import threading
import time

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.builtin import DEFAULT_MODEL_DIR
from dsv4_model.checkpoint.writer import write_tiny_checkpoint
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.scheduler import Scheduler

# the built-in model: window 64, compress ratios 4 and 16; prompts and generations below cross them
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description='copy files')\n"
    "    parser.add_argument('src')\n    parser.add_argument('dst')\n    args = parser.parse_args(argv)\n",
    "class Stack:",
    "x = 1",
    "for i in range(10):\n    print(i)\n    if i % 3 == 0:\n        continue\n",
    "def f(x):",
    "# Copyright 2001 Python Software Foundation\n\"\"\"Utilities for reading and writing files.\"\"\"\n\nimport io\n",
]
MAX_TOKENS = [40, 75, 9, 30, 50, 21, 66]


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(seed=100 + i)
    return SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)  # the CPU kernels' row results do not depend on it; the machine has 2 cores
    return Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.bfloat16, max_batch_size=4,
                                  max_seq_len=512, quant="none", progress=False)


@pytest.fixture(scope="module")
def prompt_ids(engine):
    tok = engine.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def _alone(engine, ids, i, chunk=24, **kw) -> Request:
    s = Scheduler(engine, max_prefill_tokens=chunk)
    r = s.submit(Request(ids, _params(i), MAX_TOKENS[i], **kw))
    s.run_until_idle()
    return r


@pytest.fixture(scope="module")
def alone(engine, prompt_ids):
    return [_alone(engine, ids, i) for i, ids in enumerate(prompt_ids)]


def test_staggered_requests_get_their_alone_tokens(engine, prompt_ids, alone):
    """7 requests (greedy and sampled, prompts of 3..60 tokens, 9..75 new tokens) arriving every few steps into 4
    rows: each gets exactly the tokens it gets alone."""
    s = Scheduler(engine, max_prefill_tokens=24)
    reqs = []
    for i, ids in enumerate(prompt_ids):
        reqs.append(s.submit(Request(ids, _params(i), MAX_TOKENS[i])))
        for _ in range(1 + 2 * i):
            s.step()
    s.run_until_idle()
    for i, (a, r) in enumerate(zip(alone, reqs)):
        assert r.token_ids == a.token_ids, f"request {i}"
        assert r.finish_reason == a.finish_reason and r.text == a.text
    assert s.stats.decode_steps < sum(MAX_TOKENS)  # rows shared steps
    assert max(len(p) for p in prompt_ids) > 24  # some prompt ran in several chunks


def _greedy_by_hand(engine, ids: list[int], n: int) -> list[int]:
    """Engine.prefill of the whole prompt, then Engine.decode one token at a time, argmax: no scheduler, no sampler."""
    engine.reset()
    logits, out = engine.prefill(torch.tensor([ids])), []
    while len(out) < n:
        t = int(logits[0].argmax())
        if t == engine.config.eos_token_id:
            break
        out.append(t)
        logits = engine.decode(torch.tensor([t]))
    return out


def test_greedy_equals_prefill_and_decode(engine, prompt_ids, alone):
    """The scheduler's greedy tokens are those of the engine's own prefill + decode calls (whole-prompt prefill)."""
    for i in (0, 2, 4):
        assert _greedy_by_hand(engine, prompt_ids[i], MAX_TOKENS[i]) == alone[i].token_ids


def test_cancel_frees_the_row_and_changes_no_one_else(engine, prompt_ids, alone):
    s = Scheduler(engine, max_prefill_tokens=24)
    seen = threading.Event()

    def on_token(req, t, text):
        if len(req.token_ids) == 5:
            seen.set()

    victim = s.submit(Request(prompt_ids[1], _params(1), MAX_TOKENS[1], on_token=on_token))
    others = [s.submit(Request(prompt_ids[i], _params(i), MAX_TOKENS[i])) for i in (0, 2, 3, 4)]
    while not seen.is_set():
        s.step()
    t = threading.Thread(target=victim.cancel)  # from another thread
    t.start()
    t.join()
    s.run_until_idle()
    assert victim.finish_reason == "cancelled"
    assert 5 <= len(victim.token_ids) < MAX_TOKENS[1]
    assert victim.token_ids == alone[1].token_ids[: len(victim.token_ids)]
    for i, r in zip((0, 2, 3, 4), others):
        assert r.token_ids == alone[i].token_ids, f"request {i}"
    assert all(row.req is None for row in s.rows)


@pytest.fixture(scope="module")
def engine32():
    return Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.float32, max_batch_size=2,
                                  max_seq_len=256, quant="none", progress=False)


def test_second_turn_reuses_the_row(engine32, prompt_ids):
    """A prompt extending a finished request's whole sequence prefills only its new tokens and gives the tokens of
    a cold run. In fp32: the reused positions were written by decode steps, a cold run's by prefill, and in bf16 the
    two round differently (docs/architecture.md, "Continuous batching")."""
    engine = engine32
    tok = engine.get_tokenizer()
    s = Scheduler(engine, max_prefill_tokens=16)
    first = s.submit(Request(prompt_ids[0], _params(0), 30, ignore_eos=True))
    s.run_until_idle()
    turn2 = prompt_ids[0] + first.token_ids + tok.encode("\n\ndef lucas(n):", add_bos=False)
    before = s.stats.prefill_tokens
    second = s.submit(Request(turn2, _params(0), 40))
    s.run_until_idle()
    assert s.stats.reuse_hits == 1 and second.reused_tokens >= len(turn2) - len(first.token_ids) - 10
    assert s.stats.prefill_tokens - before == len(turn2) - second.reused_tokens
    cold = Scheduler(engine, max_prefill_tokens=16, reuse=False)
    ref = cold.submit(Request(turn2, _params(0), 40))
    cold.run_until_idle()
    assert cold.stats.reuse_hits == 0
    assert second.token_ids == ref.token_ids


def test_unrelated_prompt_does_not_reuse(engine, prompt_ids):
    s = Scheduler(engine, max_prefill_tokens=16)
    s.submit(Request(prompt_ids[0], _params(0), 8))
    s.run_until_idle()
    s.submit(Request(prompt_ids[2], _params(2), 8))
    s.run_until_idle()
    assert s.stats.reuse_hits == 0


def test_a_lone_request_after_a_burst_steps_the_smallest_bucket(engine, prompt_ids):
    """After a burst every row holds a warm sequence; an unrelated request takes the lowest row (evicting its
    sequence), not the least recently used one higher up that would make each of its steps run 4 rows."""
    s = Scheduler(engine, max_prefill_tokens=64)
    for i, n in enumerate([12, 10, 8, 3]):  # row 3 ends first: the least recently used row
        s.submit(Request(prompt_ids[i], _params(0), n, ignore_eos=True))
    s.run_until_idle()
    assert all(r.owner is not None for r in s.rows)
    steps, rows = s.stats.decode_steps, s.stats.decode_bucket_rows
    s.submit(Request(prompt_ids[5], _params(0), 6, ignore_eos=True))
    s.run_until_idle()
    assert s.stats.decode_steps - steps == 5 and s.stats.decode_bucket_rows - rows == 5  # one row per step
    assert s.rows[0].seq[:len(prompt_ids[5])] == prompt_ids[5] and s.rows[3].owner is not None


def test_long_prompt_interleaves_with_decode(engine, prompt_ids):
    """A prompt of several chunks: the generating row emits tokens between its chunks."""
    s = Scheduler(engine, max_prefill_tokens=8)
    events = []
    real = engine.prefill_at

    def traced(tokens, lengths, start):
        events.append("chunk")
        assert bool((lengths > 0).all()), lengths  # only the chunk's rows are computed (rows swapped down)
        return real(tokens, lengths, start)

    engine.prefill_at = traced
    try:
        s.submit(Request(prompt_ids[3], _params(3), 40, on_token=lambda r, t, x: events.append("token")))
        for _ in range(4):
            s.step()
        long = s.submit(Request(prompt_ids[1], _params(1), 4))
        s.run_until_idle()
    finally:
        del engine.prefill_at
    assert len(prompt_ids[1]) > 4 * 8 and long.finish_reason == "length"
    chunks = [i for i, e in enumerate(events) if e == "chunk"][1:]  # the long prompt's
    assert len(chunks) == -(-len(prompt_ids[1]) // 8)
    assert all("token" in events[a:b] for a, b in zip(chunks, chunks[1:]))


def test_stops(engine, prompt_ids, alone):
    """A stop id ends a request without returning it; a stop string cuts the text before it and is never
    streamed."""
    ref = alone[0]
    streamed = []
    s = Scheduler(engine)
    by_id = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0], stop_ids=frozenset({ref.token_ids[6]})))
    word = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]
    assert word.strip()
    by_text = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0], stop=(word,),
                               on_token=lambda r, t, x: streamed.append(x or "")))
    s.run_until_idle()
    k = ref.token_ids.index(ref.token_ids[6])
    assert by_id.token_ids == ref.token_ids[:k] and by_id.finish_reason == "stop"
    assert by_text.finish_reason == "stop" and by_text.text == ref.text[: ref.text.index(word)]
    assert "".join(streamed) == by_text.text
    assert by_text.token_ids == ref.token_ids[: len(by_text.token_ids)]
    # generate()'s stop as one string is that string (as vLLM's stop=), not its characters
    got = generate(engine, [prompt_ids[0]], max_new_tokens=MAX_TOKENS[0], seed=100, stop=word)
    assert got.texts[0] == by_text.text and got.finish_reasons[0] == "stop"


def test_a_stop_string_completed_by_the_held_back_end_is_a_stop():
    """A request's last token ends inside a UTF-8 character, so its text is held back; finishing at max_tokens
    flushes it, and where that completes a stop string the text is cut there and the request ends "stop" (as a
    stop string seen a token earlier would), not "length"."""
    class Bytes:  # a byte-level tokenizer: token 1 is "b" and the first byte of a 3-byte character
        pieces = {0: b"a", 1: b"b\xe2"}

        def decode(self, ids):
            return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    shown = []
    r = Request([0], SamplingParams(), 2, stop=("ab",), on_token=lambda req, t, x: shown.append(x))
    r.start_text(Bytes())
    assert not r.add_token(0, 0.0) and not r.add_token(1, 0.0)  # nothing complete to match yet
    r.finish("length", 0.0)
    assert (r.finish_reason, r.text, r.stop_string_hit) == ("stop", "", True) and "".join(x or "" for x in shown) == ""


def test_more_requests_than_rows_and_max_seq_len(prompt_ids):
    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.bfloat16, max_batch_size=2,
                                 max_seq_len=64, quant="none", progress=False)
    s = Scheduler(eng, max_prefill_tokens=32)
    reqs = [s.submit(Request(prompt_ids[i], _params(i), 100, ignore_eos=True)) for i in (0, 2, 3, 5, 6)]
    s.run_until_idle()
    for i, r in zip((0, 2, 3, 5, 6), reqs):
        assert r.finish_reason == "max_seq_len"
        assert len(prompt_ids[i]) + len(r.token_ids) == 64 + 1  # the last token needs no cache position


def test_bad_requests_are_refused(engine):
    s = Scheduler(engine)
    with pytest.raises(ValueError, match="prompt: needs at least one token"):
        s.submit(Request([]))
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        s.submit(Request([5] * 513))
    with pytest.raises(ValueError, match="outside"):
        s.submit(Request([5, 4096]))
    with pytest.raises(ValueError, match="max_tokens"):
        s.submit(Request([5], max_tokens=0))
    with pytest.raises(ValueError, match="temperature"):
        s.submit(Request([5], SamplingParams(temperature=-1.0)))
    with pytest.raises(ValueError, match="stop"):
        s.submit(Request([5], stop=("",)))
    # inputs a caller may mean otherwise: refused where they are made, naming the field
    with pytest.raises(ValueError, match="prompt: token ids .* got text"):
        Request("123")
    with pytest.raises(ValueError, match="prompt: token ids must be ints"):
        Request([0.0, 5.7])
    with pytest.raises(ValueError, match="params: a SamplingParams"):
        Request([5], params={"temperature": 0})
    with pytest.raises(ValueError, match="on_token: must be callable"):
        Request([5], on_token=5)
    assert Request([5], stop="ab").stop == ("ab",) and Request([5], stop_ids=7).stop_ids == {7}
    assert s.idle()


def test_a_raising_callback_ends_only_its_request(engine, prompt_ids, alone):
    """A caller's on_token that raises ends its own request ("error", the exception kept) at the next step
    boundary; the request beside it runs on to its alone tokens and the scheduler stays usable. generate()'s
    stream that raises ends the call with that exception."""
    s = Scheduler(engine)

    def bad(req, t, text):
        raise KeyError("client code")

    broken = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0], on_token=bad))
    fine = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0]))
    s.run_until_idle()
    assert broken.finish_reason == "error" and isinstance(broken.callback_error, KeyError) and broken.done
    assert fine.token_ids == alone[0].token_ids and fine.finish_reason == alone[0].finish_reason
    # raising on its last token (its cap reached in the same read): "error" too, not "length"
    last = s.submit(Request(prompt_ids[0], _params(0), 1, on_token=bad))
    s.run_until_idle()
    assert last.finish_reason == "error" and len(last.token_ids) == 1
    with pytest.raises(KeyError, match="client code"):
        generate(engine, [prompt_ids[0], prompt_ids[1]], max_new_tokens=4, stream=lambda i, t, x: bad(None, t, x))
    again = generate(engine, [prompt_ids[0]], max_new_tokens=MAX_TOKENS[0], seed=100)
    assert again.token_ids[0] == alone[0].token_ids[: len(again.token_ids[0])]


def test_a_request_runs_once_and_stop_is_final(engine):
    """Submitting a Request again (queued, or after it finished) is refused: one Request is one run (it would
    otherwise hold two rows, or a row nothing frees). stop(): serve_forever ends what it still holds
    ("cancelled"), so no caller waits forever, and later submits raise."""
    s = Scheduler(engine)
    r = s.submit(Request([0, 5, 6], SamplingParams(), 3, ignore_eos=True))
    with pytest.raises(ValueError, match="already submitted"):
        s.submit(r)
    s.run_until_idle()
    with pytest.raises(ValueError, match="already submitted"):
        s.submit(r)
    assert r.finish_reason == "length" and s.idle()
    s = Scheduler(engine)
    held = [s.submit(Request([0, 5 + i], SamplingParams(), 10 ** 6 if i == 0 else 40, ignore_eos=True))
            for i in range(3)]
    t = threading.Thread(target=s.serve_forever)
    t.start()
    while not held[0].token_ids:
        time.sleep(0.01)
    s.stop()
    t.join(60)
    assert all(h.done for h in held) and held[0].finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="stopped"):
        s.submit(Request([0, 5]))
    # its rows are freed: the engine goes to the next scheduler at once while the stopped one is still alive
    assert all(row.req is None for row in s.rows)
    assert generate(engine, [[0, 5, 6]], max_new_tokens=2).token_ids[0]


def test_a_failing_step_ends_every_request_and_gives_the_engine_up(engine, prompt_ids, alone, monkeypatch):
    """A step that raises (Ctrl-C, out of memory) under run_until_idle() (generate()'s loop): every request it held
    ends with "error" (a waiter returns), the scheduler is stopped, and the engine goes to the next scheduler at
    once, even while the failed one is still referenced (a kept exception); the next run gets its alone tokens."""
    s = Scheduler(engine, max_prefill_tokens=8)
    real, calls = engine.prefill_at, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(engine, "prefill_at", flaky)
    reqs = [s.submit(Request(ids, _params(i), MAX_TOKENS[i])) for i, ids in enumerate(prompt_ids[:3])]
    with pytest.raises(KeyboardInterrupt):
        s.run_until_idle()
    assert all(r.wait(0) and r.finish_reason == "error" for r in reqs)
    with pytest.raises(RuntimeError, match="stopped"):
        s.submit(Request([0, 5]))
    monkeypatch.setattr(engine, "prefill_at", real)
    got = generate(engine, [prompt_ids[0]], max_new_tokens=MAX_TOKENS[0])  # greedy, as _params(0)
    assert got.token_ids[0] == alone[0].token_ids


def test_a_failing_step_under_serve_forever_reaches_the_callers(engine, prompt_ids):
    """The loop dies on a step's exception: its requests end with "error" and on_step runs once more, so a server
    delivers those ends (its events are flushed by on_step; no further step would)."""
    s = Scheduler(engine, max_prefill_tokens=8)
    flushed = []
    s.on_step = lambda: flushed.append([r.finish_reason for r in reqs])
    real = engine.prefill_at

    def failing(*a, **k):
        raise RuntimeError("CUDA out of memory (stand-in)")

    engine.prefill_at = failing
    try:
        reqs = [s.submit(Request(ids, _params(i), MAX_TOKENS[i])) for i, ids in enumerate(prompt_ids[:2])]
        with pytest.raises(RuntimeError, match="out of memory"):
            s.serve_forever()
    finally:
        engine.prefill_at = real
    assert flushed and flushed[-1] == ["error", "error"]


@pytest.mark.parametrize("layout", ["hf", "official", "dsv4"])
def test_layouts(tmp_path, layout):
    """Tiny checkpoints in each layout: staggered requests get generate()'s greedy tokens (fp32)."""
    write_tiny_checkpoint(tmp_path, layout, seed=3)
    eng = Engine.from_pretrained(tmp_path, device="cpu", dtype=torch.float32, max_batch_size=3, max_seq_len=128,
                                 progress=False)
    prompts = [[1, 5, 9, 13, 2, 7, 30, 31, 8], [1, 4], [1, 17, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 20], [1, 6, 6]]
    want = [generate(eng, [p], max_new_tokens=20 + 3 * i).token_ids[0] for i, p in enumerate(prompts)]
    s = Scheduler(eng, max_prefill_tokens=5)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(s.submit(Request(p, SamplingParams(), 20 + 3 * i)))
        s.step()
        s.step()
    s.run_until_idle()
    assert [r.token_ids for r in reqs] == want


def test_logprobs_are_the_models(engine32, prompt_ids):
    """logprobs=k: each kept token's log-probability and the k most likely, from the logits it was drawn from (the
    engine's own prefill / decode logits, log-softmaxed here), for the first token and the decode steps alike."""
    eng = engine32
    s = Scheduler(eng, max_prefill_tokens=16)
    k, n = 3, 12
    greedy = s.submit(Request(prompt_ids[0], _params(0), n, logprobs=k, ignore_eos=True))
    sampled = s.submit(Request(prompt_ids[1], _params(1), n, logprobs=0, ignore_eos=True))
    plain = s.submit(Request(prompt_ids[2], _params(2), n))
    s.run_until_idle()
    assert plain.token_logprobs == [] and len(sampled.token_logprobs) == n and len(greedy.token_logprobs) == n
    for req in (greedy, sampled):
        eng.reset()
        logits = eng.prefill(torch.tensor([req.prompt]))
        for t, (lp, top) in zip(req.token_ids, req.token_logprobs):
            want = torch.log_softmax(logits[0].float(), -1)
            assert abs(lp - float(want[t])) < 1e-5
            assert len(top) == req.logprobs
            if top:
                vals, ids = want.topk(req.logprobs)
                assert [i for i, _ in top] == ids.tolist() and max(abs(a - b) for (_, a), b in zip(top, vals.tolist())) < 1e-5
                assert top[0][0] == t  # greedy: the token is the most likely
            logits = eng.decode(torch.tensor([t]))
    with pytest.raises(ValueError, match="logprobs"):
        s.submit(Request(prompt_ids[0], logprobs=21))


def test_prompt_logprobs_are_the_models(engine32, prompt_ids, monkeypatch):
    """prompt_logprobs=k: each prompt token's log-probability after the tokens before it, and the k most likely
    there, equal to a whole-prompt prefill's logits (all_logits) whatever the chunking, next to a request that
    generates; max_tokens=0 scores and generates nothing; a scored prompt never continues a kept row (it needs every
    position); the plans carry the scoring over the torchrun wire (encode -> decode); the refusals."""
    from dsv4_model.runtime.step_plan import StepPlan

    eng, k = engine32, 3
    real, scored_plans = StepPlan.run, []

    def via_wire(plan, e, runner):
        back = StepPlan.decode(plan.encode())
        scored_plans.append(back.score is not None)
        out = real(back, e, runner)
        plan.prefill_logits = getattr(back, "prefill_logits", None)
        plan.scores = getattr(back, "scores", None)
        return out

    monkeypatch.setattr(StepPlan, "run", via_wire)
    prompt = prompt_ids[1] + prompt_ids[3][1:]
    s = Scheduler(eng, max_prefill_tokens=7)
    first = s.submit(Request(prompt, SamplingParams(), 4, ignore_eos=True))
    s.run_until_idle()
    # the first request's whole sequence as this prompt: a row would continue it, a scored prompt must not
    scored = s.submit(Request(prompt + first.token_ids, SamplingParams(), 5, prompt_logprobs=k, ignore_eos=True))
    other = s.submit(Request(prompt_ids[0], SamplingParams(), 12, ignore_eos=True))
    only = s.submit(Request(prompt, SamplingParams(), 0, prompt_logprobs=0))
    s.run_until_idle()
    assert any(scored_plans) and s.stats.reuse_hits == 0
    assert only.finish_reason == "length" and only.token_ids == []
    assert len(only.prompt_token_logprobs) == len(prompt) - 1
    alone = Scheduler(eng)
    ref = alone.submit(Request(prompt + first.token_ids, SamplingParams(), 5, ignore_eos=True))
    ref2 = alone.submit(Request(prompt_ids[0], SamplingParams(), 12, ignore_eos=True))
    alone.run_until_idle()
    assert scored.token_ids == ref.token_ids and other.token_ids == ref2.token_ids and scored.token_logprobs == []
    for req in (scored, only):
        eng.reset()
        want = torch.log_softmax(eng.prefill(torch.tensor([req.prompt]), all_logits=True)[0].float(), -1)
        assert len(req.prompt_token_logprobs) == len(req.prompt) - 1
        for t, (lp, top) in enumerate(req.prompt_token_logprobs):
            assert abs(lp - float(want[t, req.prompt[t + 1]])) < 1e-5, t
            vals, ids = want[t].topk(req.prompt_logprobs)
            assert [i for i, _ in top] == ids.tolist(), t
            assert all(abs(a - b) < 1e-5 for (_, a), b in zip(top, vals.tolist()))
    for bad in (21, True):  # a bool is not a count
        with pytest.raises(ValueError, match="prompt_logprobs"):
            s.submit(Request(prompt, prompt_logprobs=bad))
    with pytest.raises(ValueError, match="logprobs"):
        s.submit(Request(prompt, logprobs=True))
    with pytest.raises(ValueError, match="max_tokens"):
        s.submit(Request(prompt, max_tokens=0))


def test_a_stop_tokens_logprob_is_kept(engine32, prompt_ids):
    """A request asking for logprobs that a stop id ends (its first token, or a later one) keeps that token's
    entry last in token_logprobs (stop_token names it; token_ids leave it out), as a scorer expects one entry per
    generated token; without logprobs nothing is kept."""
    s = Scheduler(engine32, max_prefill_tokens=16)
    ref = s.submit(Request(prompt_ids[2], SamplingParams(), 8, logprobs=2, ignore_eos=True))
    s.run_until_idle()
    for at in (0, 5):
        t = ref.token_ids[at]
        r = s.submit(Request(prompt_ids[2], SamplingParams(), 8, logprobs=2, stop_ids={t}, ignore_eos=True))
        quiet = s.submit(Request(prompt_ids[2], SamplingParams(), 8, stop_ids={t}, ignore_eos=True))
        s.run_until_idle()
        j = ref.token_ids.index(t)
        assert r.finish_reason == "stop" and r.token_ids == ref.token_ids[:j] and r.stop_token == t
        assert len(r.token_logprobs) == j + 1 and abs(r.token_logprobs[j][0] - ref.token_logprobs[j][0]) < 1e-5
        assert quiet.stop_token is None and quiet.token_logprobs == []


def test_riding_rows_at_a_window_close_keep_their_state(engine32):
    """A prompt prefilled one token per iteration (so its row rides along in decode steps at every position,
    window-closing ones included) while a higher row generates: its tokens equal its alone tokens (the step must
    not shift the riding row's compressor state past the window its next chunk reads)."""
    eng, tok = engine32, engine32.get_tokenizer()
    ids = tok.encode((DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text())
    for off in (0, 500):
        prompt = ids[off:off + 40]
        alone = Scheduler(eng, max_prefill_tokens=1)
        ref = alone.submit(Request(prompt, SamplingParams(), 24, ignore_eos=True))
        alone.run_until_idle()
        s = Scheduler(eng, max_prefill_tokens=1)
        s.submit(Request([5, 6, 7], SamplingParams(), 1, ignore_eos=True))  # row 0 for a moment
        s.submit(Request(ids[300:303], SamplingParams(), 120, ignore_eos=True))  # row 1, generating throughout
        for _ in range(6):
            s.step()
        got = s.submit(Request(prompt, SamplingParams(), 24, ignore_eos=True))  # row 0, below the generating row
        s.run_until_idle()
        assert got.token_ids == ref.token_ids, off


def test_same_prompt_again_is_not_continued_from_its_last_position(engine32, prompt_ids):
    """A finished request's prompt sent again: its caches hold one position more than a continuation from the
    prompt's last token could use (that position's write overwrote what it reads), so it is prefilled cold."""
    s = Scheduler(engine32, max_prefill_tokens=16)
    first = s.submit(Request(prompt_ids[4], _params(4), 1))
    s.run_until_idle()
    again = s.submit(Request(prompt_ids[4], _params(4), 6))
    s.run_until_idle()
    cold = Scheduler(engine32, max_prefill_tokens=16, reuse=False)
    ref = cold.submit(Request(prompt_ids[4], _params(4), 6))
    cold.run_until_idle()
    assert s.stats.reuse_hits == 0 and again.token_ids == ref.token_ids and again.token_ids[:1] == first.token_ids


def test_cancelled_before_submit(engine32):
    s = Scheduler(engine32)
    r = Request([0, 5, 6], SamplingParams(), 20, ignore_eos=True)
    r.cancel()
    s.submit(r)
    s.run_until_idle()
    assert r.finish_reason == "cancelled" and r.token_ids == []


def test_generate_pads_the_bucket_past_its_rows(engine32):
    """generate() with 3 prompts on 4 rows steps in a bucket of 4 when the runner pads to buckets (compile / CUDA
    graphs): the 4th row rides along; the tokens are the unpadded run's."""
    prompts = [[0, 5, 6], [0, 7], [0, 9, 9, 9]]
    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.float32, max_batch_size=4,
                                 max_seq_len=128, quant="none", progress=False)
    want = generate(eng, prompts, max_new_tokens=5).token_ids
    from dsv4_model.runtime.compiled import DecodeRunner

    eng._runner = DecodeRunner(eng.model, compile=True, compile_backend="eager")  # pads 3 rows to a bucket of 4
    eng._runner_built_from = eng._checked_runner_options()
    assert eng.runner().bucket(3) == 4
    assert generate(eng, prompts, max_new_tokens=5).token_ids == want


def test_one_scheduler_drives_an_engine_at_a_time(engine, prompt_ids, alone):
    """Schedulers share an engine's cache rows one at a time (generate() makes one per call, a server holds one):
    one takes the engine from another only while that one holds no request, and a scheduler whose construction
    fails leaves the engine to the next one that submits."""
    s = Scheduler(engine)
    held = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0]))
    with pytest.raises(RuntimeError, match="another Scheduler on this engine holds requests"):
        generate(engine, [prompt_ids[1]], max_new_tokens=2)
    s.run_until_idle()
    assert held.token_ids == alone[0].token_ids
    t = Scheduler(engine, max_prefill_tokens=24)  # s is idle: t takes the engine
    r = t.submit(Request(prompt_ids[1], _params(1), MAX_TOKENS[1]))
    with pytest.raises(RuntimeError, match="another Scheduler"):
        s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0]))
    t.run_until_idle()
    assert r.token_ids == alone[1].token_ids
    # s takes it back (its kept row is forgotten: t wrote the caches) and gets the same tokens again
    again = s.submit(Request(prompt_ids[0] + held.token_ids, _params(2), 5))
    s.run_until_idle()
    assert s.stats.reuse_hits == 0 and again.finish_reason == "length"
    u = Scheduler(engine)
    cold = u.submit(Request(prompt_ids[0] + held.token_ids, _params(2), 5))
    u.run_until_idle()
    assert again.token_ids == cold.token_ids
    with pytest.raises(ValueError, match="rows"):
        Scheduler(engine, rows=99)
    ok = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0]))  # the failed one holds nothing
    s.run_until_idle()
    assert ok.token_ids == alone[0].token_ids



def test_a_draining_owner_is_waited_for_not_refused(engine, prompt_ids, alone):
    """A server's last request ends inside a step (its client already has the answer) while that step, and the
    read of the step launched behind it, are still to finish: a generate() then waits for them instead of finding
    the engine busy; an owner that still holds a request is refused at once."""
    import threading

    s = Scheduler(engine)
    done = threading.Event()

    def finished(_):  # the client is answered here, and the rest of the step takes a while
        done.set()
        time.sleep(0.3)

    r = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0], on_finish=finished))

    def drive():  # the server's thread: steps until idle, slowly, as a large model would
        while not s.idle():
            s.step()
            time.sleep(0.05)

    th = threading.Thread(target=drive)
    th.start()
    assert done.wait(60)
    got = generate(engine, [prompt_ids[1]], max_new_tokens=2)  # no RuntimeError: s drained first
    th.join()
    assert r.token_ids == alone[0].token_ids and len(got.token_ids[0]) == 2
    s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0]))
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="another Scheduler on this engine holds requests"):
        generate(engine, [prompt_ids[1]], max_new_tokens=2)
    assert time.perf_counter() - t0 < 1.0  # refused without the drain wait
    s.run_until_idle()


def test_a_stopped_owner_with_a_step_in_flight_gives_the_engine_up(engine, prompt_ids, alone, monkeypatch):
    """A server's scheduler stopped right after its last request ended (SIGTERM) never reads the step it launched
    behind that request: the engine goes to the next scheduler at once, not after a wait, and not never."""
    s = Scheduler(engine)
    r = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0]))
    while r.finish_reason is None:
        s.step()
    # On a GPU the step launched behind the last token's read is still in flight here (the CPU reads each step
    # as it launches it): stand in for it, as the owner's state is all the taker looks at.
    s._flight = s._flight or object()
    monkeypatch.setattr("dsv4_model.runtime.scheduler.DRAIN_WAIT_S", 0.2)
    with pytest.raises(RuntimeError, match="another Scheduler"):  # running, it would read that step: busy
        Scheduler(engine)
    s.stop()
    t0 = time.perf_counter()
    got = generate(engine, [prompt_ids[0]], max_new_tokens=MAX_TOKENS[0])  # greedy, as _params(0)
    assert time.perf_counter() - t0 < 5 and got.token_ids[0] == alone[0].token_ids


def test_every_eos_id_of_the_config_ends_a_completion(engine, prompt_ids, alone, monkeypatch):
    """A config listing several eos ids (HF's eos_token_id as a list: config.eos_token_ids) stops on each of them,
    in the scheduler and in generate()."""
    import dataclasses

    ids = alone[0].token_ids  # greedy (an even index): the same tokens again
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    cfg = engine.config
    monkeypatch.setattr(engine, "config", dataclasses.replace(cfg, eos_token_ids=(cfg.eos_token_id, ids[at])))
    s = Scheduler(engine)
    r = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0]))
    s.run_until_idle()
    assert r.token_ids == ids[:at] and r.finish_reason == "stop"  # (an eos is not part of the text)
    out = generate(engine, [prompt_ids[0]], max_new_tokens=MAX_TOKENS[0], seed=100)
    assert out.token_ids[0] == ids[:at] and out.finish_reasons[0] == "stop"


def _held_text(engine, a: int, n: int) -> list[int]:
    return engine.get_tokenizer().encode((DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text())[a:a + n]


def test_a_prefix_snapshot_serves_later_prompts(engine32, monkeypatch):
    """A request that asks for a snapshot at position 70 (a shared "system prompt"; past a window of 64 and
    compression boundaries) leaves its state there in a free row; later prompts that start with those 70 tokens
    continue from a copy of it (the snapshot stays for the next), prefill only their own tokens and get a cold
    run's tokens, greedy and sampled. A prompt that does not share the prefix does not use it. The plans run as
    decoded from the torchrun wire (the row copies travel in them)."""
    from dsv4_model.runtime.step_plan import StepPlan

    real, copied = StepPlan.run, []

    def via_wire(plan, e, runner):
        back = StepPlan.decode(plan.encode())
        assert (back.copies, back.keeps) == (plan.copies, plan.keeps)
        copied.extend(back.copies + back.keeps)
        out = real(back, e, runner)
        plan.prefill_logits = getattr(back, "prefill_logits", None)
        return out

    monkeypatch.setattr(StepPlan, "run", via_wire)
    eng = engine32
    system = _held_text(eng, 0, 70)
    prompts = [system + _held_text(eng, 100, 20), system + _held_text(eng, 200, 30), system + _held_text(eng, 300, 9),
               _held_text(eng, 1, 69) + _held_text(eng, 400, 10)]
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=3), SamplingParams()]
    s = Scheduler(eng, max_prefill_tokens=32, snapshot_min_tokens=16)
    got = []
    for p, sp in zip(prompts, params):
        before = s.stats.prefill_tokens
        got.append(s.submit(Request(p, sp, 20, ignore_eos=True, snapshot_at=(70,) if p[:70] == system else ())))
        s.run_until_idle()
        assert s.stats.prefill_tokens - before == len(p) - got[-1].reused_tokens
    assert s.stats.snapshots == 1 and s.stats.snapshot_hits == 2
    assert [r.reused_tokens for r in got] == [0, 70, 70, 0]
    kept = [r for r in s.rows if r.shared and r.owner is not None]
    assert len(kept) == 1 and kept[0].seq == system and kept[0].filled == 70 and len(copied) == 3
    cold = Scheduler(eng, max_prefill_tokens=32, reuse=False)
    refs = [cold.submit(Request(p, sp, 20, ignore_eos=True)) for p, sp in zip(prompts, params)]
    cold.run_until_idle()
    assert [r.token_ids for r in got] == [r.token_ids for r in refs]


def test_snapshots_need_a_free_row_and_are_kept_once(engine):
    """Snapshots take free rows only (every row busy: none kept, the prompt runs as without); requests sharing a
    prefix keep one snapshot of it; a snapshot shorter than snapshot_min_tokens, or one beyond what the scheduler
    keeps, is not made; a bad snapshot_at is refused."""
    system = _held_text(engine, 0, 40)
    rows = len(Scheduler(engine).rows)
    full = Scheduler(engine, max_prefill_tokens=256, snapshot_min_tokens=8)  # every prompt in the first chunk
    reqs = [full.submit(Request(_held_text(engine, 50 * i, 46), SamplingParams(), 4, snapshot_at=(40,)))
            for i in range(rows)]  # (prefixes that differ: none waits for another's snapshot)
    full.run_until_idle()
    assert full.stats.snapshots == 0 and all(r.finish_reason == "length" for r in reqs)
    two = Scheduler(engine, max_prefill_tokens=16, snapshot_min_tokens=8)
    for i in range(2):
        two.submit(Request(system + [5 + i] * 6, SamplingParams(), 4, snapshot_at=(40,)))
    two.run_until_idle()
    assert two.stats.snapshots == 1
    short = Scheduler(engine, max_prefill_tokens=16, snapshot_min_tokens=41)
    short.submit(Request(system + [5] * 6, SamplingParams(), 4, snapshot_at=(40,)))
    short.run_until_idle()
    off = Scheduler(engine, max_prefill_tokens=16, snapshots=False)
    off.submit(Request(system + [5] * 6, SamplingParams(), 4, snapshot_at=(40,)))
    off.run_until_idle()
    assert short.stats.snapshots == 0 and off.stats.snapshots == 0
    for bad in ((0,), (46,), (True,), 40, (4.0,)):
        with pytest.raises(ValueError, match="snapshot_at"):
            off.submit(Request(system + [5] * 6, SamplingParams(), 4, snapshot_at=bad))


def test_samples_of_one_prompt_share_its_prefill(engine32):
    """n samples of a prompt submitted together, each asking for a snapshot before the last token: the first
    prefills it, the others wait for its snapshot (requests behind them are admitted meanwhile) and continue from
    copies, prefilling one token each; every sample gets its own cold run's tokens."""
    eng = engine32
    prompt = _held_text(eng, 0, 60)
    params = [SamplingParams(temperature=0.9, top_k=30, seed=s) for s in (1, 2)]
    s = Scheduler(eng, max_prefill_tokens=16, snapshot_min_tokens=16)
    got = [s.submit(Request(prompt, p, 12, ignore_eos=True, snapshot_at=(59,))) for p in params]
    s.run_until_idle()
    assert s.stats.snapshots == 1 and [r.reused_tokens for r in got] == [0, 59]
    assert s.stats.prefill_tokens == len(prompt) + 1
    cold = Scheduler(eng, max_prefill_tokens=16, reuse=False)
    refs = [cold.submit(Request(prompt, p, 12, ignore_eos=True)) for p in params]
    cold.run_until_idle()
    assert [r.token_ids for r in got] == [r.token_ids for r in refs] and got[0].token_ids != got[1].token_ids


def test_a_request_waiting_for_a_snapshot_lets_others_pass(engine):
    """While a request waits for a snapshot another row is about to keep, a different prompt behind it is admitted
    (it takes the free row); with no row free at the mark no snapshot is kept and the waiting one goes on as usual."""
    system = _held_text(engine, 0, 40)
    s = Scheduler(engine, max_prefill_tokens=8, snapshot_min_tokens=8)
    a = s.submit(Request(system + [5, 6], SamplingParams(), 6, snapshot_at=(40,)))
    s.step()  # a admitted, its first chunk planned
    b = s.submit(Request(system + [7, 8], SamplingParams(), 6, snapshot_at=(40,)))
    c = s.submit(Request(_held_text(engine, 300, 12), SamplingParams(), 6))
    s.step()
    assert b.timings.admitted is None and c.timings.admitted is not None
    s.run_until_idle()
    assert b.reused_tokens == 40 and s.stats.snapshot_hits == 1
    assert all(r.finish_reason == "length" for r in (a, b, c))


def test_a_snapshot_inside_the_bucket_moves_up_rather_than_push_its_user_out(engine):
    """Row 0 generating (the bucket for one more live row: 2), a snapshot in row 1, rows 2-3 warm: a prompt that
    extends the snapshot takes row 1 (a copy into row 2 would make every step run bucket 4) and the snapshot is
    copied up into row 2 first (the plan's copies), its bookkeeping with it; the hit is counted."""
    s = Scheduler(engine, max_prefill_tokens=16, snapshot_min_tokens=8)
    live = s.submit(Request(_held_text(engine, 500, 12), SamplingParams(), 40, ignore_eos=True))
    s.step()
    system = _held_text(engine, 0, 30)
    r1, r2, r3 = s.rows[1:]
    r1.owner, r1.seq, r1.filled, r1.shared, r1.last_used = -7, list(system), 30, True, 5.0
    for r, t in ((r2, 3.0), (r3, 4.0)):
        r.owner, r.seq, r.filled, r.last_used = 900 + r.index, _held_text(engine, 100 * r.index, 20), 20, t
    req = s.submit(Request(system + [9, 10, 11], SamplingParams(), 4))
    s._admit(time.perf_counter())
    assert s.rows[0].req is live and r1.req is req and s._copies == [(1, 2)]
    assert r2.shared and r2.owner == -7 and r2.seq == system and r2.filled == 30 and r2.req is None
    assert r1.seq == system and r1.filled == 30 and not r1.shared and req.reused_tokens == 30
    assert s.stats.snapshot_hits == 1
    s.run_until_idle()
    assert req.finish_reason == "length" and live.finish_reason == "length"


def test_a_prefix_two_prompts_shared_serves_the_third(engine32):
    """Prompts that mark nothing (raw completions sharing a 70-token document): the second, sharing 70 tokens with
    the first's kept row, asks for a snapshot there itself; the third continues from a copy of it and gets a cold
    run's tokens. A third prompt sent while the second still prefills waits for that snapshot."""
    eng = engine32
    doc = _held_text(eng, 0, 70)
    prompts = [doc + _held_text(eng, 100 + 40 * i, 12) for i in range(4)]
    s = Scheduler(eng, max_prefill_tokens=16, snapshot_min_tokens=16)
    got = []
    for p in prompts[:3]:
        got.append(s.submit(Request(p, SamplingParams(), 10, ignore_eos=True)))
        s.run_until_idle()
    assert [r.reused_tokens for r in got] == [0, 0, 70] and got[1].learned_snapshot_at == (70,)
    assert s.stats.snapshots == 1 and got[1].snapshot_at == ()
    cold = Scheduler(eng, max_prefill_tokens=16, reuse=False)
    refs = [cold.submit(Request(p, SamplingParams(), 10, ignore_eos=True)) for p in prompts[:3]]
    cold.run_until_idle()
    assert [r.token_ids for r in got] == [r.token_ids for r in refs]
    # the same flow with the third sent at once: it waits for the second's snapshot
    s = Scheduler(eng, max_prefill_tokens=16, snapshot_min_tokens=16)
    s.submit(Request(prompts[0], SamplingParams(), 2, ignore_eos=True))
    s.run_until_idle()
    second = s.submit(Request(prompts[1], SamplingParams(), 2, ignore_eos=True))
    s.step()
    third = s.submit(Request(prompts[3], SamplingParams(), 2, ignore_eos=True))
    s.step()
    assert third.timings.admitted is None
    s.run_until_idle()
    assert third.reused_tokens == 70 and second.reused_tokens == 0


def test_copies_of_one_plan_that_chain_read_what_they_mean():
    """Two prompts extending a snapshot in row 1 (inside the bucket) admitted in one iteration: the first takes
    row 1 and the snapshot moves up to row 2, the second takes row 2 and it moves again to row 3. A plan's copies
    read every source before writing, so the second move must read row 1 (where the snapshot was), not row 2: a
    later prompt continuing from row 3 gets a cold run's tokens."""
    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.float32, max_batch_size=4,
                                 max_seq_len=256, quant="none", progress=False)
    system = _held_text(eng, 0, 40)
    s = Scheduler(eng, max_prefill_tokens=16, snapshot_min_tokens=8)
    live = s.submit(Request(_held_text(eng, 500, 12), SamplingParams(), 100, ignore_eos=True))  # row 0
    s.step()
    first = s.submit(Request(system + _held_text(eng, 100, 6), SamplingParams(), 2, snapshot_at=(40,)))
    while first.finish_reason is None:
        s.step()
    snap = next(r for r in s.rows if r.shared)
    if snap.index != 1:  # the snapshot into row 1 (content and bookkeeping), as an LRU pick would put it
        eng.copy_rows([(snap.index, 1)])
        r1 = s.rows[1]
        r1.owner, r1.seq, r1.filled, r1.shared, r1.key = snap.owner, list(snap.seq), snap.filled, True, snap.key
        snap.owner, snap.seq, snap.filled, snap.shared = None, [], 0, False
    a = s.submit(Request(system + _held_text(eng, 200, 6), SamplingParams(), 3))
    b = s.submit(Request(system + _held_text(eng, 300, 6), SamplingParams(), 3))
    s.step()
    assert a.reused_tokens == b.reused_tokens == 40 and s.rows[3].shared
    while a.finish_reason is None or b.finish_reason is None:
        s.step()
    live.cancel()
    s.run_until_idle()
    c = s.submit(Request(system + _held_text(eng, 400, 6), SamplingParams(), 12, ignore_eos=True))
    s.run_until_idle()
    cold = Scheduler(eng, max_prefill_tokens=16, reuse=False)
    ref = cold.submit(Request(c.prompt, SamplingParams(), 12, ignore_eos=True))
    cold.run_until_idle()
    assert c.reused_tokens == 40 and c.token_ids == ref.token_ids

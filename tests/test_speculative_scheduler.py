"""Speculative steps inside continuous batching (dsv4_model.runtime.speculative_scheduler): requests arriving at
staggered times get what they get alone (greedy: the plain scheduler's tokens; sampled: the static speculative
loop's, same seed), with ragged acceptance; stop strings, reuse of a finished row, cancellation, the max_seq_len
room a step needs, the refusals; on CUDA the compiled + captured steps give the eager tokens."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.builtin import DEFAULT_MODEL_DIR
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.sampling import SamplingParams
from dsv4_model.runtime.scheduler import Scheduler
from dsv4_model.runtime.session import RunnerOptions
from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler
from tests.helpers.speculative_static import static_speculative
from tests.helpers.to_the_end import to_the_end

K = 2
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n",
           "class Stack:", "x = 1", "for i in range(10):\n    print(i)\n"]
MAX_TOKENS = [30, 45, 12, 38, 26]


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(seed=7 + i)
    return SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7 + i)


def _engine(device="cpu", rows=4, seq=512, **runner) -> Engine:
    return Engine.from_pretrained(DEFAULT_MODEL_DIR, device=device, dtype=torch.float32, max_batch_size=rows,
                                  max_seq_len=seq, quant="none", progress=False, spare_window_slots=K,
                                  runner_options=RunnerOptions(**runner) if runner else None)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return _engine()


@pytest.fixture(scope="module")
def prompt_ids(engine):
    tok = engine.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def _run(sched, prompt_ids, stagger: int, chunk_params=_params, **kw) -> list[Request]:
    reqs = []
    for i, ids in enumerate(prompt_ids):
        reqs.append(sched.submit(Request(ids, chunk_params(i), MAX_TOKENS[i], ignore_eos=True, **kw)))
        for _ in range(stagger):
            sched.step()
    sched.run_until_idle()
    return reqs


@pytest.fixture(scope="module")
def alone(engine, prompt_ids):
    out = []
    for i, ids in enumerate(prompt_ids):
        s = SpeculativeScheduler(engine, K, max_prefill_tokens=8)
        out.append(s.submit(Request(ids, _params(i), MAX_TOKENS[i], ignore_eos=True)))
        s.run_until_idle()
    return out


def test_staggered_requests_get_their_alone_tokens(engine, prompt_ids, alone):
    """5 requests on 4 rows, one every 2 iterations, prompts in chunks of 8 (rows join while others generate, ride
    along while prefilling): each gets its alone tokens; speculation accepted some drafts and took fewer steps."""
    s = SpeculativeScheduler(engine, K, max_prefill_tokens=8)
    got = _run(s, prompt_ids, 2)
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert all(r.finish_reason == "length" and len(r.token_ids) == MAX_TOKENS[i] for i, r in enumerate(got))
    acc = s.speculation.acceptance()
    assert 0.1 < acc[0] < 1 and s.speculation.tokens_per_step > 1.2
    plain = Scheduler(engine, max_prefill_tokens=8)
    _run(plain, prompt_ids, 2)
    assert s.stats.decode_steps < plain.stats.decode_steps


def test_greedy_equals_the_plain_scheduler(engine, prompt_ids, alone):
    plain = _run(Scheduler(engine, max_prefill_tokens=8), prompt_ids, 1)
    for i in range(0, len(PROMPTS), 2):  # the greedy requests
        assert alone[i].token_ids == plain[i].token_ids, i


def test_sampled_equals_the_static_speculative_loop(engine, prompt_ids, alone):
    """A sampled request alone in the scheduler draws what generate(speculate=K)'s static loop drew with its seed
    (the same Philox offsets per row: first token 0, first drafts 1, step j 2 + j)."""
    i = 1
    got, _, _ = static_speculative(engine, engine.speculative_runner(K), [prompt_ids[i]], [_params(i)],
                                   MAX_TOKENS[i], {-1})
    assert got[0] == alone[i].token_ids


def test_stop_strings_and_stop_ids(engine, prompt_ids, alone):
    """A stop id or string inside a step's accepted tokens ends the request there; tokens after it are dropped."""
    tok = engine.get_tokenizer()
    ref = alone[0].token_ids
    s = SpeculativeScheduler(engine, K, max_prefill_tokens=8)
    by_id = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0], stop_ids=frozenset({ref[9]}),
                             ignore_eos=True))
    text = tok.decode(ref[:12])
    s.run_until_idle()
    j = ref.index(ref[9])
    assert by_id.token_ids == ref[:j] and by_id.finish_reason == "stop"
    scored = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0], stop_ids=frozenset({ref[9]}), logprobs=1,
                              ignore_eos=True))
    s.run_until_idle()  # the stop token's entry kept last (a scorer's one entry per generated token)
    assert scored.token_ids == ref[:j] and scored.stop_token == ref[9] and len(scored.token_logprobs) == j + 1
    assert scored.token_logprobs[j][1][0][0] == ref[9]  # greedy: the stop token was the most likely
    word = text[-6:].strip() or text[-8:]
    by_str = s.submit(Request(prompt_ids[0], _params(0), MAX_TOKENS[0], stop=(word,), ignore_eos=True))
    s.run_until_idle()
    assert by_str.finish_reason == "stop" and word not in by_str.text
    assert tok.decode(ref).startswith(by_str.text) and len(by_str.token_ids) < len(ref)


def test_second_turn_reuses_the_row(engine, prompt_ids):
    """A prompt extending a finished request's sequence continues its row (only the new tokens prefilled) and
    gets the tokens of a cold run."""
    s = SpeculativeScheduler(engine, K, max_prefill_tokens=16)
    first = s.submit(Request(prompt_ids[2], _params(2), 17, ignore_eos=True))
    s.run_until_idle()
    turn2 = prompt_ids[2] + first.token_ids + prompt_ids[3][1:]
    again = s.submit(Request(turn2, _params(0), 20, ignore_eos=True))
    s.run_until_idle()
    assert s.stats.reuse_hits == 1 and again.reused_tokens == len(prompt_ids[2]) + len(first.token_ids) - 1
    cold = SpeculativeScheduler(engine, K, max_prefill_tokens=16, reuse=False)
    ref = cold.submit(Request(turn2, _params(0), 20, ignore_eos=True))
    cold.run_until_idle()
    assert again.token_ids == ref.token_ids


def test_a_request_ended_inside_its_accepted_run_leaves_no_row_to_continue(engine, prompt_ids):
    """A request that ends inside a step's accepted run (max_tokens here) leaves positions past its last token
    written on the device (the run's later drafts, the step launched behind it) that the host never saw: a second
    turn on its sequence gets a cold run's tokens (a continued row read shifted compressor state)."""
    tok = engine.get_tokenizer()
    s = SpeculativeScheduler(engine, K, max_prefill_tokens=64)
    first = s.submit(Request(prompt_ids[2], SamplingParams(), 7, ignore_eos=True))  # ends inside a run of 3
    s.run_until_idle()
    turn2 = prompt_ids[2] + first.token_ids + tok.encode("\n\nx = 1", add_bos=False)
    again = s.submit(Request(turn2, SamplingParams(), 12, ignore_eos=True))
    s.run_until_idle()
    cold = SpeculativeScheduler(engine, K, max_prefill_tokens=64, reuse=False)
    ref = cold.submit(Request(turn2, SamplingParams(), 12, ignore_eos=True))
    cold.run_until_idle()
    assert again.token_ids == ref.token_ids


def test_a_row_taken_over_counts_only_its_own_steps(engine, prompt_ids):
    """A request that takes the row of a cancelled one while that one's step is unread: the old step's read does
    not count against the newcomer (it would launch steps past its max_tokens, their tokens dropped)."""
    s = SpeculativeScheduler(engine, K, modes=("greedy",))
    x = s.submit(Request(prompt_ids[1], SamplingParams(), 50, ignore_eos=True))
    while len(x.token_ids) < 3:
        s.step()
    x.cancel()
    y = s.submit(Request(prompt_ids[3], SamplingParams(), 1, ignore_eos=True))  # the lowest free row: x's
    before = s.stats.decode_steps
    while not s.idle():
        s.step()
        assert all(r.pending >= 0 for r in s.rows)
    assert y.finish_reason == "length" and s.stats.decode_steps == before  # its one token comes from the prefill


def test_cancel_changes_no_one_else(engine, prompt_ids, alone):
    s = SpeculativeScheduler(engine, K, max_prefill_tokens=8)
    reqs = [s.submit(Request(ids, _params(i), MAX_TOKENS[i], ignore_eos=True)) for i, ids in enumerate(prompt_ids)]
    for _ in range(8):
        s.step()
    reqs[1].cancel()
    s.run_until_idle()
    assert reqs[1].finish_reason == "cancelled" and len(reqs[1].token_ids) < MAX_TOKENS[1]
    for i in (0, 2, 3, 4):
        assert reqs[i].token_ids == alone[i].token_ids, i


def test_max_seq_len_leaves_room_for_a_step():
    """A step writes up to 2K positions past a row's: a row ends with "max_seq_len" once it has no room, with the
    plain greedy tokens up to there; a longer prompt is refused."""
    eng = _engine(rows=2, seq=64)
    prompt = list(range(5, 45))
    s = SpeculativeScheduler(eng, K)
    r, ref = to_the_end(s, eng, prompt)
    assert r.finish_reason == "max_seq_len" and ref.finish_reason == "max_seq_len"
    assert r.token_ids == ref.token_ids[:len(r.token_ids)] and 64 - 2 * K - 40 <= len(r.token_ids)
    with pytest.raises(ValueError, match="no room for speculative steps"):
        s.submit(Request(list(range(1, 62)), SamplingParams(), 4))


def _teacher_forced_logprobs(engine, req: Request) -> list[torch.Tensor]:
    """The plain engine's log-softmaxed logits before each of req's tokens (prefill, then one decode per token)."""
    engine.reset()
    logits = engine.prefill(torch.tensor([req.prompt]))
    out = []
    for t in req.token_ids:
        out.append(torch.log_softmax(logits[0].float(), -1))
        logits = engine.decode(torch.tensor([t]))
    return out


def test_logprobs_are_the_main_models(engine, prompt_ids):
    """logprobs=k with speculation: each kept token's log-probability and the k most likely are the main model's
    (the verification's logits, which decided it), equal to the plain engine's teacher-forced logits; for the
    first token, accepted drafts and correction / bonus tokens alike, greedy and sampled rows in one batch,
    staggered; tokens equal a run without logprobs; a scored prompt (prompt_logprobs) beside them, its chunks
    filling the MTP block's cache too."""
    k = 3
    s = SpeculativeScheduler(engine, K, max_prefill_tokens=8)
    reqs = []
    for i in range(3):
        reqs.append(s.submit(Request(prompt_ids[i], _params(i), 20, logprobs=(k if i != 1 else 0),
                                     ignore_eos=True)))
        s.step()
    quiet = s.submit(Request(prompt_ids[3], _params(3), 20, ignore_eos=True))
    scored = s.submit(Request(prompt_ids[4], _params(0), 6, prompt_logprobs=1, ignore_eos=True))
    s.run_until_idle()
    engine.reset()
    want = torch.log_softmax(engine.prefill(torch.tensor([scored.prompt]), all_logits=True)[0].float(), -1)
    assert len(scored.prompt_token_logprobs) == len(scored.prompt) - 1
    assert all(abs(lp - float(want[t, scored.prompt[t + 1]])) < 1e-4 and top[0][0] == int(want[t].argmax())
               for t, (lp, top) in enumerate(scored.prompt_token_logprobs))
    assert s.speculation.accepted[0] > 0  # some tokens came from accepted drafts
    assert quiet.token_logprobs == []
    ref = SpeculativeScheduler(engine, K, max_prefill_tokens=8)
    without = [ref.submit(Request(prompt_ids[i], _params(i), 20, ignore_eos=True)) for i in range(3)]
    ref.run_until_idle()
    for req, plain in zip(reqs, without):
        assert req.token_ids == plain.token_ids and len(req.token_logprobs) == len(req.token_ids) == 20
        for t, (lp, top), want in zip(req.token_ids, req.token_logprobs, _teacher_forced_logprobs(engine, req)):
            assert abs(lp - float(want[t])) < 1e-4
            assert len(top) == req.logprobs
            if top:
                vals, ids = want.topk(req.logprobs)
                assert [i for i, _ in top] == ids.tolist()
                assert max(abs(a - b) for (_, a), b in zip(top, vals.tolist())) < 1e-4
                if req.params.temperature <= 0:
                    assert top[0][0] == t


def test_refusals(engine):
    s = SpeculativeScheduler(engine, K, modes=("greedy",))
    with pytest.raises(ValueError, match="prepared for .'greedy',. only"):
        s.submit(Request([0, 5, 6], SamplingParams(temperature=0.5), 4))
    with pytest.raises(ValueError, match="modes must be"):
        SpeculativeScheduler(engine, K, modes=("beam",))
    with pytest.raises(ValueError, match="spare_window_slots"):
        SpeculativeScheduler(engine, K + 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_graphs_give_the_eager_tokens():
    """On CUDA: the compiled + captured speculative step (buckets 1, 2; greedy) inside the scheduler, requests
    staggered over 2 rows, gives the eager speculative scheduler's tokens and the plain scheduler's."""
    prompts = [[0, 5, 6, 7, 8], [0, 9, 10], [0, 11, 12, 13, 14, 15, 16]]
    want = []
    eager = _engine("cuda", rows=2, seq=256, compile=False, cuda_graphs=False)
    for S in (Scheduler, lambda e, **kw: SpeculativeScheduler(e, K, modes=("greedy",), **kw)):
        s = S(eager, max_prefill_tokens=4)
        want.append([s.submit(Request(p, SamplingParams(), 40, ignore_eos=True)) for p in prompts])
        s.run_until_idle()
    assert [r.token_ids for r in want[0]] == [r.token_ids for r in want[1]]
    del eager
    graphs = _engine("cuda", rows=2, seq=256, compile=True, cuda_graphs=True)
    s = SpeculativeScheduler(graphs, K, modes=("greedy",), max_prefill_tokens=4)
    got = [s.submit(Request(p, SamplingParams(), 40, ignore_eos=True)) for p in prompts]
    s.run_until_idle()
    assert [r.token_ids for r in got] == [r.token_ids for r in want[1]]
    assert s.speculation.tokens_per_step > 1.0


def test_served_with_speculation(engine, prompt_ids):
    """`serve --speculate K`'s scheduler behind the server, through the official openai client: concurrent
    greedy completions (streamed and not) give the plain scheduler's text, logprobs its log-probabilities;
    /metrics carries the acceptance counts the scheduler holds."""
    import concurrent.futures
    import urllib.request

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from dsv4_model.serve.app import ServeConfig, create_app
    from tests.test_serve_api import ServerThread

    tok = engine.get_tokenizer()
    want = {}
    plain = Scheduler(engine, max_prefill_tokens=16)
    for p in PROMPTS:
        want[p] = plain.submit(Request(tok.encode(p), SamplingParams(), 16, ignore_eos=True))
    with_lp = plain.submit(Request(tok.encode(PROMPTS[0]), SamplingParams(), 16, ignore_eos=True, logprobs=2))
    plain.run_until_idle()
    want_lp = with_lp.token_logprobs
    want = {p: r.text for p, r in want.items()}
    sched = SpeculativeScheduler(engine, K, max_prefill_tokens=16)
    srv = ServerThread(create_app(sched, ServeConfig(model_name="tiny", max_waiting=16, chat_format="plain")))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def one(p, stream):
            kw = dict(model="tiny", prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
            if not stream:
                return client.completions.create(**kw).choices[0].text
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda a: one(*a), [(p, i % 2 == 1) for i, p in enumerate(PROMPTS)]))
        assert got == [want[p] for p in PROMPTS]
        # logprobs: the plain scheduler's (the main model's distribution at each token)
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        assert r.choices[0].text == want[PROMPTS[0]] and len(lp.token_logprobs) == 16
        assert max(abs(a - b[0]) for a, b in zip(lp.token_logprobs, want_lp)) < 1e-4
        assert [len(t) for t in lp.top_logprobs] == [2] * 16
        # /metrics: the speculative counts, as the scheduler holds them
        got = {(s.name, s.labels.get("position")): s.value for f in
               text_string_to_metric_families(urllib.request.urlopen(srv.url + "/metrics").read().decode())
               for s in f.samples if s.name.startswith("dsv4:spec_decode")}
        assert got[("dsv4:spec_decode_num_drafts", None)] > len(PROMPTS)
        assert got[("dsv4:spec_decode_num_draft_tokens", None)] == K * got[("dsv4:spec_decode_num_drafts", None)]
        per_pos = [got[("dsv4:spec_decode_num_accepted_tokens_per_pos", str(j))] for j in range(K)]
        assert sum(per_pos) == got[("dsv4:spec_decode_num_accepted_tokens", None)] > 0
        assert per_pos == sorted(per_pos, reverse=True)  # a later draft is accepted only after the earlier ones
        assert per_pos == sched.speculation.accepted
    finally:
        srv.stop()


def test_serve_cli_checks_speculate():
    from dsv4_model.serve import cli as serve_cli

    with pytest.raises(ValueError, match="--speculate must be an int"):
        serve_cli._check(serve_cli._parser().parse_args(["--speculate", "99"]))
    with pytest.raises(ValueError, match="--dspark-cut: the confidence cut is DSpark's speculation's"):
        serve_cli._check(serve_cli._parser().parse_args(["--dspark-cut", "0.5"]))
    with pytest.raises(ValueError, match=r"--dspark-cut must be a chance in \[0, 1\]"):
        serve_cli._check(serve_cli._parser().parse_args(["--speculate", "2", "--dspark-cut", "-1"]))
    with pytest.raises(ValueError, match="--drafter: the DSpark module drafts for speculative decoding"):
        serve_cli._check(serve_cli._parser().parse_args(["--drafter", "d"]))


def test_plans_run_after_the_wire(engine, prompt_ids, alone, monkeypatch):
    """Under torchrun the other ranks run each plan as decoded from rank 0's int64 wire form: running every plan
    through encode -> decode gives the staggered requests their alone tokens."""
    from dsv4_model.runtime.step_plan import StepPlan

    real = StepPlan.run
    kinds = set()

    def via_wire(plan, eng, runner):
        back = StepPlan.decode(plan.encode())
        kinds.update(k for k in ("mtp_next", "first_hold", "state", "mode") if getattr(back, k) is not None)
        out = real(back, eng, runner)
        plan.prefill_logits = getattr(back, "prefill_logits", None)
        return out

    monkeypatch.setattr(StepPlan, "run", via_wire)
    got = _run(SpeculativeScheduler(engine, K, max_prefill_tokens=8), prompt_ids, 2)
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert kinds == {"mtp_next", "first_hold", "state", "mode"}


def test_prefix_snapshots_under_speculation(engine, prompt_ids):
    """Speculative rows continue from a copy of a prefix snapshot (the MTP block's caches copied with the main
    model's): later prompts sharing the prefix prefill only their own tokens and get a cold run's tokens, greedy
    and sampled (the drafts, which decide the sampled tokens' draws, equal too)."""
    tok = engine.get_tokenizer()
    system = tok.encode((DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text())[:70]
    prompts = [system + p[1:] for p in prompt_ids[:3]]
    s = SpeculativeScheduler(engine, K, max_prefill_tokens=16, snapshot_min_tokens=16)
    got = []
    for i, p in enumerate(prompts):
        got.append(s.submit(Request(p, _params(i), 20, ignore_eos=True, snapshot_at=(70,))))
        s.run_until_idle()
    # (taken at 69: the MTP block's state at position 69 reads token 70, which the prompts do not share)
    assert s.stats.snapshots == 1 and [r.reused_tokens for r in got] == [0, 69, 69]
    cold = SpeculativeScheduler(engine, K, max_prefill_tokens=16, reuse=False)
    refs = [cold.submit(Request(p, _params(i), 20, ignore_eos=True)) for i, p in enumerate(prompts)]
    cold.run_until_idle()
    assert [r.token_ids for r in got] == [r.token_ids for r in refs]

"""generate(..., speculate=K) and `--speculate K` drafting with the DSpark module of a tiny 0731-layout checkpoint:
the tokens of plain greedy generation (ragged rows, more prompts than rows, every K up to the block size), and the
refusals the CLI gives in one line before any weight is read."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from dsv4_model.checkpoint.writer import canonical_weights, write_checkpoint
from dsv4_model.runtime import cli
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from dsv4_model.runtime.session import RunnerOptions
from tests.test_release_0731 import PROMPT, _dspark_cfg

PROMPTS = [PROMPT, PROMPT[:5], [3, 14, 15, 92, 65, 35, 89, 79]]
N = 90  # several blocks, windows of 4 and 16 closing many times


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = _dspark_cfg()
    return write_checkpoint(canonical_weights(cfg, seed=5), cfg, tmp_path_factory.mktemp("d0731g"), "official")


def _engine(path, **kw):
    return Engine.from_pretrained(path, device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=128,
                                  progress=False, **kw)


@pytest.fixture(scope="module")
def plain(ckpt):
    res = generate(_engine(ckpt, load_dspark=False), PROMPTS, max_new_tokens=N, stop_token_ids=[])
    assert all(len(set(t)) > 5 for t in res.token_ids)  # real continuations
    return res


@pytest.mark.parametrize("k", [1, 3, 5])
def test_dspark_speculation_gives_plain_greedy_tokens(ckpt, plain, k):
    eng = _engine(ckpt, spare_window_slots=k)
    res = generate(eng, PROMPTS, max_new_tokens=N, speculate=k)  # auto: the checkpoint carries DSpark
    assert res.token_ids == plain.token_ids
    assert res.finish_reasons == plain.finish_reasons
    spec = res.extra["speculation"]
    assert spec.k == k and spec.steps < 3 * N  # three prompts, 2 rows: two batches of steps
    # the rows' lengths: every position the steps committed (the last step's may pass the tokens kept)
    for n, p, t in zip(eng.lengths, PROMPTS[2:], res.token_ids[2:]):
        assert len(p) + len(t) - 1 <= n <= len(p) + len(t) - 1 + k


def test_compiled_dspark_step_gives_the_eager_tokens(ckpt, plain):
    """The DSpark step compiled whole (fullgraph, static shapes: what is captured on CUDA) on the CPU."""
    eng = _engine(ckpt, spare_window_slots=2, runner_options=RunnerOptions(compile=True))
    res = generate(eng, PROMPTS[:2], max_new_tokens=40, speculate=2)
    assert res.token_ids == [t[:40] for t in plain.token_ids[:2]]
    assert res.mode.startswith("compiled") and "DSpark speculate 2" in res.mode


def test_dspark_sampling_follows_the_plain_distribution(tmp_path, top_k=5, top_p=0.8, cut=0.5):
    """3 tokens after one prompt, 2048 draws (seeds) with K = 2 drafts from a random DSpark module over a vocabulary
    of 8 (drafts accepted part of the time: the acceptance, the correction and the bonus draws all act), blocks cut
    by the confidence head part of the time (a cut decided from the drafts before each offered one: the bonus
    drawn where the block was cut): chi-square against the plain model's exact joint (tests/helpers/chi_square.py;
    the uncut rule alone: the MTP test's)."""
    from tests.helpers.chi_square import assert_follows, exact_joint3

    cfg = _dspark_cfg(vocab_size=8, noise_token_id=7, eos_token_id=10_000)  # no row stops early
    path = write_checkpoint(canonical_weights(cfg, seed=2), cfg, tmp_path / "v8", "official")
    T, rows, draws = 1.5, 64, 2048
    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, max_batch_size=rows, max_seq_len=64,
                                 progress=False, spare_window_slots=2)
    prompt = [1, 6, 3, 0, 5, 2, 4]
    seen: dict[tuple, int] = {}
    for s in range(0, draws, rows):
        res = generate(eng, [prompt] * rows, max_new_tokens=3, temperature=T, top_k=top_k, top_p=top_p, seed=s,
                       speculate=2, stop_token_ids=[], dspark_cut=cut)
        for t in res.token_ids:
            seen[tuple(t)] = seen.get(tuple(t), 0) + 1
    spec = res.extra["speculation"]
    acc = spec.acceptance()[0]
    assert_follows(seen, exact_joint3(eng.model, prompt, T, top_k, top_p))
    assert 0.05 < acc < 0.95, acc
    assert 0 < spec.offered[0] < spec.row_steps, (spec.offered, spec.row_steps)  # some blocks cut at once


def test_a_dspark_config_without_its_tensors_is_named_by_the_flag(tmp_path):
    """--speculate on a checkpoint whose config describes DSpark but whose shards lack its mtp.* tensors: one line
    naming --speculate, from the config and the headers (no weight read)."""
    cfg = _dspark_cfg()
    weights = {k: v for k, v in canonical_weights(cfg, seed=5).items() if not k.startswith("mtp.")}
    path = write_checkpoint(weights, cfg, tmp_path / "no_dspark", "official")
    rc, out, err = _cli("--model", str(path), "--prompt", "hi", "--speculate", "2")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: --speculate: ") and "no mtp.*" in err, err


def test_dspark_refusals(ckpt):
    eng = _engine(ckpt, spare_window_slots=2)
    with pytest.raises(ValueError, match="carries a DSpark module instead"):
        generate(eng, [PROMPT], max_new_tokens=4, speculate=2, speculate_method="mtp")
    with pytest.raises(ValueError, match="speculate_method must be one of"):
        generate(eng, [PROMPT], max_new_tokens=4, speculate=2, speculate_method="eagle")
    with pytest.raises(ValueError, match="spare_window_slots >= 3"):
        generate(eng, [PROMPT], max_new_tokens=4, speculate=3)
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler

    with pytest.raises(ValueError, match="prompt_logprobs: not with DSpark"):
        SpeculativeScheduler(eng, 2, method="dspark", modes=("greedy",)).submit(Request(PROMPT, prompt_logprobs=1))


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["generate", "--device", "cpu", "--threads", "1", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cli_speculate_picks_dspark_and_matches_plain(ckpt):
    args = ["--model", str(ckpt), "--prompt", "abc", "--max-new-tokens", "40", "--dtype", "float32", "--json"]
    rc, out, err = _cli(*args)
    assert rc == 0, err
    assert "DSpark speculative module (3 stages" in err and "not loaded" in err  # not held without --speculate
    rc2, out2, err2 = _cli(*args, "--speculate", "3")
    assert rc2 == 0, err2
    assert json.loads(out2)["ids"] == json.loads(out)["ids"]
    assert "DSpark speculate 3" in err2 and "speculation:" in err2 and "not loaded" not in err2
    rc3, out3, err3 = _cli(*args, "--speculate", "3", "--dspark-cut", "0.9")
    assert rc3 == 0 and json.loads(out3)["ids"] == json.loads(out)["ids"], err3
    assert "DSpark speculate 3, cut 0.9" in err3


@pytest.mark.parametrize("extra, msg", [
    (["--speculate", "6"], "DSpark drafts blocks of 5 tokens"),
    (["--dspark-cut", "0.5"], "the confidence cut is DSpark's: it needs --speculate K"),
    (["--speculate", "2", "--dspark-cut", "2"], "--dspark-cut must be a chance in [0, 1]"),
    (["--speculate", "2", "--speculate-method", "mtp", "--dspark-cut", "0.5"], "the confidence cut is DSpark's"),
    (["--speculate", "2", "--speculate-method", "mtp"], "carries a DSpark module (mtp.* tensors, dspark_* config keys), "
                                                         "not an MTP block"),
])
def test_cli_dspark_refusals_are_one_line(ckpt, extra, msg):
    rc, out, err = _cli("--model", str(ckpt), "--prompt", "abc", "--max-new-tokens", "4", *extra)
    assert rc == 2 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0] and "Traceback" not in err, err


def test_cli_dspark_on_a_checkpoint_without_it_is_one_line():
    rc, out, err = _cli("--prompt", "abc", "--max-new-tokens", "4", "--speculate", "1", "--speculate-method",
                        "dspark")
    assert rc == 2 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[dsv4]")]  # the model note
    assert len(lines) == 1 and "carries no DSpark module" in lines[-1], err


def test_dspark_steps_inside_the_scheduler(ckpt, plain):
    """Requests joining a running batch one iteration apart, prompts prefilled 4 tokens per iteration (their chunks
    committed to the DSpark rings while other rows step, riding rows accepting nothing): each gets plain greedy's
    tokens, and the one asking for logprobs the plain scheduler's."""
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.sampling import SamplingParams
    from dsv4_model.runtime.scheduler import Scheduler
    from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler

    s = SpeculativeScheduler(_engine(ckpt, spare_window_slots=3), 3, method="dspark", max_prefill_tokens=4)
    reqs = []
    for i, p in enumerate(PROMPTS):
        reqs.append(s.submit(Request(p, SamplingParams(), N, logprobs=2 if i == 0 else None)))
        s.step()
    s.run_until_idle()
    assert [r.token_ids for r in reqs] == plain.token_ids
    assert s.speculation.tokens_per_step > 1.0 and s.stats.prefill_chunks > 4
    ref = Scheduler(_engine(ckpt, load_dspark=False), max_prefill_tokens=4)
    want = ref.submit(Request(PROMPTS[0], SamplingParams(), N, logprobs=2))
    ref.run_until_idle()
    got = reqs[0].token_logprobs
    assert len(got) == len(want.token_logprobs) == len(reqs[0].token_ids)
    for (lp, top), (wlp, wtop) in zip(got, want.token_logprobs):
        assert abs(lp - wlp) < 1e-4 and [i for i, _ in top] == [i for i, _ in wtop]


def test_each_pass_reads_back_the_confidence_of_the_drafts_it_verified(ckpt):
    """The scheduler's passes read back, with their tokens, the confidence head's predicted chance of acceptance of
    each draft they verified (thousandths): the oracle loop's (tests/helpers/dspark_greedy.py takes each block's
    confidence from DSpark.draft) pass for pass; SpeculationStats sets their mean per position against the measured
    acceptance, and cut() replays the passes with the block cut at its first draft predicted below a threshold."""
    from dsv4_model.checkpoint.loader import load_model
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler
    from tests.helpers.dspark_greedy import dspark_greedy

    K, n = 5, 60
    sched = SpeculativeScheduler(_engine(ckpt, spare_window_slots=K), K, method="dspark", modes=("greedy",))
    sched.speculation.judged = []
    req = sched.submit(Request(PROMPT, max_tokens=n, ignore_eos=True))
    sched.run_until_idle()
    model = load_model(ckpt, dtype=torch.float32, max_seq_len=128, progress=False, spare_window_slots=K)[0]
    toks, ref = dspark_greedy(model, torch.tensor([PROMPT]), n)
    assert req.token_ids == toks[0]

    spec = sched.speculation
    got = spec.judged
    assert len(ref.judged) >= len(got) == spec.row_steps >= n // (K + 1)
    for (n_got, c_got), (n_ref, c_ref) in zip(got, ref.judged, strict=False):
        # the same values up to fp32 summation order (the engine's batch of two rows): a thousandth at a rounding edge
        assert n_got == n_ref and max(abs(a - b) for a, b in zip(c_got, c_ref)) <= 1
    assert len({c for _, cs in got for c in cs}) > 5  # predictions that vary, each in [0, 1000]
    assert all(0 <= c <= 1000 for _, cs in got for c in cs)
    offered0 = [cs[0] for _, cs in got]  # every pass offers its first draft
    assert spec.predicted_acceptance()[0] == pytest.approx(sum(offered0) / 1000 / len(got))
    assert spec.cut(0.0) == (pytest.approx(spec.tokens_per_step), K)  # nothing cut
    assert spec.cut(1.001) == (1.0, 0.0)  # everything cut: the verification's own token only
    mid = sorted(offered0)[len(offered0) // 2] / 1000  # about half the blocks cut at their first draft
    tokens, verified = spec.cut(mid + 0.0005)
    assert 1.0 <= tokens <= spec.tokens_per_step and 0 < verified < K


def test_the_confidence_cut_keeps_plain_greedy_tokens_and_offers_only_the_kept_drafts(ckpt, plain, cut=0.9):
    """dspark_cut: each row's block cut before its first draft predicted below the cut, on the device (the passes
    read back -1 for the drafts left out, and the predictions of the others are >= the cut); greedy output is
    still plain greedy's, and a pass accepts no draft past its cut."""
    eng = _engine(ckpt, spare_window_slots=5)
    res = generate(eng, PROMPTS[:2], max_new_tokens=12, speculate=5, dspark_cut=cut)
    assert res.token_ids == [t[:12] for t in plain.token_ids[:2]] and f"cut {cut:g}" in res.mode
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler

    s = SpeculativeScheduler(eng, 5, method="dspark", modes=("greedy",), dspark_cut=cut)
    s.speculation.judged = []
    req = s.submit(Request(PROMPT, max_tokens=N, ignore_eos=True))
    s.run_until_idle()
    assert req.token_ids == plain.token_ids[0]
    cuts = 0
    for n, c in s.speculation.judged:
        kept = next((j for j, v in enumerate(c) if v < 0), len(c))
        assert n <= kept and all(v < 0 for v in c[kept:]) and all(v >= 1000 * cut - 1 for v in c[:kept])
        cuts += kept < len(c)
    assert cuts > 0


def test_the_confidence_cut_is_refused_without_dspark(ckpt):
    eng = _engine(ckpt, spare_window_slots=2)
    with pytest.raises(ValueError, match="confidence cut is DSpark's, and this run does not speculate"):
        generate(eng, [PROMPT], max_new_tokens=4, dspark_cut=0.5)
    with pytest.raises(ValueError, match="cut must be a predicted chance in"):
        generate(eng, [PROMPT], max_new_tokens=4, speculate=2, dspark_cut=1.5)


def test_prefix_snapshots_with_dspark(ckpt):
    """DSpark speculation continuing from a prefix snapshot (its rings copied with the caches; taken at the prefix's
    end: a ring entry holds its own position's streams): prompts sharing the prefix get a cold run's tokens, greedy
    and sampled (the drafts, which decide the sampled tokens' draws, equal too)."""
    from dsv4_model.runtime.requests import Request
    from dsv4_model.runtime.sampling import SamplingParams
    from dsv4_model.runtime.speculative_scheduler import SpeculativeScheduler

    shared = (PROMPT * 3)[:24]
    prompts = [shared + [3, 14, 15], shared + [92, 65], shared + [35, 89, 79, 3]]
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=12, seed=4), SamplingParams(temperature=0.7,
                                                                                                   seed=5)]
    eng = _engine(ckpt, spare_window_slots=2)
    s = SpeculativeScheduler(eng, 2, method="dspark", max_prefill_tokens=5, snapshot_min_tokens=8)
    got = []
    for p, sp in zip(prompts, params):
        got.append(s.submit(Request(p, sp, 30, ignore_eos=True, snapshot_at=(len(shared),))))
        s.run_until_idle()
    assert s.stats.snapshots == 1 and [r.reused_tokens for r in got] == [0, len(shared), len(shared)]
    cold = SpeculativeScheduler(eng, 2, method="dspark", max_prefill_tokens=5, reuse=False)
    refs = []
    for p, sp in zip(prompts, params):
        refs.append(cold.submit(Request(p, sp, 30, ignore_eos=True)))
        cold.run_until_idle()
    assert [r.token_ids for r in got] == [r.token_ids for r in refs]

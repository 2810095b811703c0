"""The CLI on the scheduler: --n completions per prompt, --stop strings, --max-batch-size rows with more completions
flowing through them; each completion equals what the Python API gives it alone."""
import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.builtin import DEFAULT_MODEL_DIR
from dsv4_model.runtime import cli
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["generate", "--device", "cpu", "--threads", "1", *argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.bfloat16, max_batch_size=1,
                                  max_seq_len=256, quant="none", progress=False)


def test_n_samples_through_fewer_rows(engine):
    prompts = ["def f(x):", "import os"]
    rc, out, err = _run("--prompt", prompts[0], "--prompt", prompts[1], "--n", "3", "--max-batch-size", "2",
                        "--json", "--temperature", "0.9", "--seed", "7", "--max-new-tokens", "12")
    assert rc == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    assert [(r["index"], r["sample"]) for r in recs] == [(i, j) for i in range(2) for j in range(3)]
    assert "at batch 2" in err
    for k, r in enumerate(recs):  # completion k samples with seed 7 + k, as it would alone
        alone = generate(engine, [prompts[r["index"]]], max_new_tokens=12, temperature=0.9, seed=7 + k)
        assert r["ids"] == alone.token_ids[0] and r["text"] == alone.texts[0], k
    assert len({tuple(r["ids"]) for r in recs[:3]}) > 1  # the samples of one prompt differ


def test_stop_string_ends_the_streamed_text(engine):
    full = generate(engine, ["def fibonacci(n):"], max_new_tokens=40).texts[0]
    word = full[len(full) // 2: len(full) // 2 + 4]
    assert word.strip()
    rc, out, err = _run("--prompt", "def fibonacci(n):", "--stop", word, "--max-new-tokens", "40")
    assert rc == 0, err
    assert out == "def fibonacci(n):" + full[: full.index(word)] + "\n"


@pytest.mark.parametrize("argv, msg", [
    (["--n", "0"], "--n must be an int >= 1"),
    (["--max-batch-size", "0"], "--max-batch-size must be an int >= 1"),
    (["--stop", ""], "--stop: a stop string must not be empty"),
])
def test_bad_values(argv, msg):
    rc, out, err = _run("--prompt", "x", *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1 and msg in err, err

"""What a newcomer reaches for in `python -m dsv4_model generate` (built-in tiny model, eager, a few tokens): prompts
from stdin and files, --json, --version, run.sh's --prompt, the seed's whole 64-bit range, the speculation line
without nan, and the rules behind --regional-compile and the default thread count."""
import json
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, stdin=b"", env=None, cmd=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run(cmd or [sys.executable, "-m", "dsv4_model", "generate", *args], cwd=ROOT, env=env,
                          input=stdin, capture_output=True, timeout=300)


def _objects(r) -> list[dict]:
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return [json.loads(line) for line in r.stdout.decode().splitlines()]  # every stdout line is one object


def test_prompts_from_stdin_files_and_text_in_order_as_json(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"def g(y):\n")  # the editor's final newline is dropped
    r = _cli("--prompt-file", str(f), "--prompt", "-", "--prompt", "x = 1", "--max-new-tokens", "3", "--json",
             "--no-compile", stdin=b"import os")
    objs = _objects(r)
    assert [o["prompt"] for o in objs] == ["def g(y):", "import os", "x = 1"]
    for o in objs:
        assert set(o) == {"prompt", "index", "sample", "prompt_ids", "ids", "text", "finish_reason", "timings"}
        assert len(o["ids"]) == 3 and o["finish_reason"] == "length" and isinstance(o["text"], str)
        assert o["timings"]["decode_s"] >= 0 and o["timings"]["load_s"] > 0


def test_seed_takes_both_ends_of_int64_and_uint64_as_one_64_bit_key():
    """2**64 - 1 is the key -1; its second row's seed (2**64) wraps to 0, as -1 + 1 does."""
    args = ["--prompt", "def f(x):", "--prompt", "def f(x):", "--max-new-tokens", "6", "--temperature", "1.5",
            "--json", "--no-compile"]
    top = _objects(_cli(*args, "--seed", str(2**64 - 1)))
    minus1 = _objects(_cli(*args, "--seed", "-1"))
    assert [o["ids"] for o in top] == [o["ids"] for o in minus1]
    assert top[0]["ids"] != top[1]["ids"]  # the rows do draw with different keys
    assert len(_objects(_cli(*args, "--seed", str(-2**63)))) == 2


def test_version_is_the_package_version():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        want = tomllib.load(f)["project"]["version"]
    for module in ("dsv4_model", "dsv4_export"):
        r = _cli(cmd=[sys.executable, "-m", module, "--version"])
        assert r.returncode == 0 and r.stdout.decode() == f"dsv4 {want}\n"


def test_run_sh_prompt_replaces_the_default():
    run = ["bash", os.path.join(ROOT, "scripts", "run.sh")]
    r = _cli(cmd=[*run, "--prompt", "abc", "--max-new-tokens", "2", "--json", "--no-compile"],
             env={"DSV4_SKIP_SETUP": "1", "PYTHON": sys.executable})
    assert [o["prompt"] for o in _objects(r)] == ["abc"]
    r = _cli(cmd=[*run, "--prompt-f", "/dev/stdin", "--max-new-tokens", "2", "--json", "--no-compile"],
             env={"DSV4_SKIP_SETUP": "1", "PYTHON": sys.executable}, stdin=b"xyz")  # argparse's abbreviation
    assert [o["prompt"] for o in _objects(r)] == ["xyz"]
    r = _cli(cmd=[*run, "--max-new-tokens", "2", "--json", "--no-compile"],
             env={"DSV4_SKIP_SETUP": "1", "PYTHON": sys.executable})
    assert [o["prompt"] for o in _objects(r)] == ["def fibonacci(n):"]


def test_speculation_line_has_no_nan():
    """K = 4 over 2 tokens: the later draft positions are never reached; they show "-"."""
    r = _cli("--prompt", "def f(x):", "--max-new-tokens", "2", "--speculate", "4", "--no-compile")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    line = next(ln for ln in err.splitlines() if "drafts accepted per position" in ln)
    rates = line.split("per position ")[1].split(" / ")
    assert len(rates) == 4 and "-" in rates and "nan" not in err


def test_speculate_with_stop_strings_and_more_prompts_than_rows():
    """--speculate runs inside the scheduler: stop strings cut the text, 3 prompts flow through 2 rows, and the
    greedy texts are the plain run's."""
    args = ["--prompt", "def f(x):", "--prompt", "class Stack:", "--prompt", "x = 1", "--max-new-tokens", "12",
            "--max-batch-size", "2", "--json", "--no-compile", "--stop", "\n\n"]
    plain, spec = _objects(_cli(*args)), _objects(_cli(*args, "--speculate", "2"))
    assert [o["text"] for o in spec] == [o["text"] for o in plain]
    assert all("\n\n" not in o["text"] for o in spec)


def test_speculate_help_states_the_checked_bound():
    from dsv4_model.model.checks import MAX_SPECULATE
    from dsv4_model.runtime import cli

    assert f"at most {MAX_SPECULATE}" in " ".join(cli._parser()._subparsers._group_actions[0].choices["generate"]
                                                   .format_help().split())


def test_regional_compile_implies_compile(monkeypatch):
    from dsv4_model.runtime import cli

    seen = {}

    class Stop(Exception):
        pass

    def fake(*a, runner_options, **k):
        seen["opts"] = runner_options
        raise Stop

    monkeypatch.setattr("dsv4_model.runtime.engine.Engine.from_pretrained", staticmethod(fake))
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # this process's threads are pytest's
    with pytest.raises(Stop):
        cli.cmd_generate(cli._parser().parse_args(["generate", "--prompt", "x", "--regional-compile",
                                                   "--device", "cpu"]))
    assert seen["opts"].compile is True and seen["opts"].regional is True


def test_default_threads_leave_the_loaded_cores(monkeypatch):
    from dsv4_model.runtime import cli

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for load, want in ((0.2, 8), (2.6, 5), (30.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert cli.default_threads() == want
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks on this host share the cores
    assert cli.default_threads() == 2


def test_prompt_from_a_closed_stdin_is_one_line():
    r = subprocess.run([sys.executable, "-m", "dsv4_model", "generate", "--prompt", "-", "--device", "cpu"], cwd=ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=300,
                       preexec_fn=lambda: os.close(0))  # no fd 0 at all: sys.stdin is None
    assert r.returncode == 2, r.stderr
    assert r.stderr.decode().strip().splitlines()[-1] == "error: --prompt - (stdin): this process has no stdin (it was closed)"


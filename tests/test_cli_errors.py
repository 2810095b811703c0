"""Bad inputs to the CLI: one line on stderr naming the file / tensor / field / argument, exit code 2, nothing on
stdout, no traceback, before any weight is read (docs/errors.md has the same table). And the two ways a run may end
early without being an error: cut short by max_seq_len (said on stderr, finish reason "max_seq_len") and a reader
that goes away (`| head`)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, module="dsv4_model", stdin=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          timeout=timeout, stdin=stdin)


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_models")

    def copy(name, edit=None):
        d = root / name
        shutil.copytree(DEFAULT_MODEL_DIR, d)
        if edit:
            edit(d)
        return str(d)

    def truncate(d, cut):
        f = d / "model-00002-of-00002.safetensors"
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - cut)

    def config(d, change):
        p = d / "config.json"
        cfg = json.loads(p.read_text())
        p.write_text(json.dumps(change(cfg)))

    return {
        "short1": copy("short1", lambda d: truncate(d, 1)),
        "cut4mb": copy("cut4mb", lambda d: truncate(d, os.path.getsize(d / "model-00002-of-00002.safetensors")
                                                 - 4 * 2**20)),
        "list": copy("list", lambda d: (d / "config.json").write_text("[1, 2]")),
        "no_window": copy("no_window", lambda d: config(d, lambda c: {k: v for k, v in c.items()
                                                                     if k != "window_size"})),
        "no_dim": copy("no_dim", lambda d: config(d, lambda c: {k: v for k, v in c.items() if k != "dim"})),
        "bad_json": copy("bad_json", lambda d: (d / "config.json").write_text("{\"dim\": ")),
    }


CASES = [
    # (id, args, what stderr's one line must contain)
    ("truncated shard, 1 byte short", ["--model", "{short1}"], "model-00002-of-00002.safetensors: truncated"),
    ("truncated shard, cut to 4 MB", ["--model", "{cut4mb}"], "model-00002-of-00002.safetensors: truncated"),
    ("config.json is a JSON list", ["--model", "{list}"], "config.json: a config must be a JSON object"),
    ("config.json is not JSON", ["--model", "{bad_json}"], "config.json: cannot read config"),
    ("config.json without window_size", ["--model", "{no_window}"], "required field missing: 'window_size'"),
    ("config.json without dim", ["--model", "{no_dim}"], "required field missing: 'dim'"),
    ("--model that does not exist", ["--model", "/nonexistent/model"], "--model /nonexistent/model: no such"),
    ("--device tpu", ["--device", "tpu"], "device 'tpu' is not a device"),
    ("--device cuda:7 (or no GPU)", ["--device", "cuda:7"], "device 'cuda:7'"),
    ("--max-new-tokens 0", ["--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1"),
    ("--max-new-tokens -3", ["--max-new-tokens", "-3"], "--max-new-tokens must be an int >= 1"),
    ("--max-new-tokens abc", ["--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value"),
    ("--max-seq-len 0", ["--max-seq-len", "0"], "--max-seq-len must be an int >= 1"),
    ("--max-seq-len 8 (below the largest compress ratio)", ["--max-seq-len", "8"],
     "--max-seq-len must be an int >= 16"),
    ("--max-seq-len 100000 (past max_position_embeddings)", ["--max-seq-len", "100000"],
     "--max-seq-len=100000 exceeds the model's max_position_embeddings=4096"),
    ("--max-seq-len shorter than the prompt", ["--max-seq-len", "16", "--prompt", "x" * 200],
     "does not fit --max-seq-len (16 positions)"),
    ("a prompt longer than max_position_embeddings", ["--prompt", "x " * 6000],
     "does not fit the model's max_position_embeddings (4096 positions)"),
    ("--threads 0", ["--threads", "0"], "--threads must be an int >= 1"),
    ("--prefill-chunk 0", ["--prefill-chunk", "0"], "--prefill-chunk must be an int >= 1"),
    ("--temperature -1", ["--temperature", "-1"], "--temperature must be >= 0"),
    ("--top-p 0", ["--top-p", "0"], "--top-p must be in (0, 1]"),
    ("--top-k -1", ["--top-k", "-1"], "--top-k must be >= 0"),
    ("--quant fp8", ["--quant", "fp8"], "argument --quant: invalid choice"),
    ("no --prompt", None, "no prompt: give --prompt TEXT, --prompt - (stdin) or --prompt-file PATH"),
]


# Refused before any weight is read, so they run in this process (a subprocess each would cost seconds of
# imports): main() is what `python -m dsv4_model` runs.
IN_PROCESS = [
    ("--temperature inf", ["--temperature", "inf"], "--temperature must be >= 0 and finite (at most 3.403e+38: float32), got inf"),
    ("--temperature nan", ["--temperature", "nan"], "--temperature must be >= 0 and finite (at most 3.403e+38: float32), got nan"),
    ("--temperature past float32", ["--temperature", "1e39"], "--temperature must be >= 0 and finite (at most 3.403e+38"),
    ("--max-seq-len past int32 with --allow-beyond-max-position",
     ["--max-seq-len", str(10**30), "--allow-beyond-max-position"], "--max-seq-len must be at most 2147483647"),
    ("--top-k past int64", ["--top-k", str(10**20)], "--top-k must be >= 0 (0 = off), an int of at most 2**63 - 1"),
    ("--seed 2**64 (past uint64)", ["--seed", str(2**64)], "--seed must be an int in [-2**63, 2**64 - 1]"),
    ("--seed -2**63 - 1 (past int64)", ["--seed", str(-2**63 - 1)], "--seed must be an int in [-2**63, 2**64 - 1]"),
    ("--speculate 100", ["--speculate", "100"], "--speculate must be an int >= 0 (0 = off) and at most 8"),
    ("--speculate -1", ["--speculate", "-1"], "--speculate must be an int >= 0"),
    ("--threads past the usable cores", ["--threads", str(len(os.sched_getaffinity(0)) + 1)],
     f"this process may use {len(os.sched_getaffinity(0))} cores"),
    ("--graph-mode on the CPU", ["--graph-mode", "manual", "--device", "cpu"], "there are none on cpu"),
    ("--cuda-graphs on the CPU", ["--cuda-graphs", "--device", "cpu"], "CUDA graphs need a CUDA device"),
    ("--graph-mode with --no-cuda-graphs", ["--graph-mode", "manual", "--no-cuda-graphs"],
     "it contradicts --no-cuda-graphs"),
    ("--regional-compile --no-compile", ["--regional-compile", "--no-compile"], "it contradicts --no-compile"),
    ("--regional-compile --speculate 1", ["--regional-compile", "--speculate", "1"],
     "speculative steps compile whole"),
    ("--max-seq-len past host memory", ["--max-seq-len", "99999999", "--allow-beyond-max-position", "--device", "cpu"],
     "free (available host memory): lower --max-seq-len"),
    ("--prompt-file that does not exist", ["--prompt-file", "/nonexistent/p.txt"],
     "--prompt-file /nonexistent/p.txt: cannot read"),
    ("--prompt - twice", ["--prompt", "-", "--prompt", "-"], "stdin holds one prompt"),
    ("--model '' (an unset variable)", ["--model", ""], "--model: empty"),
    ("--speculate-method without --speculate", ["--speculate-method", "dspark"], "it needs --speculate K"),
    ("--act-quant nvfp4 --quant none", ["--act-quant", "nvfp4", "--quant", "none"], "it contradicts --quant none"),
    ("a too-long --prompt-file is named", ["--prompt-file", os.path.join(ROOT, "README.md"), "--max-seq-len", "64"],
     "README.md of "),
]


@pytest.fixture(scope="module")
def no_mtp_model(tmp_path_factory):
    """A tiny checkpoint in the HF layout: transformers' names have no MTP module, so it carries none."""
    from dsv4_model.checkpoint.writer import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("no_mtp")
    write_tiny_checkpoint(d, "hf")
    return str(d)


@pytest.mark.parametrize("serve", [False, True], ids=["generate", "serve"])
def test_speculate_without_an_mtp_block_is_refused_before_loading(no_mtp_model, serve, capfd, monkeypatch):
    """--speculate with the MTP drafter on a checkpoint without an MTP block: decided from its config and tensor
    names, not after the load (minutes on a real checkpoint)."""
    from dsv4_model.runtime.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model before the error"))
    if serve:
        from dsv4_model.serve.cli import main

        rc = main(["--model", no_mtp_model, "--speculate", "2"])
    else:
        from dsv4_model.runtime.cli import main

        rc = main(["generate", "--model", no_mtp_model, "--speculate", "2", "--prompt", "hi"])
    out, err = capfd.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --speculate: ") and "has no MTP block to draft with" in err, err


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c[0] for c in IN_PROCESS])
def test_bad_option_is_one_line_and_exit_2(case, capfd):
    from dsv4_model.runtime.cli import main

    _, args, want = case
    argv = ["generate", *args] + ([] if "--prompt" in args or "--prompt-file" in args else ["--prompt", "def f(x):"])
    rc = main(argv)
    out, err = capfd.readouterr()
    lines = [ln for ln in err.splitlines() if not ln.startswith("[dsv4] ")]
    assert rc == 2, err
    assert out == "" and "Traceback" not in err and "loading " not in err
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, bad_models):
    _, args, want = case
    if args is None:
        argv = ["generate"]
    else:
        argv = ["generate"] + [a.format(**bad_models) for a in args]
        if "--prompt" not in args:
            argv += ["--prompt", "def f(x):"]
    r = _cli(*argv)
    err = r.stderr.decode()
    lines = [ln for ln in err.splitlines() if not ln.startswith("[dsv4] ") and "tensor/s]" not in ln]
    assert r.returncode == 2, err
    assert "Traceback" not in err
    assert r.stdout == b""  # nothing written: not even the prompt
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], err
    assert "loading " not in err  # failed before any weight was read


def test_debug_shows_the_traceback():
    r = _cli("generate", "--prompt", "x", "--device", "tpu", "--debug")
    assert r.returncode != 0 and b"Traceback" in r.stderr


def test_non_utf8_prompt_is_decoded_with_replacement_and_said():
    r = _cli("generate", "--prompt", os.fsdecode(b"\xff\xfe\xc3("), "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().startswith("\ufffd\ufffd\ufffd(")
    assert b"not valid UTF-8" in r.stderr and b"Traceback" not in r.stderr


def test_cut_short_at_max_position_embeddings_hints_what_works(tmp_path):
    """At max_seq_len = max_position_embeddings a larger --max-seq-len alone is refused: the hint says so."""
    d = tmp_path / "short_positions"
    shutil.copytree(DEFAULT_MODEL_DIR, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=32)))
    r = _cli("generate", "--model", str(d), "--prompt", "def f(x):", "--max-new-tokens", "200")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "cut short after" in err and "max_seq_len=32" in err and "--allow-beyond-max-position" in err
    assert "raise --max-seq-len" not in err


def test_a_completion_cut_short_by_max_seq_len_says_so():
    r = _cli("generate", "--prompt", "def f(x):", "--max-seq-len", "32", "--max-new-tokens", "200")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "cut short after" in err and "of 200 tokens" in err and "max_seq_len=32" in err
    assert "(raise --max-seq-len)" in err  # 32 < max_position_embeddings: a larger one works
    assert r.stdout.decode().endswith("\n")


def test_a_reader_that_goes_away_ends_quietly():
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "dsv4_model", "generate", "--prompt", "def f(x):",
                          "--max-new-tokens", "100"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.read(12)
    p.stdout.close()  # what `| head -c 12` does
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_an_allocation_failure_is_one_line(capfd):
    """What the memory check did not foresee still ends as one line; other RuntimeErrors keep their traceback."""
    import types

    from dsv4_model.runtime.cli import run_cli

    def oom(args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes.\n"
                           "More text ATen adds")

    assert run_cli(oom, types.SimpleNamespace(debug=False)) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory: DefaultCPUAllocator: can't allocate")
    with pytest.raises(RuntimeError, match="not memory"):
        run_cli(lambda a: (_ for _ in ()).throw(RuntimeError("not memory")), types.SimpleNamespace(debug=False))


SERVE_CASES = [
    ("serve: a bad value", ["--port", "abc"], "argument --port: invalid int value"),
    ("serve: an unknown flag", ["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("serve: --max-batch-size 0", ["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    ("serve: --threads -1", ["--threads", "-1"], "--threads must be >= 1, got -1"),
    ("serve: --max-prefill-tokens 0", ["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1, got 0"),
    ("serve: --chat-format deepseek_v4 without its tokens", ["--chat-format", "deepseek_v4"],
     "--chat-format deepseek_v4: the tokenizer has no DeepSeek-V4 chat tokens"),
    ("serve: --dspark-cut without a DSpark module", ["--speculate", "1", "--dspark-cut", "0.5"],
     "--dspark-cut: the confidence cut is DSpark's"),
    ("serve: --act-quant nvfp4 --quant none", ["--act-quant", "nvfp4", "--quant", "none"],
     "it contradicts --quant none"),
    ("serve: --model ''", ["--model", ""], "--model: empty"),
    ("serve: --served-model-name ''", ["--served-model-name", " "], "--served-model-name: empty"),
    ("serve: --snapshot-min-tokens -1", ["--snapshot-min-tokens", "-1"], "--snapshot-min-tokens must be >= 0, got -1"),
]


@pytest.mark.parametrize("case", SERVE_CASES, ids=[c[0] for c in SERVE_CASES])
def test_serve_bad_option_is_one_line_and_exit_2(case, capfd, monkeypatch):
    """serve's usage errors as generate's: one `error:` line, exit 2 (not argparse's usage block), before any
    weight is read (the built-in model's tokenizer is read for the chat format's check, its weights never)."""
    from dsv4_model.serve import cli
    from dsv4_model.serve.cli import main

    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("loaded the model before the error"))
    _, args, want = case
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's exit
        rc = e.code
    out, err = capfd.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and want in err, err


def test_serve_without_its_packages_says_so_before_loading(monkeypatch, capfd):
    """A plain `pip install .` leaves out the server's packages: one line naming them and the extra, before any
    weight is read."""
    import importlib.util

    from dsv4_model.serve import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("loaded a model"))
    assert cli.main(["--device", "cpu"]) == 2
    _, err = capfd.readouterr()
    assert err.startswith("error: serve needs uvicorn: pip install 'dsv4[serve]'") and err.count("\n") == 1, err


def test_serve_names_a_repo_id_as_given(tmp_path):
    """The default served model name: a Hugging Face repo id as the user gave it (its snapshot directory is a
    hash), a directory's name otherwise."""
    from dsv4_model.serve.cli import served_name

    snap = tmp_path / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    assert served_name("acme/tiny-v4", str(snap)) == "acme/tiny-v4"
    assert served_name("acme/tiny-v4@main", str(snap)) == "acme/tiny-v4"
    assert served_name(str(snap), str(snap)) == "0123abcd"
    assert served_name(None, "/x/dsv4-default/") == "dsv4-default"


def test_serve_on_a_taken_port_says_so_before_loading(monkeypatch, capfd):
    """A port another process listens on: one error line before the model loads (uvicorn would find it after)."""
    import socket

    from dsv4_model.serve import cli

    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("loaded a model"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--device", "cpu", "--port", str(port)]) == 2
    _, err = capfd.readouterr()
    assert err.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there") and err.count("\n") == 1, err
    for port in (8000, 0):  # --port 0 (any free port) still checks the host
        with pytest.raises(OSError, match="--host no-such-host.invalid"):
            cli.check_port("no-such-host.invalid", port)
    assert cli.main(["--device", "cpu", "--host", "no-such-host.invalid", "--port", "0"]) == 2
    _, err = capfd.readouterr()
    assert err.startswith("error: --host no-such-host.invalid") and err.count("\n") == 1, err
    cli.check_port("127.0.0.1", 0)


def test_serve_default_context_stays_within_max_position_embeddings(tmp_path):
    """serve's default --max-seq-len (4096) is cut to a model trained for fewer positions, as generate's default
    is, rather than refused for a value the user never gave."""
    from dsv4_model.serve.cli import default_max_seq_len

    for f in os.listdir(DEFAULT_MODEL_DIR):
        if f != "config.json":
            os.symlink(os.path.join(DEFAULT_MODEL_DIR, f), tmp_path / f)
    cfg = json.loads(open(os.path.join(DEFAULT_MODEL_DIR, "config.json")).read())
    cfg["max_position_embeddings"] = 1024
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert default_max_seq_len(str(tmp_path), beyond=False) == 1024
    assert default_max_seq_len(str(tmp_path), beyond=True) == 4096
    assert default_max_seq_len(DEFAULT_MODEL_DIR, beyond=False) == 4096

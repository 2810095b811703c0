"""Ctrl-C (SIGINT) in the middle of a run: exit code 130, one line on stderr after what the run had printed, no
traceback; an interrupted `dsv4_export build` leaves nothing under its --out name or beside it."""
import os
import signal
import subprocess
import sys
import threading

from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR
from helpers.signals import default_sigint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(module, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-u", "-m", module, *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_sigint)


def _ctrl_c(p):
    os.killpg(p.pid, signal.SIGINT)  # as a terminal does: to the whole process group


def _stderr_lines(p, marks: list):
    """Collects p's stderr lines in a thread; marks[i] is set when a line containing marks[i][0] arrives."""
    lines = []

    def read():
        for raw in p.stderr:
            lines.append(raw.decode(errors="replace"))
            for text, ev in marks:
                if text in lines[-1]:
                    ev.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return lines, t


def test_ctrl_c_during_generate_is_one_line_and_130():
    p = _start("dsv4_model", "generate", "--prompt", "def f(x):", "--max-new-tokens", "4000", "--no-compile")
    lines, reader = _stderr_lines(p, [])
    first = p.stdout.read(12)  # the prompt and streamed tokens: clearly mid-generation
    _ctrl_c(p)
    rest = p.stdout.read()
    assert p.wait(timeout=120) == 130
    reader.join(timeout=30)
    assert len(first) == 12 and (first + rest).endswith(b"\n")  # the streamed line is ended
    loaded = max(i for i, ln in enumerate(lines) if ln.startswith("[dsv4] loaded"))  # the last line before text
    assert lines[loaded + 1:] == ["interrupted\n"], "".join(lines)


def test_ctrl_c_during_export_build_leaves_no_partial_files(tmp_path):
    out_dir = tmp_path / "pkg"
    started = threading.Event()
    p = _start("dsv4_export", "build", "--model", str(DEFAULT_MODEL_DIR), "--out", str(out_dir / "m.pt2"),
               "--device", "cpu", "--max-seq-len", "64", "--prefill-lengths", "16", "--jobs", "1")
    # by then decode_b1's ExportedProgram has been saved (to the build's scratch folder)
    lines, reader = _stderr_lines(p, [("exporting prefill_b1_s16", started)])
    assert started.wait(timeout=300), "".join(lines)
    _ctrl_c(p)
    assert p.wait(timeout=120) == 130, "".join(lines)
    reader.join(timeout=30)
    assert p.stdout.read() == b""  # progress (the compiler line too) is stderr's
    mark = max(i for i, ln in enumerate(lines) if "exporting prefill_b1_s16" in ln)
    assert lines[mark + 1:] == ["interrupted\n"], "".join(lines)
    assert not out_dir.exists()  # no package, no *.ep.pt2, no scratch folder: not even the folder build made

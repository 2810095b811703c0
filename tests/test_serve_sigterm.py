"""`python -m dsv4_model serve` as a process: it says where it listens, and on SIGTERM it stops admitting, lets the
running request finish (drain) and exits 0."""
import os
import signal
import subprocess
import sys

import httpx
import openai

from helpers.serve_proc import wait_listening
from helpers.signals import default_sigint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigterm_drains_and_exits_0():
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_model", "serve", "--port", "0", "--device", "cpu",
                             "--max-batch-size", "2", "--max-seq-len", "256", "--threads", "1",
                             "--drain-timeout", "20", "--log-level", "warning"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        url, _ = wait_listening(proc, 90, seen)
        assert any(ln.startswith("dsv4 serve: ") and " loaded in " in ln and " on cpu " in ln for ln in seen), seen
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        s = c.completions.create(model="default", prompt="def f(x):", max_tokens=60, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        it = iter(s)
        text = next(it).choices[0].text
        proc.send_signal(signal.SIGTERM)
        chunks = list(it)
        text += "".join(ch.choices[0].text for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"  # the running request finished, not cut
        assert proc.wait(60) == 0
        try:
            httpx.get(url + "/health", timeout=2)
            raise AssertionError("still listening after exit")
        except httpx.ConnectError:
            pass
        assert len(text) > 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_while_it_starts_is_one_line():
    """SIGINT as the model is loaded (the app and its scheduler being built): "interrupted" and 130, no traceback
    (uvicorn, if it got to run, takes SIGINT as a shutdown: 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_model", "serve", "--port", "0", "--device", "cpu",
                             "--max-batch-size", "2", "--max-seq-len", "256", "--threads", "1",
                             "--log-level", "warning"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        for line in proc.stderr:
            if " loaded in " in line:
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert "Traceback" not in rest, rest
    assert proc.returncode in (130, 0), rest
    if proc.returncode == 130:
        assert rest.strip().splitlines()[-1] == "interrupted"



def test_the_bench_servers_exit_0_on_sigterm():
    """bench/bench_serve.py's own servers (the stub here; the preset server runs the same way on the GPU machine,
    where scripts/gpu/serve.sh stops it with SIGTERM): uvicorn's graceful shutdown, then 0, not the re-raised
    signal's 143."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "bench/bench_serve.py", "--stub-server", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the stub server did not listen within 90 s"
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

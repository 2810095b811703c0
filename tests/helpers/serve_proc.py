"""A `python -m dsv4_model serve` process in a test: wait for its listening line, keep its stderr drained."""
import re
import threading
import time

_LINE = re.compile(r"listening on (http://127\.0\.0\.1:\d+) \(pid (\d+)\)")


def wait_listening(proc, timeout_s: float = 120.0) -> tuple[str, int]:
    """(base url, pid of the serving process) from the server's stderr line; then stderr is drained on a thread
    (a full pipe would block the server)."""
    t0 = time.monotonic()
    while True:
        assert time.monotonic() - t0 < timeout_s, "no listening line"
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "server exited"
        m = _LINE.search(line)
        if m:
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return m.group(1), int(m.group(2))

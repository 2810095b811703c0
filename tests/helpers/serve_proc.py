"""A `python -m dsv4_model serve` process in a test: wait for its listening line, keep its stderr drained."""
import re
import threading
import time

_LINE = re.compile(r"listening on (http://127\.0\.0\.1:\d+) \(pid (\d+)\)")


def wait_listening(proc, timeout_s: float = 120.0, seen: list[str] | None = None) -> tuple[str, int]:
    """(base url, pid of the serving process) from the server's stderr line (the lines before it appended to
    `seen`); then stderr is drained on a thread (a full pipe would block the server)."""
    t0 = time.monotonic()
    while True:
        assert time.monotonic() - t0 < timeout_s, "no listening line"
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "server exited"
        if seen is not None:
            seen.append(line)
        m = _LINE.search(line)
        if m:
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return m.group(1), int(m.group(2))

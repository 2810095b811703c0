"""Where an export's time goes: the main thread's stack sampled every 0.2 s (cProfile cannot follow Dynamo's
frames) while a one-entry package of the default model is built in this process (jobs=1); then, in a fresh
process, while the package is loaded and run. Prints the functions holding most samples (inclusive).

    python scripts/profile_export.py [--entry decode|prefill64|prefill4096] [--out P.pt2]
    python scripts/profile_export.py --load P.pt2
"""
import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch


class Sampler:
    def __init__(self, every_s: float = 0.2):
        self.every_s, self.n = every_s, 0
        self.inclusive: collections.Counter = collections.Counter()
        self.leaf: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._main = threading.main_thread().ident

    def _run(self):
        while not self._stop.wait(self.every_s):
            f = sys._current_frames().get(self._main)
            names = []
            while f is not None:
                c = f.f_code
                names.append(f"{os.path.basename(c.co_filename)}:{c.co_name}")
                f = f.f_back
            self.n += 1
            self.leaf[" < ".join(names[:4])] += 1
            for n in set(names):
                self.inclusive[n] += 1

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def report(self, n: int = 40) -> str:
        lines = [f"{self.n} samples every {self.every_s} s; inclusive:"]
        lines += [f"  {c * self.every_s:7.1f} s  {k}" for k, c in self.inclusive.most_common(n)]
        lines += ["innermost frames:"] + [f"  {c * self.every_s:7.1f} s  {k}" for k, c in self.leaf.most_common(15)]
        return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entry", default="decode", choices=["decode", "prefill64", "prefill4096"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--load", default=None, help="profile loading + running this package instead")
    a = ap.parse_args()
    if a.load:
        from dsv4_export.load import ExportedEngine

        t0 = time.time()
        with Sampler() as s:
            eng = ExportedEngine(a.load, device="cuda")
            t1 = time.time()
            eng.generate([[1, 2, 3, 4]], max_new_tokens=8)
            torch.cuda.synchronize()
        print(f"== load {time.time() - t0:.1f} s: constructor {t1 - t0:.1f} s ({', '.join(eng.entries)})")
        print(s.report())
        return
    from dsv4_export.build import build_from_checkpoint

    seq = {"decode": [], "prefill64": [64], "prefill4096": [4096]}[a.entry]
    out = a.out or os.path.join(tempfile.mkdtemp(), "p.pt2")
    t0 = time.time()
    with Sampler() as s:
        build_from_checkpoint("dsv4_model/assets/default", out, max_batch_size=1, max_seq_len=4096, device="cuda",
                              prefill_batches=[1] if seq else [], prefill_lengths=seq, save_exported_programs=False,
                              jobs=1)
    print(f"== build {a.entry}: {time.time() - t0:.1f} s ({os.path.getsize(out) / 2**20:.1f} MiB)")
    print(s.report())
    sys.stdout.flush()
    subprocess.run([sys.executable, __file__, "--load", out], check=False)


if __name__ == "__main__":
    main()

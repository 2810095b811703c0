"""``python -m export.compile_worker JOB.json``: AOT-compiles one saved ExportedProgram (see build.compile_entries).

A separate interpreter per entry because Inductor's code generation for one graph is single-threaded; a
plain subprocess rather than multiprocessing so the caller's ``__main__`` is never re-imported.
"""
from __future__ import annotations

import json
import sys


def main(job_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    import torch
    import torch._inductor.config as inductor_config

    import dsv4_ops  # noqa: F401  (the parent's library: DSV4_OPS_LIBRARY is set for this process)
    from export.build import Entry, _aot_compile, _example_inputs
    from export.entrypoints import CacheSpec

    inductor_config.cpp.cxx = (job["cxx"],)
    ep = torch.export.load(job["ep"])
    entry = Entry(**job["entry"])
    caches = tuple(torch.zeros(c.shape, dtype=c.dtype, device=job["device"])
                   for c in map(CacheSpec.from_json, job["caches"]))
    files = _aot_compile(ep, (_example_inputs(entry, job["device"]), caches), {}, job["options"])
    with open(job["result"], "w") as f:
        json.dump(files, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

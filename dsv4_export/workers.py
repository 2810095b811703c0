"""Exports + AOTInductor-compiles a package's entries in parallel worker processes.

One entry's export and compile are mostly single-threaded Python (tracing, lowering, code generation) and one
C++ compile of its wrapper, so entries built side by side in processes cut a package's build to about its
slowest entry. The model travels to each worker as one ``torch.save`` of the module (weights included); each
worker runs ``build.export_and_compile`` on its share of the entries and hands back the AOTI files' paths,
which the parent packages.

    python -m dsv4_export.workers SPEC.json   (what the parent runs; SPEC names the model file and the entries)
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fn_name(fn: Callable) -> str:
    name = f"{fn.__module__}:{fn.__qualname__}"
    if _resolve(name) is not fn:
        raise ValueError(f"{name} is not importable by name: worker processes cannot call it (use jobs=1)")
    return name


def _resolve(name: str) -> Callable | None:
    mod, _, qual = name.partition(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return obj


def export_and_compile_in_workers(model: nn.Module, names: Sequence[str], entries: Sequence, eager_ops: dict,
                                  meta: dict[str, str], *, jobs: int, device: str, ep_stem: str | None,
                                  verbose: bool, decode_fn: Callable, prefill_fn: Callable) -> dict:
    """``build.export_and_compile`` with the entries shared round-robin among ``jobs`` processes."""
    fns = {"decode_fn": _fn_name(decode_fn), "prefill_fn": _fn_name(prefill_fn)}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="dsv4_export_") as tmp:
        model_path = os.path.join(tmp, "model.pt")
        torch.save(model, model_path)
        procs = []
        try:
            for k in range(jobs):
                spec = dict(fns, model=model_path, names=list(names), device=device, ep_stem=ep_stem,
                            verbose=verbose, meta=meta, worker=k, result=os.path.join(tmp, f"result{k}.json"),
                            entries=[dataclasses.asdict(e) for e in entries[k::jobs]],
                            eager_ops={kind: sorted(ops) for kind, ops in eager_ops.items()})
                spec_path = os.path.join(tmp, f"spec{k}.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                # own session: a terminal's Ctrl-C reaches the parent only, which stops them here (no
                # KeyboardInterrupt traceback per worker)
                procs.append((spec, subprocess.Popen([sys.executable, "-m", "dsv4_export.workers", spec_path],
                                                     cwd=ROOT, env=env, start_new_session=True)))
            failed = [(spec, p.wait()) for spec, p in procs]
        finally:
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()  # gone before the build removes the scratch folder it writes to
        bad = [(s, rc) for s, rc in failed if rc != 0]
        if bad:
            raise RuntimeError("; ".join(f"export worker {s['worker']} ({', '.join(e['name'] for e in s['entries'])})"
                                         f" exited with {rc}" for s, rc in bad) + ": its messages are above")
        done = {}
        for spec, _ in procs:
            with open(spec["result"]) as f:
                done.update({name: (files, ops) for name, (files, ops) in json.load(f).items()})
    return done


def _main(spec_path: str) -> int:
    import dsv4_ops  # noqa: F401  (schemas, fakes and kernels before the model is unpickled)
    from dsv4_export import toolchain
    from dsv4_export.build import Entry, export_and_compile

    with open(spec_path) as f:
        spec = json.load(f)
    toolchain.configure_inductor()
    model = torch.load(spec["model"], weights_only=False, map_location=spec["device"])
    tag = f"[export w{spec['worker']}]"
    log = (lambda m: print(f"{tag} {m}", file=sys.stderr, flush=True)) if spec["verbose"] else (lambda m: None)
    done = export_and_compile(model, spec["names"], [Entry(**e) for e in spec["entries"]],
                              {k: set(v) for k, v in spec["eager_ops"].items()}, spec["meta"],
                              device=spec["device"], ep_stem=spec["ep_stem"], verbose=spec["verbose"],
                              decode_fn=_resolve(spec["decode_fn"]), prefill_fn=_resolve(spec["prefill_fn"]), log=log)
    with open(spec["result"], "w") as f:
        json.dump(done, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1]))

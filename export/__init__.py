"""torch.export / AOTInductor packaging of the dsv4 model, loadable from Python and C++.

    python -m export build --model CKPT --out model.pt2     # export + compile (see export/build.py)
    python -m export run model.pt2 --prompt-ids 1 2 3        # load in this process and generate
    export/cpp/build.sh && export/cpp/build/dsv4_run model.pt2 1 2 3   # the same without Python

Python API: ``build_package`` / ``build_from_checkpoint`` (export/build.py), ``ExportedEngine``,
``get_metadata``, ``PackageMismatch`` (export/load.py), ``configure_inductor`` (export/toolchain.py).
"""
from __future__ import annotations

__all__ = ["build_package", "build_from_checkpoint", "ExportedEngine", "get_metadata", "PackageMismatch",
           "configure_inductor"]


def __getattr__(name: str):
    # Lazy: `python -m export run` should not import the export tracing machinery, and vice versa.
    if name in ("build_package", "build_from_checkpoint"):
        from export import build

        return getattr(build, name)
    if name in ("ExportedEngine", "get_metadata", "PackageMismatch"):
        from export import load

        return getattr(load, name)
    if name == "configure_inductor":
        from export.toolchain import configure_inductor

        return configure_inductor
    raise AttributeError(name)

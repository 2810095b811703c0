r"""torch.export / AOTInductor packaging of the dsv4 model, loadable from Python and C++.

    python -m dsv4_export build --model CKPT --out model.pt2     # export + compile (see dsv4_export/build.py)
    python -m dsv4_export run model.pt2 --prompt-ids 1 2 3        # load in this process and generate
    bash dsv4_export/cpp/build.sh                                 # the same without Python (docs/export.md):
    dsv4_export/cpp/build/dsv4_run --ops-lib "$(python -c 'import dsv4_ops; print(dsv4_ops.library_path())')" \
        model.pt2 1 2 3

Python API: ``build_package`` / ``build_from_checkpoint`` (dsv4_export/build.py), ``ExportedEngine``,
``get_metadata``, ``PackageMismatch`` (dsv4_export/load.py), ``configure_inductor`` (dsv4_export/toolchain.py).
"""
from __future__ import annotations

__all__ = ["build_package", "build_from_checkpoint", "ExportedEngine", "get_metadata", "PackageMismatch",
           "configure_inductor"]


def __getattr__(name: str):
    # Lazy: `python -m dsv4_export run` should not import the export tracing machinery, and vice versa.
    if name in ("build_package", "build_from_checkpoint"):
        from dsv4_export import build

        return getattr(build, name)
    if name in ("ExportedEngine", "get_metadata", "PackageMismatch"):
        from dsv4_export import load

        return getattr(load, name)
    if name == "configure_inductor":
        from dsv4_export.toolchain import configure_inductor

        return configure_inductor
    raise AttributeError(name)

"""Loads the compiled op library exactly once, checks it has every op of the schema table, then registers the fakes.

Order matters: the C++ schemas must exist before ``torch.library.register_fake`` can attach to them.
The library is never JIT-compiled at import: it is built by ``scripts/build_ops.sh`` (or by
``pip install --no-build-isolation .``) and only loaded here.
"""
from __future__ import annotations

import glob
import os

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_LIB_NAME = "libdsv4_ops.so"
_loaded_path: str | None = None

_BUILD_HINT = (
    "dsv4_ops: the compiled op library is missing ({what}). Build it from the repository root with "
    "`bash scripts/build_ops.sh` (CPU kernels always; CUDA kernels when torch has CUDA), or install the "
    "package with `pip install --no-build-isolation .`. To use a library built elsewhere, set "
    "DSV4_OPS_LIBRARY=/path/to/libdsv4_ops.so."
)


def library_path() -> str:
    """Path of the loaded libdsv4_ops.so (what the C++ AOTI runner must dlopen)."""
    if _loaded_path is None:
        load()
    assert _loaded_path is not None
    return _loaded_path


def load() -> None:
    global _loaded_path
    if _loaded_path is not None:
        return
    override = os.environ.get("DSV4_OPS_LIBRARY")
    if override:
        if not os.path.isfile(override):
            raise ImportError(_BUILD_HINT.format(what=f"DSV4_OPS_LIBRARY={override} does not exist"))
        torch.ops.load_library(override)
        path = os.path.abspath(override)
    else:
        candidates = glob.glob(os.path.join(_PKG_DIR, "_C*.so"))
        if not candidates or not os.path.isfile(os.path.join(_PKG_DIR, _LIB_NAME)):
            raise ImportError(_BUILD_HINT.format(what=f"no {_LIB_NAME} / _C module in {_PKG_DIR}"))
        from dsv4_ops import _C  # noqa: F401  (loads libdsv4_ops.so; registers the schemas)

        path = os.path.join(_PKG_DIR, _LIB_NAME)
    check_current(path)  # before _loaded_path is set: a stale library fails every import, not only the first
    _loaded_path = path
    from dsv4_ops import fakes  # noqa: F401  (after the schemas exist)


def check_current(path: str, op_names: tuple[str, ...] | None = None) -> None:
    """Refuse, in one error, a library that lacks an op of the schema table (built from older sources): its fakes
    could not register, and the op would fail later, deep inside torch.compile or an export."""
    from dsv4_ops.families import OP_NAMES

    missing = [n for n in (OP_NAMES if op_names is None else op_names) if not hasattr(torch.ops.dsv4, n)]
    if missing:
        raise ImportError(
            f"dsv4_ops: the op library {path} is stale: it lacks {', '.join(f'dsv4::{n}' for n in missing)} "
            "(ops of the schema table, dsv4_ops/csrc/registration.cpp). Rebuild it from the repository root with "
            "`bash scripts/build_ops.sh`, or reinstall the package (`pip install --no-build-isolation .`).")


def built_with_cuda() -> bool:
    """True when the loaded library carries the CUDA kernels."""
    load()
    import ctypes

    # Same absolute path as the loaded copy, so this returns the already-loaded handle.
    return bool(ctypes.CDLL(library_path()).dsv4_ops_built_with_cuda())

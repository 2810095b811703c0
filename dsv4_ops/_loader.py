"""Loads the compiled op library exactly once, then registers the fakes.

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
        _loaded_path = os.path.abspath(override)
    else:
        candidates = glob.glob(os.path.join(_PKG_DIR, "_C*.so"))
        if not candidates or not os.path.isfile(os.path.join(_PKG_DIR, _LIB_NAME)):
            raise ImportError(_BUILD_HINT.format(what=f"no {_LIB_NAME} / _C module in {_PKG_DIR}"))
        from dsv4_ops import _C  # noqa: F401  (loads libdsv4_ops.so; registers the schemas)

        _loaded_path = os.path.join(_PKG_DIR, _LIB_NAME)
    from dsv4_ops import fakes  # noqa: F401  (after the schemas exist)


def built_with_cuda() -> bool:
    """True when the loaded library carries the CUDA kernels."""
    load()
    import ctypes

    # Same absolute path as the loaded copy, so this returns the already-loaded handle.
    return bool(ctypes.CDLL(library_path()).dsv4_ops_built_with_cuda())

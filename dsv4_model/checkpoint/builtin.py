"""The built-in default model: its public name and where its checkpoint lies.

`DEFAULT_MODEL` ("dsv4-default") names it wherever a checkpoint is asked for (`Engine.from_pretrained`,
`--model`, `dsv4_export build --model`). It is the trained tiny model shipped in `dsv4_model/assets/default/`
(docs/default-model.md); an install without those files falls back to a random tiny checkpoint written once into
the cache directory (gibberish text: it shows the pipeline, not a language model).
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "dsv4-default"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default"
RANDOM_TINY_NAME = "random-tiny-v1"


def cache_dir() -> Path:
    """dsv4's own cache: $DSV4_CACHE_DIR, else $XDG_CACHE_HOME/dsv4, else ~/.cache/dsv4."""
    root = os.environ.get("DSV4_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dsv4")
    return Path(root)


def default_model_path() -> tuple[Path, str]:
    """(path, description) of the built-in default model."""
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return DEFAULT_MODEL_DIR, f"built-in default model {DEFAULT_MODEL_DIR}"
    path = cache_dir() / RANDOM_TINY_NAME
    if not (path / "config.json").is_file():
        from dsv4_model.checkpoint.writer import write_tiny_checkpoint

        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        write_tiny_checkpoint(tmp, "dsv4", seed=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, path)  # atomic: a concurrent run sees a complete checkpoint or none
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return path, (f"no trained default model in {DEFAULT_MODEL_DIR}: using a RANDOM tiny checkpoint at {path} "
                  "(its output is gibberish; pass --model PATH for a real model)")

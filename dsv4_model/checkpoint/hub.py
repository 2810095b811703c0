"""`--model` / `from_pretrained` references: a checkpoint directory, or a Hugging Face repository id.

`resolve_checkpoint(ref)`: an existing directory is returned as is; "dsv4-default" (`DEFAULT_MODEL`) is the built-in
model (dsv4_model/checkpoint/builtin.py). A reference of the form `org/name` or
`org/name@revision` (a branch, tag or commit hash) that is not a directory is looked up in the local Hugging Face
cache, offline (huggingface_hub's `snapshot_download(local_files_only=True)`: the cache is wherever HF_HUB_CACHE /
HF_HOME put it, read by huggingface_hub itself, as for transformers). Nothing is ever downloaded.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from dsv4_model.checkpoint.builtin import DEFAULT_MODEL, default_model_path
from dsv4_model.checkpoint.io import CheckpointError

# org/name[@revision]; huggingface_hub's validate_repo_id then has the last word on the id itself
_REPO_REF = re.compile(r"([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?")


def hub_cache_dir() -> str:
    """The Hugging Face hub cache huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/...)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE  # read at call time: a test may point it elsewhere


def _repo_ref(ref: str) -> tuple[str, str | None] | None:
    m = _REPO_REF.fullmatch(ref)
    if m is None:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(m.group(1))
    except HFValidationError:
        return None
    return m.group(1), m.group(2)


def display_name(path: str | os.PathLike) -> str:
    """What progress lines call a checkpoint directory: `org/name` for a Hugging Face cache snapshot
    (.../models--org--name/snapshots/COMMIT, whose own name is a commit hash), else the folder's name."""
    p = Path(path)
    repo = p.parent.parent.name
    if p.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") >= 2:
        return repo[len("models--"):].replace("--", "/", 1)
    return p.name


def resolve_checkpoint(ref: str | os.PathLike, arg: str = "") -> Path:
    """The checkpoint directory `ref` names (see the module docstring). `arg` names the argument in errors
    (e.g. "--model"); a miss is one CheckpointError line naming `ref` (and the cache it looked in)."""
    what = f"{arg} {ref}" if arg else str(ref)
    path = Path(ref)
    if path.is_dir():
        return path
    if os.fspath(ref) == DEFAULT_MODEL:
        return default_model_path()[0]
    if path.exists():  # a file (e.g. a shard) is no checkpoint, whatever its name looks like
        raise CheckpointError(f"{what}: a file, not a checkpoint directory (give the directory that holds config.json)")
    parsed = _repo_ref(os.fspath(ref))
    if parsed is None:
        raise CheckpointError(f"{what}: no such checkpoint directory")
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError as e:
        at = f" (revision {revision})" if revision else ""
        get = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        if type(e).__name__ == "IncompleteSnapshotError":  # (newer huggingface_hub) a partial download
            raise CheckpointError(f"{what}: not a directory, and only partly in the Hugging Face cache{at} at "
                                  f"{cache} (an interrupted download: finish it with `{get}`)") from None
        raise CheckpointError(f"{what}: not a directory, and not in the Hugging Face cache{at} at {cache} "
                              f"(download it with `{get}`)") from None

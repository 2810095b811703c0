"""Argument checks shared by the CLI, the Python API and the package tools: each raises one ValueError naming the
argument, before any weight is read or any GPU work."""
from __future__ import annotations

import torch


def parse_device(device) -> torch.device:
    """"cpu" | "cuda" | "cuda:N" (or a torch.device) -> torch.device, checked against this machine."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device (use cpu, cuda or cuda:N)") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: dsv4 runs on cpu or cuda")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) has no usable CUDA device")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return d


def check_max_seq_len(max_seq_len, config, allow_beyond_max_position: bool = False) -> None:
    """max_seq_len (the cache length) must lie in [largest compress ratio, config.max_position_embeddings]; the
    upper bound only unless allow_beyond_max_position (positions the model was not trained for)."""
    low = max(1, max(config.compress_ratios))
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < low:
        raise ValueError(f"max_seq_len must be an int >= {low} (the largest compress ratio), got {max_seq_len!r}")
    if max_seq_len > config.max_position_embeddings and not allow_beyond_max_position:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings} (allow_beyond_max_position=True, or "
                         "--allow-beyond-max-position, runs past it anyway)")


def check_positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value

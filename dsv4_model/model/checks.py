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


MAX_POSITIONS = 2**31 - 1


def check_max_seq_len(max_seq_len, config, allow_beyond_max_position: bool = False,
                      name: str = "max_seq_len") -> None:
    """max_seq_len (the cache length) must lie in [largest compress ratio, config.max_position_embeddings]; the
    upper bound only unless allow_beyond_max_position (positions the model was not trained for). name: what the
    errors call it (the CLI's flag)."""
    low = max(1, max(config.compress_ratios))
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < low:
        raise ValueError(f"{name} must be an int >= {low} (the largest compress ratio), got {max_seq_len!r}")
    if max_seq_len > MAX_POSITIONS:
        raise ValueError(f"{name} must be at most {MAX_POSITIONS} (positions are int32 in the kernels), "
                         f"got {max_seq_len}")
    if max_seq_len > config.max_position_embeddings and not allow_beyond_max_position:
        raise ValueError(f"{name}={max_seq_len} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings} (allow_beyond_max_position=True, or "
                         "--allow-beyond-max-position, runs past it anyway)")


# Drafts per speculative step (generate(speculate=K), --speculate K). Not a limit of the caches (K spare ring
# slots work for any K) but of use: the one MTP block chains on its own outputs, so each further draft is accepted
# less often (docs/speculation.md), while a step verifies K + 1 tokens, runs the block K times and compiles per K.
MAX_SPECULATE = 8


def check_speculate(value, name: str = "speculate") -> int:
    """K in [0, MAX_SPECULATE]; 0 = no speculation."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SPECULATE:
        raise ValueError(f"{name} must be an int >= 0 (0 = off) and at most {MAX_SPECULATE}, got {value!r}")
    return value


def check_positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_ids(ids: torch.Tensor, what: str, vocab_size: int) -> None:
    """Integer token ids in [0, vocab_size)."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"{what} must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{what} contains token id {lo if lo < 0 else hi} outside [0, vocab_size={vocab_size})")


def prefill_request(input_ids, lengths, *, max_batch_size: int, max_seq_len: int,
                    vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """A checked prefill: input_ids [B, S] (right-padded rows), lengths [B] or None -> (int64 CPU tokens [B, S'] with
    S' the longest length and token 0 in the padding, which may hold any value; the lengths as ints)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a 2-D tensor [batch, seq]")
    B, S = input_ids.shape
    if B < 1 or S < 1:
        raise ValueError(f"empty prompt batch {tuple(input_ids.shape)}")
    if B > max_batch_size:
        raise ValueError(f"batch size {B} exceeds max_batch_size={max_batch_size}")
    if lengths is None:
        lens = [S] * B
    else:
        lengths = torch.as_tensor(lengths)
        if lengths.shape != (B,):
            raise ValueError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
        lens = [int(v) for v in lengths.tolist()]
        if min(lens) < 1 or max(lens) > S:
            raise ValueError(f"lengths must lie in [1, {S}], got {lens}")
    if max(lens) > max_seq_len:
        raise ValueError(f"prompt length {max(lens)} exceeds max_seq_len={max_seq_len}")
    S = max(lens)  # drop all-padding columns
    valid = torch.arange(S).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    ids = input_ids.detach()[:, :S].cpu()
    check_ids(ids[valid], "input_ids", vocab_size)
    return torch.where(valid, ids, torch.zeros_like(ids)).long(), lens


def decode_request(next_ids, lens: list[int], *, max_seq_len: int, vocab_size: int) -> torch.Tensor:
    """A checked decode step of the prefilled batch whose rows hold `lens` tokens -> int64 ids [B]."""
    if not lens:
        raise ValueError("decode() called before prefill()")
    next_ids = torch.as_tensor(next_ids)
    if next_ids.shape != (len(lens),):
        raise ValueError(f"next_ids must have shape ({len(lens)},) to match the prefilled batch, got "
                         f"{tuple(next_ids.shape)}")
    if max(lens) >= max_seq_len:
        raise ValueError(f"a row already holds {max(lens)} tokens = max_seq_len={max_seq_len}")
    check_ids(next_ids, "next_ids", vocab_size)
    return next_ids.long()

"""Per-row sampling parameters as static device tensors.

All per-step state the sampler reads (temperature, top-k, top-p, seed, RNG offset) lives in preallocated
device tensors, so the sampler can sit inside a compiled graph or a CUDA graph: a step draws fresh numbers
because `offset` is incremented on the device, never because a Python value changed.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature <= 0: greedy. top_k = 0 and top_p >= 1 switch those filters off. The draws of a row
    depend only on (seed, step): `generate` gives prompt i the seed `seed + i`. The seed is the sampler's 64-bit
    Philox key: any int in [SEED_MIN, SEED_MAX] (int64 or uint64), taken modulo 2**64."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> "SamplingParams":
        # the sampler's tensors: temperature / top_p float32, top_k int64 (a larger value would not fit)
        if not _real(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:  # nan / inf: nan probabilities
            raise ValueError(f"temperature must be >= 0 and finite (at most {FLOAT32_MAX:.4g}: float32), "
                             f"got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be >= 0 (0 = off), an int of at most 2**63 - 1, got {self.top_k!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an int in [-2**63, 2**64 - 1] (a 64-bit key), got {self.seed!r}")
        return self


SEED_MIN, SEED_MAX = -2**63, 2**64 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def seed_key(seed: int) -> int:
    """The seed as the int64 the sampler's seed tensor holds (two's complement of seed mod 2**64)."""
    return (int(seed) + 2**63) % 2**64 - 2**63


class SamplerBuffers:
    """Static [max_rows] parameter tensors; rows [:B] are live, padded rows are set to greedy."""

    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows = max_rows
        self.temperature = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_rows, dtype=torch.float32, device=device)
        self.seed = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.offset = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def set(self, params: list[SamplingParams]) -> None:
        """Row b gets params[b] and offset 0; rows past len(params): greedy."""
        n = len(params)
        if n > self.max_rows:
            raise ValueError(f"{n} rows exceed the {self.max_rows} sampler rows")
        pad = self.max_rows - n
        host = {
            "temperature": torch.tensor([p.temperature for p in params] + [0.0] * pad, dtype=torch.float32),
            "top_k": torch.tensor([p.top_k for p in params] + [0] * pad, dtype=torch.int64),
            "top_p": torch.tensor([p.top_p for p in params] + [1.0] * pad, dtype=torch.float32),
            "seed": torch.tensor([seed_key(p.seed) for p in params] + [0] * pad, dtype=torch.int64),
        }
        for name, t in host.items():
            getattr(self, name).copy_(t)
        self.offset.zero_()

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Row `row` gets params and offset 0 (a request admitted into a running batch); the others keep theirs."""
        # fill_ of a Python scalar is a kernel argument; `t[row] = scalar` on a GPU copies a host 0-d tensor and
        # waits for the stream (this runs while the previous iteration's step is in flight)
        self.temperature[row].fill_(float(params.temperature))
        self.top_k[row].fill_(int(params.top_k))
        self.top_p[row].fill_(float(params.top_p))
        self.seed[row].fill_(seed_key(params.seed))
        self.offset[row].fill_(0)

    def rows(self, n: int) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, seed, offset) views of rows [:n]."""
        return (self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seed[:n], self.offset[:n])

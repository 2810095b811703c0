"""Expert parallelism over a torch.distributed group: each rank holds a contiguous slice of every MoE layer's
routed experts; the router, attention, the shared expert and the caches are replicated. A layer's MoE computes
what its local experts contribute and sums that across the ranks (a functional all_reduce, which torch.compile
traces and a CUDA graph captures), so every rank ends the layer holding the single-process result.

NVFP4 experts exchange their uncombined expert rows (each assignment's output, zero where another rank owns the
expert: a sum with one nonzero term is exact) and combine them afterwards in slot order, so the result is the
single-process one bit for bit; float experts exchange fp32 partial sums (equal up to fp32 summation order)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class ExpertShard:
    """This rank's place in the expert-parallel group (`group`: a ProcessGroup; None = the default group)."""

    rank: int
    world: int
    group: object = None

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"ExpertShard: rank {self.rank} of world {self.world}")

    @classmethod
    def of_group(cls, group=None) -> "ExpertShard":
        """This process's shard of an initialised process group (default: the whole world)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def bounds(self, n_experts: int) -> tuple[int, int]:
        """(first expert, count) held by this rank."""
        if n_experts % self.world:
            raise ValueError(f"expert parallelism over {self.world} ranks needs n_routed_experts divisible by "
                             f"{self.world}, got {n_experts}")
        per = n_experts // self.world
        return self.rank * per, per

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group's ranks (a new tensor)."""
        if self.world == 1:
            return t
        return funcol.all_reduce(t, "sum", self.group if self.group is not None else dist.group.WORLD)

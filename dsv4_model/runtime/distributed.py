"""Runs started by torchrun: each process joins the launcher's process group and holds its slice of the routed
experts (expert parallelism over every rank; dsv4_model.model.parallel), the rest of the model replicated."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dsv4_model.model.parallel import ExpertShard


def launched() -> bool:
    """Whether this process was started by torchrun (torch.distributed's elastic launcher)."""
    return dist.is_available() and dist.is_torchelastic_launched()


def launch_rank() -> int:
    """This process's rank in the torchrun launch (0 when not launched), known before the group is joined."""
    return int(os.environ.get("RANK", "0")) if launched() else 0


def init_expert_parallel(device: torch.device) -> tuple[torch.device, ExpertShard]:
    """Join the launcher's group (NCCL on CUDA, each rank on its node-local GPU; gloo on the CPU) and return
    (this rank's device, its expert shard)."""
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_node_local_rank())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device, ExpertShard.of_group()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> None:
    """End a torchrun rank now, after flushing its output: at interpreter teardown a CPU (gloo) rank aborts now and
    then with "terminate called without an active exception" (torch 2.13) after all its work is done, and torchrun
    then fails the run. Other processes return normally."""
    if not launched():
        return
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

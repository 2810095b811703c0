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
    shard = ExpertShard.of_group()
    if shard.world > 1:
        untimed_kernels()
    return device, shard


def untimed_kernels() -> None:
    """Inductor times several configs of a reduction on the device and keeps the fastest: each rank timing its own
    could keep a different one, so the replicated activations would differ in their last bits, a near-tie in the
    router's top-k could then pick different experts on different ranks, and the rows the ranks exchange would no
    longer add up to one token's output. Its deterministic mode picks configs without timing them (on under
    expert parallelism; a one-process run that is compared with one turns it on too)."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True


def shutdown() -> None:
    """Leave the process group. NCCL's is left to the process's exit (exit_rank): a CUDA graph that captured its
    collectives keeps the communicator in use, and NCCL (2.26 on) waits in destroy until every such graph is
    freed, which the runners' graphs, alive until the process ends, never are."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "nccl":
        from dsv4_model.runtime.step_plan import forget_plan_groups

        forget_plan_groups()
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


def run_main(main) -> None:
    """A script's entry point under torchrun or not: main() -> exit code, then the process ends (exit_rank under
    torchrun: a rank that returned through the interpreter's teardown could wait on the NCCL communicator its CUDA
    graphs hold). An exception under torchrun is printed and ends the rank with 1; a SystemExit's message is
    printed as sys.exit prints it."""
    import sys

    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr, flush=True)
    except BaseException:
        if not launched():
            raise
        import traceback

        traceback.print_exc()
        code = 1
    exit_rank(code)
    sys.exit(code)

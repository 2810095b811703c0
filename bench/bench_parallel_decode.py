"""Decode speed of a random NVFP4 DeepSeek-V4 model with expert parallelism over the ranks of a torchrun launch
(or one process): compiled + CUDA-graph steps at each batch size and context, against the per-GPU byte floor and
SGLang's published V4-Flash figure (4x H200, TP4 + MTP, concurrency 1; bench/common.py cites it from
/work/shared/docs/peers-and-limits.md: not run here).

    torchrun --nproc-per-node 2 bench/bench_parallel_decode.py --layers 43 --experts 256 --batches 1,8,64
    python bench/bench_parallel_decode.py --experts fit --context 131072      # one GPU: as many experts as fit
    python bench/bench_parallel_decode.py --preset pro --experts fit --batches 1,8
    python bench/bench_parallel_decode.py --layers 4 --experts 256 --batches 16,64 --kernel-overrides attn_kernel=wgmma

--experts fit: the most routed experts whose memory plan (dsv4_model.checkpoint.memory_plan: weights + caches for
the largest batch x context) leaves --reserve-gib of the GPU's free memory for graph pools and activations.

Each rank builds its share of the model directly in NVFP4 on its GPU (`random_nvfp4_model(expert_shard=)`). The
steps run at positions context - steps - warm-up onwards on zeroed caches: a decode step lists and reads the whole
window and every compressed entry up to its position, so it costs what a real context costs, without prefilling
it. Byte floor per GPU = the weights one step reads there / 4.26 TB/s: every replicated weight (the embedding: B
rows) and this rank's share of the distinct experts B tokens x 6 touch (uniform routing: E (1 - (1 - 6/E)^B)).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import FULL_MODELS as PRESETS  # noqa: E402
from common import SGLANG_4XH200_FLASH_TPOT_MS as SGLANG  # noqa: E402
from common import HBM_BYTES_PER_S, floor_seconds  # noqa: E402
from dsv4_model.checkpoint.memory_plan import GiB, memory_plan  # noqa: E402
from dsv4_ops.overrides import parse as parse_overrides, set_overrides  # noqa: E402
from dsv4_model.model.config import ModelConfig  # noqa: E402
from dsv4_model.quant.random_model import random_nvfp4_model  # noqa: E402
from dsv4_model.runtime import distributed  # noqa: E402
from dsv4_model.runtime.compiled import DecodeRunner  # noqa: E402
from dsv4_model.runtime.sampling import SamplingParams  # noqa: E402

WARM = 3


def fitting_experts(cfg: ModelConfig, *, batch: int, context: int, world: int, free_bytes: int) -> int:
    """The most routed experts (a multiple of the world size, at most the preset's) whose plan fits free_bytes.
    The plan is affine in the expert count: two plans give the line."""
    def total(e: int) -> int:
        return memory_plan(cfg.sliced(n_routed_experts=e), max_batch_size=batch, max_seq_len=context,
                           ep=world).total
    lo = max(cfg.n_activated_experts, 8) * world
    per_expert = (total(2 * lo) - total(lo)) / lo
    e = int((free_bytes - total(lo)) / per_expert) + lo
    e = min(e - e % world, cfg.n_routed_experts)
    while e >= lo and total(e) > free_bytes:
        e -= world
    if e < lo:
        raise SystemExit(f"{cfg.n_layers} layers do not fit with {lo} experts in {free_bytes / GiB:.1f} GiB")
    return e


def config(args, device: torch.device, world: int) -> ModelConfig:
    cfg = PRESETS[args.preset]().sliced(args.layers, n_mtp_layers=0)
    experts = args.experts or ("fit" if device.type == "cuda" else None)
    if experts != "fit":
        return cfg.sliced(n_routed_experts=None if experts is None else int(experts))
    if device.type != "cuda":
        raise SystemExit("--experts fit needs a CUDA device (it sizes the model to the free memory)")
    free = torch.cuda.mem_get_info(device)[0] - int(args.reserve_gib * GiB)
    if world > 1:  # every rank must build the same model: the fullest GPU decides
        free = int(all_ranks(free, device, "min"))
    batches = [int(b) for b in args.batches.split(",")]
    e = fitting_experts(cfg, batch=max(batches), context=args.context, world=world, free_bytes=free)
    return cfg.sliced(n_routed_experts=e)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="flash")
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's")
    ap.add_argument("--experts", default=None,
                    help="routed experts in all, or 'fit' (the default on a GPU; elsewhere the preset's)")
    ap.add_argument("--reserve-gib", type=float, default=12.0, help="with --experts fit: left free")
    ap.add_argument("--regional", action="store_true", help="compile one layer at a time (DecodeRunner regional)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernel-overrides", default="", help='dsv4_ops.overrides for the run, e.g. "attn_kernel=wgmma"')
    args = ap.parse_args(argv)
    set_overrides(parse_overrides(args.kernel_overrides))
    device = torch.device(args.device)
    shard = None
    if distributed.launched():
        device, shard = distributed.init_expert_parallel(device)
    rank, world = (shard.rank, shard.world) if shard else (0, 1)
    cuda = device.type == "cuda"
    cfg = config(args, device, world)
    batches = [int(b) for b in args.batches.split(",")]
    plan = memory_plan(cfg, max_batch_size=max(batches), max_seq_len=args.context, ep=world)
    if rank == 0:
        print(f"[plan] {args.preset}: {plan.describe()}", flush=True)
    t0 = time.perf_counter()
    model = random_nvfp4_model(cfg, device=device, max_batch_size=max(batches), max_seq_len=args.context,
                               expert_shard=shard)
    if cuda:
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - t0
    runner = DecodeRunner(model, compile=cuda, cuda_graphs=cuda, regional=args.regional)
    if rank == 0:
        mode = ("regional compile" if args.regional else "compiled") + " + CUDA graph" if cuda else "eager (CPU)"
        print(f"{args.preset}: {cfg.n_layers} layers, {cfg.n_routed_experts} experts over {world} rank(s), context "
              f"{args.context}, NVFP4 W4A16, {mode} on {device_name(device)}; build {build_s:.1f} s", flush=True)
        print(f"{'batch':>5} {'ms/token':>9} {'tokens/s':>10} {'floor ms':>9} {'% of floor':>10} "
              f"{'vs SGLang 4xH200 (B=1)':>24} {'compile+capture s':>18} {'exchange ms':>11} {'ranks agree':>11}",
              flush=True)
    for B in batches:
        t0 = time.perf_counter()
        runner.prepare(B)
        setup_s = time.perf_counter() - t0
        model.reset_caches()
        runner.begin([args.context - args.steps - WARM] * B, [SamplingParams() for _ in range(B)])
        for _ in range(WARM):
            runner.step()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            logits, _ = runner.step()
        if cuda:
            torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0) / args.steps
        agree, comm = "-", "-"
        if shard is not None:
            ms = all_ranks(ms, device, "max")  # the slowest rank sets the pace
            total = float(logits.float().sum())  # every rank should hold the same logits (the same kernels)
            agree = "yes" if all_ranks(total, device, "max") == all_ranks(total, device, "min") else "NO"
            if cuda:
                comm = exchange_column(shard, cfg, B, device, rank)
        fl = 1e3 * floor_seconds(model.state_dict().items(), cfg, B, world)
        if rank == 0:
            peer = f"{SGLANG.value / ms:.2f}x" if B == 1 else "-"
            print(f"{B:5d} {ms:9.3f} {1e3 * B / ms:10.1f} {fl:9.3f} {100 * fl / ms:9.1f}% {peer:>24} {setup_s:18.1f} "
                  f"{comm:>11} {agree:>11}", flush=True)
    if cuda:
        mem = torch.cuda.max_memory_allocated(device) / 2**30
        mem = all_ranks(mem, device, "max") if shard is not None else mem
    if rank == 0:
        if cuda:
            print(f"peak memory {mem:.1f} GiB on the fullest GPU (PyTorch's allocator; NCCL's buffers not counted)")
        if shard is not None and cuda:
            print(f"exchange ms: the step's {cfg.n_layers} MoE all_reduces alone ([B (k + 1), dim] bf16 rows each), "
                  "captured in one CUDA graph; the byte floor counts no communication. Over several ranks Inductor "
                  "picks its reduction configs without timing them (runtime/distributed.py): its kernels may differ "
                  "from a one-GPU run's")
        print(f"floor: the weights a step reads / {HBM_BYTES_PER_S / 1e12:.2f} TB/s (the H200's measured copy "
              "bandwidth, on any card)")
        print(f"SGLang 4xH200: {SGLANG.cite()}", flush=True)
    distributed.shutdown()
    return 0


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def all_ranks(value: float, device: torch.device, op: str) -> float:
    """value reduced over the ranks (op "max" or "min")."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.MIN)
    return float(t)


def exchange_graph(shard, n_layers: int, x: torch.Tensor, device: torch.device) -> torch.cuda.CUDAGraph:
    """One step's MoE exchanges alone: n_layers all_reduces of x (the rows NVFP4 experts exchange, [B (k + 1),
    dim] bf16), one after another in one CUDA graph, as the decode step captures them."""
    def body():
        y = x
        for _ in range(n_layers):
            y = shard.all_reduce(y)
        return y.wait() if hasattr(y, "wait") else y

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # NCCL's first use of this size outside the capture
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, device: torch.device, reps: int = 20) -> float:
    """ms per replay of graph, the slowest rank's."""
    graph.replay()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize(device)
    return all_ranks(1e3 * (time.perf_counter() - t0) / reps, device, "max")


def exchange_column(shard, cfg: ModelConfig, batch: int, device: torch.device, rank: int) -> str:
    """The step's exchanges timed alone (exchange_graph, replay_ms) as the table shows them; a rank that fails to
    capture them says so to the others first (one left waiting in a collective would hang the run), and the decode
    figures stand without them."""
    try:
        x = torch.zeros(batch * (cfg.n_activated_experts + 1), cfg.dim, dtype=torch.bfloat16, device=device)
        graph = exchange_graph(shard, cfg.n_layers, x, device)
        ok = 1.0
    except RuntimeError as e:
        print(f"[rank {rank}] exchange graph failed: {e}", file=sys.stderr, flush=True)
        ok = 0.0
    if all_ranks(ok, device, "min") < 1:
        return "failed"
    return f"{replay_ms(graph, device):.3f}"


if __name__ == "__main__":
    distributed.run_main(main)

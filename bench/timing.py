"""CUDA-graph replay timing shared by the kernel benchmarks.

A single launch timed with events measures Python launch overhead; a graph of `reps` back-to-back calls,
replayed, measures the kernels.
"""
import math

import torch


def graph_us(fn, reps, tries=3, indexed=False):
    """Microseconds per call: capture fn() (or fn(i) with indexed=True, so calls can rotate buffers and
    defeat L2) `reps` times in one CUDA graph, replay it, keep the best of `tries`."""
    call = fn if indexed else (lambda _i: fn())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture (autotuning, lazy init)
        for i in range(2):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(tries):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    del graph
    torch.cuda.empty_cache()
    return best


def event_timed(fn, events: list):
    """fn wrapped so that each call's device time is bracketed by two CUDA events, appended to `events` as a
    (start, end) pair (read them after a sync: start.elapsed_time(end) ms)."""
    def timed(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*a, **k)
        end.record()
        events.append((start, end))
        return out
    return timed


def cuda_generator(bench: str):
    """A seeded CUDA generator after printing the device line, or None (with a skip line) without a GPU."""
    if not torch.cuda.is_available():
        print(f"{bench}: needs a CUDA GPU (skipped)")
        return None
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    return torch.Generator(device="cuda").manual_seed(0)


def vs_peer(ours_us: float, peer_us: float, nbytes: int, hbm: float = 4.26e12) -> str:
    """'ours peer speedup | GB/s %HBM' columns of a kernel-vs-peer row (bytes moved once by the kernel)."""
    gbs = nbytes / ours_us / 1e3
    return f"{ours_us:7.2f} {peer_us:10.2f} {peer_us / ours_us:7.2f}x | {gbs:6.0f} {gbs * 1e9 / hbm:5.1%}"

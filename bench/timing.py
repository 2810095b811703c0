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

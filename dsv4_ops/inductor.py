"""Inductor fallbacks for every dsv4 op, registered before a graph that calls them is lowered, and Inductor set to
round as eager does (`eager_rounding`).

Inductor lowers a custom op it has no lowering for through an "implicit fallback" made the first time it meets
the op. torch 2.11 formats the op's IR arguments for a log line right then, whatever the log level, and an IR
node prints its inputs recursively with no sharing, so that text grows exponentially with the depth at which the
op is first met: a model whose last layer is the first to call an op (the MoE's combine, once every other layer
hands its rows to the next layer) kept Inductor busy for tens of minutes. The fallback registered here, with the
layout constraint the implicit path would choose, is the same kernel call without that path; later torch
versions format the line lazily, so there it changes nothing.
"""
from __future__ import annotations

import inspect

import torch

_registered = False


def dsv4_op_overloads() -> list[torch._ops.OpOverload]:
    """Every overload of every op in the dsv4 library."""
    names = sorted({n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsv4::")})
    out = []
    for name in names:
        packet = getattr(torch.ops.dsv4, name)
        out += [getattr(packet, ov) for ov in packet.overloads()]
    return out


def eager_rounding() -> None:
    """Make Inductor round as eager PyTorch does (`emulate_precision_casts`): a fused chain of bf16 elementwise
    ops otherwise keeps its intermediates in fp32, so a compiled graph (torch.compile, an AOTInductor package)
    rounded differently from the eager model (logits apart by ~1e-2 on the built-in bf16 model, and greedy text
    parting at near ties). With it a compiled decode step gives the eager step's logits bit for bit
    (tests/test_path_consistency.py). A process-wide Inductor setting, read when a graph is lowered."""
    torch._inductor.config.emulate_precision_casts = True


def register_inductor_fallbacks() -> None:
    """Idempotent; call before torch.compile / AOTInductor lower a graph with dsv4 ops (the engine and the export
    do). Also sets eager_rounding."""
    global _registered
    import torch._inductor.config  # noqa: F401

    eager_rounding()
    if _registered:
        return
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    takes_warn = "warn" in inspect.signature(lowering.make_fallback).parameters
    for op in dsv4_op_overloads():
        if op in lowering.lowerings:
            continue
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        kwargs = {"warn": False} if takes_warn else {}
        lowering.make_fallback(op, layout_constraint=constraint, **kwargs)
    _registered = True

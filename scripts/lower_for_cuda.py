"""Lower a model's decode step (or an export prefill entry) with Inductor for a FAKE CUDA device (an H200's properties) on a machine without a
GPU, and time each phase: export, decompositions, lowering, Triton code generation (kernels are not compiled).

Why: GPU time is scarce, and what Inductor does before it compiles kernels (lowering, scheduling, fusion, codegen)
depends on the device but not on having one. This is how the H200-only compile hang of the bf16 default model was
found and its fix checked on the CPU machine (bench/RESULTS.md#session-17).

Needs `triton` importable (pip install triton into a --target dir and put it on PYTHONPATH). On a CPU-only torch a
no-op CUDA device guard is compiled once (a few seconds). To check another torch (the GPU machine's 2.11: a CUDA
build runs here without a GPU), run it from that torch's environment with --schemas-only: the dsv4 schemas are then
defined from registration.cpp instead of loading the library built for this machine's torch.

  python scripts/lower_for_cuda.py [--model DIR | --preset flash2 [--experts N]] [--dtype bfloat16]
                                   [--prefill B,S [--chunk] | --verify T | --speculate K [--drafter dspark]]
                                   [--no-register]
                                   [--schemas-only]

--preset NAME: a bench preset at V4-Flash widths (flash1, flash2, flash43, ...) with weights of no storage, no
checkpoint needed; two presets' difference is one layer's kernels (bench_layer.py's method, without a GPU).

--prefill B,S --chunk: the scheduler's compiled prefill chunk instead (dsv4_model.runtime.compiled_prefill: tensor
starts, span --max-seq-len; what Engine(compile_prefill=True) compiles per bucket of B rows x S tokens).
--verify T: a speculative step's verification instead (Transformer.decode_tokens of T tokens per row on a model with
T - 1 spare window slots, as --speculate T - 1 builds it): the kernels and dsv4 op calls of that pass.
--speculate K: a whole greedy speculative step with the MTP block (speculative.verify_step: the verification of
K + 1 tokens, the acceptance, the block over the K + 1 positions, K chained drafts), what the runner captures;
with --preset and --drafter dspark a DSpark step instead (dspark_speculative.dspark_step).
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import re
import sys
import time
import types
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = types.SimpleNamespace(
    name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=143771648000,
    warp_size=32, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
    shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472, max_threads_per_block=1024,
    L2_cache_size=52428800, gcnArchName="", uuid="fake", is_integrated=False, is_multi_gpu_board=False,
    clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=5120)


def define_schemas_from_source() -> None:
    """The dsv4 schemas from registration.cpp's m.def strings (no library), then the Python fakes."""
    src = open(os.path.join(ROOT, "dsv4_ops", "csrc", "registration.cpp")).read()
    lib = torch.library.Library("dsv4", "DEF")
    for m in re.finditer(r"m\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)\)", src):
        lib.define("".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", m.group(1))))
    define_schemas_from_source.lib = lib  # keep the registrations alive
    sys.modules["dsv4_ops._C"] = types.ModuleType("dsv4_ops._C")  # what _loader imports to load the library


def fake_cuda_tensors() -> None:
    """Fake CUDA tensors without a GPU (a CUDA build of torch makes them as it is)."""
    if torch.version.cuda is None:  # CPU-only torch: DeviceGuard(cuda) must exist
        from torch.utils.cpp_extension import load_inline

        load_inline("dsv4_fake_cuda_guard", cpp_sources=[
            "#include <c10/core/impl/DeviceGuardImplInterface.h>\n"
            "C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);"],
            is_python_module=False)
        torch.cuda._lazy_init = lambda: None


def pretend_cuda() -> None:
    """Enough of torch.cuda / the device interface / triton's driver for Inductor to lower and generate code
    (after the fake tensors exist: FakeTensorMode initialises a real GPU context once CUDA looks available)."""
    cuda = torch.cuda
    for name, fn in dict(_lazy_init=lambda: None, is_available=lambda: True, is_initialized=lambda: True,
                         device_count=lambda: 1, current_device=lambda: 0, get_device_capability=lambda *a: (9, 0),
                         get_device_properties=lambda *a: H200, get_device_name=lambda *a: H200.name,
                         get_rng_state=lambda *a: torch.zeros(16, dtype=torch.uint8),
                         set_rng_state=lambda *a: None, _exchange_device=lambda d: 0,
                         _maybe_exchange_device=lambda d: 0).items():
        setattr(cuda, name, fn)
    cuda.device.__enter__ = lambda self: None
    cuda.device.__exit__ = lambda self, *a: False
    from torch._dynamo.device_interface import CudaInterface as ci

    for name, fn in dict(get_device_properties=lambda *a: H200, current_device=lambda: 0, device_count=lambda: 1,
                         get_raw_stream=lambda *a: 0, synchronize=lambda *a: None, memory_allocated=lambda *a: 0,
                         is_bf16_supported=lambda *a, **k: True, exchange_device=lambda d: 0,
                         maybe_exchange_device=lambda d: 0, is_available=lambda: True,
                         get_compute_capability=lambda *a: 90, is_triton_capable=lambda *a: True).items():
        setattr(ci, name, staticmethod(fn))
    ci.Worker.get_device_properties = staticmethod(lambda *a: H200)
    ci.Worker.current_device = staticmethod(lambda: 0)
    import torch.utils._triton as ut
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    ut.triton_backend = lambda: backend
    ut.triton_hash_with_backend = lambda: "FAKE"
    import torch._inductor.config as cfg
    import torch._inductor.fx_passes.joint_graph as jg

    cfg.joint_graph_constant_folding = False  # it runs real kernels on the graph's constants
    cfg.shape_padding = False  # pad_mm times real matmuls (prefill's bmm)
    init = jg.lazy_init
    jg.lazy_init = lambda *a, **k: init(torch.device("cpu"))  # pattern inits make real tensors of the device


def fake_cuda_model(model: torch.nn.Module, fake) -> None:
    dspark = getattr(model, "dspark", None)  # (attached, not a submodule)
    with fake:
        for mod in [*model.modules(), *(dspark.modules() if dspark is not None else ())]:
            for d in (mod._parameters, mod._buffers):
                for name, t in list(d.items()):
                    if t is not None:
                        e = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                        d[name] = torch.nn.Parameter(e, requires_grad=False) if name in mod._parameters else e


def preset_model(name: str, experts: int, rows: int, max_seq_len: int, spare: int,
                 drafter: str | None) -> torch.nn.Module:
    """A bench preset (bench/common.py: flash2, flash43, ...) as an NVFP4 model whose weights stay on the meta
    device (fake_cuda_model gives them shapes on the fake GPU; nothing is allocated); drafter: with an MTP block
    ("mtp") or a DSpark module ("dspark", attached as model.dspark)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import preset, with_drafter

    from dsv4_model.model.dspark import DSpark, attach
    from dsv4_model.model.transformer import Transformer
    from dsv4_model.quant.quantize_model import convert_structure_

    cfg = with_drafter(preset(name, experts=experts), drafter)
    model = Transformer(cfg, max_batch_size=rows, max_seq_len=max_seq_len, dtype=torch.bfloat16, device="meta",
                        spare_window_slots=spare)
    for unit in convert_structure_(model, "none"):
        unit.old = None
    model.narrow_weights_(lossless=True)
    model.setup_runtime("cpu")
    if drafter == "dspark":
        dspark = DSpark(cfg, dtype=torch.bfloat16, max_batch_size=rows, device="meta")
        for unit in convert_structure_(dspark, "none"):
            unit.old = None
        dspark.setup_runtime("cpu")
        attach(model, dspark.eval())
    return model.eval()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "dsv4_model", "assets", "default"))
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--no-register", action="store_true", help="skip dsv4_ops.inductor (the old behaviour)")
    p.add_argument("--schemas-only", action="store_true", help="define the dsv4 schemas from source (no library)")
    p.add_argument("--prefill", metavar="B,S", help="lower the export's prefill entry of B rows x S tokens "
                   "(prefill_bB_sS) instead of the decode step")
    p.add_argument("--chunk", action="store_true", help="with --prefill: lower the compiled prefill chunk (tensor "
                   "starts) of dsv4_model.runtime.compiled_prefill instead of the export's entry")
    p.add_argument("--verify", type=int, default=0, metavar="T", help="lower the verification of T tokens per row "
                   "(Transformer.decode_tokens, T - 1 spare window slots) instead of the decode step")
    p.add_argument("--speculate", type=int, default=0, metavar="K", help="lower a whole greedy speculative step "
                   "with K MTP drafts (speculative.verify_step) instead of the decode step")
    p.add_argument("--drafter", choices=("mtp", "dspark"), default="mtp",
                   help="with --speculate and --preset: the step's drafter (a DSpark step: verification, acceptance, "
                        "the rings' commit, the next block's first K drafts)")
    p.add_argument("--preset", help="a bench preset (flash2, flash43, ...: bench/common.py) with weights of no "
                   "storage instead of --model (V4-Flash widths without a checkpoint)")
    p.add_argument("--experts", type=int, default=16, help="with --preset: its routed experts (the lowering does "
                   "not depend on their count)")
    p.add_argument("--timeout", type=float, default=600, help="dump the stacks and exit after this many seconds")
    p.add_argument("--code", metavar="FILE", help="write the generated wrapper (kernels and the call order) to FILE")
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    sys.path.insert(0, ROOT)
    if args.schemas_only:
        define_schemas_from_source()
    fake_cuda_tensors()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsv4_model.runtime.engine import Engine
    from dsv4_ops import supports

    if args.chunk and not args.prefill:
        p.error("--chunk lowers a prefill chunk: give --prefill B,S too")
    B, S = (int(v) for v in args.prefill.split(",")) if args.prefill else (1, 0)
    if sum(map(bool, (args.verify, args.prefill, args.speculate))) > 1:
        p.error("--verify, --speculate and --prefill lower different entries: give one")
    if args.speculate:
        args.verify = args.speculate + 1  # the model's spare slots, the verified tokens
    spare = max(args.verify - 1, 0)
    if args.preset:
        model = preset_model(args.preset, args.experts, B, args.max_seq_len, spare,
                             args.drafter if args.speculate else None)
    else:
        model = Engine.from_pretrained(args.model, device="cpu", dtype=getattr(torch, args.dtype), max_batch_size=B,
                                       max_seq_len=args.max_seq_len, quant="nvfp4", progress=False,
                                       spare_window_slots=spare).model
    for ix in (m for m in model.modules() if type(m).__name__ == "Indexer"):
        # Indexer.packed_decode's answer on CUDA (the model's buffers are still on the CPU here)
        ix.packed = supports.indexer_score_topk(torch.device("cuda"), ix.head_dim, ix.n_heads,
                                                min(ix.index_topk, ix.n_entries))
    fake = FakeTensorMode()
    fake_cuda_model(model, fake)
    with fake:
        if S:  # the export's example inputs: full-length rows
            tokens = torch.zeros(B, S, dtype=torch.int64, device="cuda")
            positions = torch.full((B,), S, dtype=torch.int64, device="cuda")  # the rows' lengths
            starts = torch.zeros(B, dtype=torch.int64, device="cuda")  # the compiled chunk's (shapes only)
        else:
            tokens = torch.zeros((1, args.verify) if args.verify else (1,), dtype=torch.int64, device="cuda")
            positions = torch.zeros(1, dtype=torch.int64, device="cuda")
    from dsv4_export.entrypoints import call_decode, call_prefill

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model
            if getattr(model, "dspark", None) is not None:  # (attached, not a submodule: export must see its weights)
                self.d = model.dspark

        def forward(self, tokens, positions, *starts):
            if starts:
                return _chunk(self.m, tokens, positions, starts[0], self.m.max_seq_len)
            if args.speculate and args.drafter == "dspark":
                out = dspark_step(self.m, self.m.dspark, tokens[:, 0], tokens[:, 1:], positions, DEFAULT_OPTIONS)
                return tuple(t for t in out if t is not None)
            if args.speculate:
                s = Sampler("greedy", *([None] * 5))
                out = verify_step(self.m, tokens[:, 0], tokens[:, 1:], None, positions, s, DEFAULT_OPTIONS)
                return tuple(t for t in out if t is not None)
            if args.verify:
                return self.m.decode_tokens(tokens, positions)
            return (call_prefill if S else call_decode)(self.m, tokens, positions)

    from dsv4_model.model.decode_options import DEFAULT as DEFAULT_OPTIONS
    from dsv4_model.runtime.compiled_prefill import _chunk
    from dsv4_model.runtime.dspark_speculative import dspark_step
    from dsv4_model.runtime.speculative import Sampler, verify_step

    inputs = (tokens, positions, starts) if S and args.chunk else (tokens, positions)

    t = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(Step(), inputs, strict=False)
    from torch._inductor.decomposition import select_decomp_table

    ep = ep.run_decompositions(select_decomp_table())
    ops = Counter(str(n.target) for n in ep.graph.nodes if str(n.target).startswith("dsv4."))
    print(f"export + decompositions: {time.perf_counter() - t:.1f} s; dsv4 ops: {dict(ops)}", flush=True)
    pretend_cuda()
    if not args.no_register:
        from dsv4_ops.inductor import register_inductor_fallbacks

        register_inductor_fallbacks()
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.graph as graph
    import torch._inductor.ir as ir

    implicit, formatted = [], Counter()
    make_fallback, str_helper, run, codegen = graph.make_fallback, ir.IRNode.str_helper, graph.GraphLowering.run, \
        graph.GraphLowering.codegen

    def spy_fallback(op, *a, **k):
        implicit.append(str(op))
        return make_fallback(op, *a, **k)

    def spy_str(self, *a, **k):
        formatted[type(self).__name__] += 1
        return str_helper(self, *a, **k)

    def timed_run(self, *a):
        t0 = time.perf_counter()
        out = run(self, *a)
        print(f"lowering: {time.perf_counter() - t0:.1f} s; implicit fallbacks: {implicit}; "
              f"IR nodes formatted: {sum(formatted.values())}", flush=True)
        return out

    class Done(Exception):
        pass

    def timed_codegen(self, *a, **k):
        t0 = time.perf_counter()
        out = codegen(self, *a, **k)
        code = out[0] if isinstance(out, tuple) else out
        code = getattr(code, "value", code)
        kernels = str(code).count("async_compile.triton(")
        if args.code:
            with open(args.code, "w") as f:
                f.write(str(code))
        launches = len(re.findall(r"\.run\(", str(code)))
        # a call's own line (not the comments, not the size / alignment asserts on its outputs)
        op_calls = len(re.findall(r"^\s*(?:[\w, ]+=\s*)?torch\.ops\.dsv4\.\w+\.\w+\(", str(code), re.M))
        print(f"scheduling + Triton codegen: {time.perf_counter() - t0:.1f} s; the step launches {launches} "
              f"Triton kernels ({kernels} distinct) and calls {op_calls} dsv4 ops", flush=True)
        raise Done

    graph.make_fallback, ir.IRNode.str_helper = spy_fallback, spy_str
    graph.GraphLowering.run, graph.GraphLowering.codegen = timed_run, timed_codegen
    print(f"torch {torch.__version__}", flush=True)
    try:
        with fake:
            compile_fx.compile_fx(ep.module(), list(inputs))
    except Exception as e:  # Inductor wraps what codegen raises
        if not isinstance(e, Done) and not isinstance(getattr(e, "inner_exception", None), Done) \
                and "Done" not in repr(e):
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

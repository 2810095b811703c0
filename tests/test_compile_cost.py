"""What made the default model's bf16 decode never finish compiling on the H200, kept out (dsv4_ops/inductor.py).

torch 2.11 (the GPU machine's) formats a custom op's IR arguments eagerly when Inductor makes the op an implicit
fallback, and IR text grows exponentially with the depth of the graph behind the arguments: once the MoE rows fold
left the last layer as the first caller of `nvfp4_moe`, that string took > 13 minutes (reproduced on the CPU
machine with torch 2.11 lowering the step for a fake CUDA device; with the fallbacks registered: 1.8 s). torch 2.13
(CI's) formats lazily, so the blow-up itself does not show here; its cause does: a dsv4 op lowered through the
implicit-fallback path, or any IR node formatted while the step compiles. Both are asserted absent while Inductor
compiles the very step that hung (the default model, bf16, NVFP4 weights, MoE rows folded), caches off.
"""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR
from dsv4_model.runtime.compiled import DecodeRunner
from dsv4_model.runtime.engine import Engine
from dsv4_ops.inductor import dsv4_op_overloads, register_inductor_fallbacks


def test_every_dsv4_op_has_an_inductor_lowering_once_registered():
    from torch._inductor import lowering

    ops = dsv4_op_overloads()
    assert len(ops) >= 20  # the whole schema table, not an empty scan
    register_inductor_fallbacks()
    assert [op for op in ops if op not in lowering.lowerings] == []


def test_default_model_bf16_decode_compiles_without_implicit_fallbacks_or_ir_formatting(monkeypatch):
    import torch._inductor.config as inductor_config
    import torch._inductor.graph as inductor_graph
    import torch._inductor.ir as inductor_ir

    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.bfloat16, max_batch_size=1,
                                 max_seq_len=256, quant="nvfp4", progress=False)
    implicit, formatted = [], []
    make_fallback, str_helper = inductor_graph.make_fallback, inductor_ir.IRNode.str_helper

    def spy_fallback(op, *args, **kwargs):
        implicit.append(str(op))
        return make_fallback(op, *args, **kwargs)

    def spy_str(self, *args, **kwargs):
        formatted.append(type(self).__name__)
        return str_helper(self, *args, **kwargs)

    monkeypatch.setattr(inductor_graph, "make_fallback", spy_fallback)
    monkeypatch.setattr(inductor_ir.IRNode, "str_helper", spy_str)
    _unregister(monkeypatch)  # what the runner must do itself, whatever ran in this process before
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        runner = DecodeRunner(eng.model, compile=True)
        runner.prepare(1)
    # the NVFP4 MoE in every layer, rows folded into the next layer: the configuration that hung
    assert all(block.ffn.backend.quantized for block in eng.model.layers)
    assert [op for op in implicit if op.startswith("dsv4.")] == []
    assert formatted == []
    runner.begin(torch.zeros(1, dtype=torch.long), [_greedy()])
    logits, _ = runner.step()
    assert torch.isfinite(logits).all()


def _unregister(monkeypatch):
    from torch._inductor import lowering

    import dsv4_ops.inductor

    for op in dsv4_op_overloads():
        monkeypatch.delitem(lowering.lowerings, op, raising=False)
    monkeypatch.setattr(dsv4_ops.inductor, "_registered", False)


def _greedy():
    from dsv4_model.runtime.sampling import SamplingParams

    return SamplingParams(0.0, 0, 1.0, 0)


@pytest.mark.cuda
def test_cuda_default_model_bf16_decode_compiles_without_implicit_fallbacks(monkeypatch):
    import torch._inductor.graph as inductor_graph

    eng = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cuda", dtype=torch.bfloat16, max_batch_size=1,
                                 max_seq_len=256, progress=False)
    implicit = []
    make_fallback = inductor_graph.make_fallback
    monkeypatch.setattr(inductor_graph, "make_fallback",
                        lambda op, *a, **k: (implicit.append(str(op)), make_fallback(op, *a, **k))[1])
    _unregister(monkeypatch)
    torch._dynamo.reset()
    runner = DecodeRunner(eng.model)
    runner.prepare(1)
    assert [op for op in implicit if op.startswith("dsv4.")] == []

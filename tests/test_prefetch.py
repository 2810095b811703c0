"""dsv4::prefetch_l2 (a cache hint: bring weights into the GPU's L2 ahead of their readers): its one observable
effect, the marker (the bytes asked for), against the reference on both devices; nothing else changes; the
argument errors; opcheck; kept by torch.compile (a mutating op, not dead code) in the place the model put it;
inside a captured CUDA graph with no host sync."""
import pytest
import torch

import dsv4_ops  # noqa: F401
from dsv4_ops import reference as ref
from dsv4_ops.limits import LIMITS

ops = torch.ops.dsv4
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.kernels])]


def weights(device):
    """Tensors of the kinds the model asks for: packed NVFP4 bytes, scale bytes, an fp32 scalar, a bf16 matrix
    (sizes not a multiple of the kernel's 16-byte granule or of its 32 KB piece), an empty one, a contiguous view
    at an odd offset."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randint(0, 255, (3 * 32768 + 5,), dtype=torch.uint8, generator=gen)
    return [t.to(device) for t in (torch.randint(0, 255, (64, 40), dtype=torch.uint8, generator=gen),
                                   torch.randint(0, 255, (64, 5), dtype=torch.uint8, generator=gen),
                                   torch.tensor(0.5), torch.randn(33, 7, generator=gen).bfloat16(),
                                   torch.empty(0, 4))] + [big.to(device)[3:]]


@pytest.mark.parametrize("device", DEVICES)
def test_marker_is_the_bytes_and_nothing_else_changes(device):
    ws = weights(device)
    before = [w.clone() for w in ws]
    after = torch.randn(4, device=device)
    got, want = torch.full((1,), -1, dtype=torch.long, device=device), torch.full((1,), -1, dtype=torch.long)
    ops.prefetch_l2(after, ws, got)
    ref.prefetch_l2_ref(after.cpu(), [w.cpu() for w in ws], want)
    assert int(got) == int(want) == sum(w.numel() * w.element_size() for w in ws)
    assert all(torch.equal(w, b) for w, b in zip(ws, before))
    ops.prefetch_l2(after, [], got)  # no weights: nothing asked for
    assert int(got) == 0


def test_bad_arguments():
    after, marker = torch.zeros(1), torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="marker must be a contiguous int64 tensor of one element"):
        ops.prefetch_l2(after, [torch.zeros(4)], torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"weights\[1\] must be contiguous"):
        ops.prefetch_l2(after, [torch.zeros(4), torch.zeros(4, 4).t()], marker)
    n = LIMITS.prefetch_max_tensors
    with pytest.raises(RuntimeError, match=f"at most {n} weights per call, got {n + 1}"):
        ops.prefetch_l2(after, [torch.zeros(1)] * (n + 1), marker)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(ops.prefetch_l2.default,
                          (torch.randn(3, device=device), weights(device), torch.zeros(1, dtype=torch.long,
                                                                                         device=device)))


def test_compile_keeps_the_op_in_place():
    """A mutating op is never dead code to torch.compile, and it runs after the value it names (`after`), before
    that value's consumer (the generated code, in order)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(8, 8))
            self.register_buffer("marker", torch.zeros(1, dtype=torch.long))

        def forward(self, x):
            h = torch.ops.dsv4.hc_sinkhorn(x * 2, 3, 1e-6)  # an extern op the prefetch must follow
            ops.prefetch_l2(h, [self.w], self.marker)
            return torch.ops.dsv4.hc_sinkhorn(h @ self.w, 3, 1e-6)

    counters.clear()
    m = Step()
    x = torch.randn(2, 8, 8).abs()
    out, (code,) = run_and_get_code(torch.compile(m, fullgraph=True), x)
    torch.testing.assert_close(out, Step.forward(m, x))
    assert int(m.marker) == 8 * 8 * 4
    import re
    calls = [(m.start(), m.group(1)) for m in re.finditer(r"torch\.ops\.dsv4\.(\w+)\.default\(", code)]
    assert [name for _, name in calls] == ["hc_sinkhorn", "prefetch_l2", "hc_sinkhorn"], code
    assert calls[1][0] < code.index("extern_kernels.mm"), "the prefetch is issued before the weight's reader"
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.kernels
def test_cuda_graph_replay_and_no_sync():
    ws = weights("cuda")
    marker = torch.zeros(1, dtype=torch.long, device="cuda")
    after = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.prefetch_l2(after, ws, marker)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.prefetch_l2(after, ws[:2], marker)
    marker.zero_()
    g.replay()
    assert int(marker) == sum(w.numel() for w in ws[:2])


# ---- the model's use: DecodeOptions(prefetch=True) (an experiment, off by default)
def _model():
    from dsv4_model.checkpoint.writer import TINY_CONFIG
    from dsv4_model.model.config import ModelConfig
    from dsv4_model.model.transformer import Transformer
    from dsv4_model.quant.random_model import init_random_weights

    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 3, "compress_ratios": [0, 4, 16]}).validate()
    return init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=40, dtype=torch.float32), 5), cfg


def test_model_decode_with_prefetch_gives_the_same_logits(monkeypatch):
    """Three calls per layer and step (the attention's inputs ahead of mHC, its output projection ahead of the
    attention, the router + shared expert ahead of the second mHC), each after the value it names; logits bit
    for bit those of the default step (no value changes), eager and compiled."""
    from dsv4_model.model.decode_options import DecodeOptions

    m, cfg = _model()
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    m.prefill(ids)
    state = {k: v.clone() for k, v in m.state_dict(keep_vars=False).items()}
    calls = []
    real = torch.ops.dsv4.prefetch_l2

    def counting(after, weights, marker):
        calls.append(sum(w.numel() * w.element_size() for w in weights))
        return real(after, weights, marker)

    def steps(opts, fn):
        m.load_state_dict(state, strict=False)
        m.prefill(ids)
        return torch.stack([fn(ids[:, t], torch.full((2,), 13 + t), opts) for t in range(4)])

    plain = steps(DecodeOptions(), m.decode_step)
    monkeypatch.setattr(torch.ops.dsv4, "prefetch_l2", counting)
    with_prefetch = steps(DecodeOptions(prefetch=True), m.decode_step)
    assert torch.equal(with_prefetch, plain)
    assert len(calls) == 4 * 3 * cfg.n_layers
    last = m.layers[-1].ffn.first_weights()
    assert int(m.step_scratch.prefetch_marker) == calls[-1] == sum(w.numel() * w.element_size() for w in last)
    first = m.layers[0].attn
    assert calls[0] == sum(w.numel() * w.element_size() for w in first.input_weights())
    assert calls[1] == sum(w.numel() * w.element_size() for w in first.output_weights())
    monkeypatch.undo()
    compiled = torch.compile(m.decode_step, fullgraph=True)
    torch.testing.assert_close(steps(DecodeOptions(prefetch=True), compiled), plain, rtol=1e-5, atol=1e-5)

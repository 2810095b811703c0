"""model.decode_step traces as ONE graph under torch.compile(fullgraph=True, dynamic=False) and matches eager.

Default backend "eager" checks Dynamo (graph breaks, no .item(), static shapes) cheaply; the slow variant runs
aot_eager (functionalization of the in-place cache writes). The inductor / CUDA-graph runs live with generate."""

import pytest
import torch

from dsv4_model.model import Transformer

from hf_utils import one_thread, tiny_config  # noqa: F401


def _model():
    # SWA + CSA (indexer) + HCA; 2 Sinkhorn iterations keep tracing cheap
    cfg = tiny_config(n_layers=3, compress_ratios=[0, 4, 8], n_mtp_layers=0, n_hash_layers=1, hc_sinkhorn_iters=2)
    return Transformer(cfg, max_batch_size=3, max_seq_len=48, dtype=torch.float32,
                       simulate_quant=True).init_random_weights(0)


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_decode_step_fullgraph_no_breaks(backend):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    m = _model()
    ids = torch.randint(0, m.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    lens = torch.tensor([11, 6])  # rows at different positions: windows close at different steps
    m.prefill(ids[:, :11], lens)
    ref = [m.decode_step(ids[:, 11 + i], lens + i) for i in range(5)]
    m.prefill(ids[:, :11], lens)
    step = torch.compile(m.decode_step, fullgraph=True, dynamic=False, backend=backend)
    for i in range(5):
        out = step(ids[:, 11 + i], lens + i)
        assert torch.allclose(out, ref[i], atol=1e-5, rtol=1e-5), i
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1  # new positions never recompile


def test_hc_pre_compiled_sinkhorn_is_the_same_math():
    """Under torch.compile hc_pre runs the Sinkhorn with one tensor per matrix entry (so Inductor fuses the
    iterations into one kernel instead of one per normalisation): the same values as the [..., hc, hc] loop --
    bit-identical on the CPU, where torch.sum adds these 4-element rows in index order -- and compiled hc_pre
    equals eager hc_pre. A transposed normalisation or a dropped eps would not."""
    from dsv4_model import layers

    g = torch.Generator().manual_seed(3)
    comb = torch.softmax(torch.randn(5, 3, 4, 4, generator=g) * 4, -1) + 1e-6
    ref = comb / (comb.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        ref = ref / (ref.sum(-1, keepdim=True) + 1e-6)
        ref = ref / (ref.sum(-2, keepdim=True) + 1e-6)
    assert torch.equal(layers._sinkhorn_unrolled(comb, 20, 1e-6), ref)
    assert not torch.equal(layers._sinkhorn_unrolled(comb.transpose(-1, -2), 20, 1e-6), ref)

    hc, d = 4, 64
    x = torch.randn(3, hc, d, generator=g).to(torch.bfloat16)
    fn = torch.randn(hc * (2 + hc), hc * d, generator=g) * 0.05
    scale, base = torch.rand(3, generator=g), torch.randn(hc * (2 + hc), generator=g)
    args = (fn, scale, base, hc, 20, 1e-6, 1e-6)
    torch._dynamo.reset()
    sums = []

    def backend(gm, example_inputs):  # the traced graph: the unrolled form has no per-iteration sum
        sums.append(sum(1 for node in gm.graph.nodes if "sum" in str(node.target)))
        return gm.forward

    compiled = torch.compile(lambda t: layers.hc_pre(t, *args), fullgraph=True, backend=backend)
    for got, want in zip(compiled(x), layers.hc_pre(x, *args)):
        assert torch.equal(got, want)
    assert sums and sums[0] <= 2, sums  # the loop form traces 39 sums for 20 iterations

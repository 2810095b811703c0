"""model.decode_step traces as ONE graph under torch.compile(fullgraph=True, dynamic=False) and matches eager.

Default backend "eager" checks Dynamo (graph breaks, no .item(), static shapes) cheaply; the slow variant runs
aot_eager (functionalization of the in-place cache writes). The inductor / CUDA-graph runs live with generate."""

import pytest
import torch

from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

from hf_utils import one_thread, tiny_config  # noqa: F401


def _model():
    # SWA + CSA (indexer) + HCA; 2 Sinkhorn iterations keep tracing cheap
    cfg = tiny_config(n_layers=3, compress_ratios=[0, 4, 8], n_mtp_layers=0, n_hash_layers=1, hc_sinkhorn_iters=2)
    return init_random_weights(Transformer(cfg, max_batch_size=3, max_seq_len=48, dtype=torch.float32,
                                           simulate_quant=True), 0)


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

"""Engine request validation (ValueError before any compute), positions bookkeeping, from_pretrained fallback."""

import pytest
import torch

from dsv4_model.runtime.engine import Engine
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

from hf_utils import one_thread, tiny_config  # noqa: F401


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(n_layers=2, compress_ratios=[4, 8, 0], n_hash_layers=1)
    return init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=32, dtype=torch.float32,
                                           simulate_quant=False), 0)


class _Spy:
    """Wraps the model entry points to prove validation happens before compute."""

    def __init__(self, m):
        self.m, self.calls = m, 0

    def __getattr__(self, name):
        attr = getattr(self.m, name)
        if name in ("prefill", "decode_step"):
            def wrapped(*a, **k):
                self.calls += 1
                return attr(*a, **k)
            return wrapped
        return attr


@pytest.mark.parametrize("ids, lengths, match", [
    (torch.zeros(1, 33, dtype=torch.long), None, "max_seq_len"),
    (torch.zeros(3, 4, dtype=torch.long), None, "max_batch_size"),
    (torch.tensor([[1, 2, 512]]), None, "512"),
    (torch.tensor([[1, -3, 2]]), None, "-3"),
    (torch.tensor([[1.0, 2.0]]), None, "integer"),
    (torch.zeros(4, dtype=torch.long), None, "2-D"),
    (torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 0]), "lengths"),
    (torch.zeros(2, 5, dtype=torch.long), torch.tensor([5, 6]), "lengths"),
    (torch.zeros(2, 5, dtype=torch.long), torch.tensor([5]), "lengths"),
])
def test_prefill_rejects_before_compute(model, ids, lengths, match):
    spy = _Spy(model)
    eng = Engine(spy, model.config)
    with pytest.raises(ValueError, match=match):
        eng.prefill(ids, lengths=lengths)
    assert spy.calls == 0


def test_padding_values_outside_vocab_are_ignored(model):
    eng = Engine(model)
    ids = torch.tensor([[5, 6, 7, -1, 999], [5, 6, 7, 8, 9]])
    out = eng.prefill(ids, lengths=torch.tensor([3, 5]))
    ref = Engine(model).prefill(ids[:1, :3])
    assert torch.allclose(out[0], ref[0], atol=1e-5)
    assert eng.lengths == [3, 5] and eng.positions.tolist() == [3, 5]


def test_decode_validation_and_positions(model):
    spy = _Spy(model)
    eng = Engine(spy, model.config)
    with pytest.raises(ValueError, match="before prefill"):
        eng.decode(torch.tensor([1]))
    eng.prefill(torch.tensor([[1, 2, 3], [4, 5, 0]]), lengths=torch.tensor([3, 2]))
    calls = spy.calls
    for bad, match in [(torch.tensor([1]), "shape"), (torch.tensor([1, 512]), "512"), (torch.tensor([-1, 0]), "-1")]:
        with pytest.raises(ValueError, match=match):
            eng.decode(bad)
    assert spy.calls == calls
    eng.decode(torch.tensor([7, 8]))
    assert eng.lengths == [4, 3] and eng.positions.tolist() == [4, 3]
    while max(eng.lengths) < 32:
        eng.decode(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.decode(torch.tensor([1, 1]))
    eng.reset()
    assert eng.lengths == [] and eng.positions.tolist() == [0, 0]


def test_from_pretrained_round_trip(tmp_path, model):
    from safetensors.torch import save_file

    cfg = model.config
    cfg.to_json(tmp_path / "config.json")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    # per-expert official layout on disk; the loader stacks them
    for k in [k for k in sd if k.endswith(("experts.w1", "experts.w2", "experts.w3"))]:
        w = sd.pop(k)
        base, name = k.rsplit(".", 1)
        for e in range(w.shape[0]):
            sd[f"{base}.{e}.{name}.weight"] = w[e].clone()
    save_file(sd, str(tmp_path / "model.safetensors"))
    eng = Engine.from_pretrained(str(tmp_path), dtype=torch.float32, max_batch_size=1, max_seq_len=32,
                                 simulate_quant=False)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5]])
    assert torch.allclose(eng.prefill(ids), Engine(model).prefill(ids), atol=1e-6)

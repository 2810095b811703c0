"""DecodeOptions: parsing, and every debug override (each alone, and all together) giving the logits of the shipped
defaults on a model with every attention kind (fp32: to summation-order rounding)."""
import dataclasses

import pytest
import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.decode_options import DecodeOptions
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

BOOL_OPTIONS = [f.name for f in dataclasses.fields(DecodeOptions) if f.type in (bool, "bool")]


def test_parse():
    assert DecodeOptions.parse("") == DecodeOptions()
    assert DecodeOptions.parse("hc_pre=0, attention=torch") == DecodeOptions(hc_pre=False, attention="torch")
    assert DecodeOptions.parse("hc_pre=1") == DecodeOptions()
    for bad in ("hc_pre", "nope=0", "hc_pre=off", "norm_rope=0"):
        with pytest.raises(ValueError, match="decode option"):
            DecodeOptions.parse(bad)
    assert BOOL_OPTIONS == ["hc_pre"]


def _logits(opts, steps=6):
    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, "n_layers": 3, "compress_ratios": [0, 4, 16]}).validate()
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    m = init_random_weights(Transformer(cfg, max_batch_size=2, max_seq_len=40, dtype=torch.float32), 5)
    m.prefill(ids)
    return torch.stack([m.decode_step(ids[:, t], torch.full((2,), 13 + t), opts) for t in range(steps)])


@pytest.fixture(scope="module")
def shipped():
    return _logits(DecodeOptions())


@pytest.mark.parametrize("off", BOOL_OPTIONS + ["attention=torch", "attention=fused", "all"])
def test_every_override_gives_the_shipped_logits(shipped, off):
    flipped = {name: not getattr(DecodeOptions(), name) for name in BOOL_OPTIONS}  # each away from its default
    if off == "all":
        opts = DecodeOptions(attention="torch", **flipped)
    elif off.startswith("attention="):
        opts = DecodeOptions(attention=off.split("=")[1])
    else:
        opts = DecodeOptions(**{off: flipped[off]})
    torch.testing.assert_close(_logits(opts), shipped, rtol=1e-4, atol=1e-4)

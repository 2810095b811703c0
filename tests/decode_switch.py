"""A tiny random model's decode steps with one of the decode step's options off ("0") and on ("1"): the logits of
each, and how often the op ran, for the tests that check a fused decode op against the steps it replaces."""
import dataclasses

import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.decode_options import DecodeOptions
from dsv4_model.model.transformer import Transformer


def decode_with_switch(monkeypatch, op: str, option: str, *, steps: int, device: str = "cpu",
                       dtype: torch.dtype = torch.float32, max_seq_len: int = 40,
                       base: DecodeOptions = DecodeOptions(), **fields):
    """(logits {"0", "1"}: fp32 CPU [steps, 2, V], calls {"0", "1"}: how many times torch.ops.dsv4.<op> ran in the
    decode steps, cfg). The model: TINY_CONFIG with `fields`, batch 2, a 13-token prefill, then `steps` steps with
    `base` but `option` off / on."""
    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, **fields}).validate()
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    real, count = getattr(torch.ops.dsv4, op), []
    monkeypatch.setattr(torch.ops.dsv4, op, lambda *a: count.append(1) or real(*a))
    logits, calls = {}, {}
    for mode in ("0", "1"):
        opts = dataclasses.replace(base, **{option: mode == "1"})
        m = Transformer(cfg, max_batch_size=2, max_seq_len=max_seq_len, dtype=dtype, device=device)
        m.init_random_weights(5)
        m.prefill(ids.to(device))
        count.clear()
        logits[mode] = torch.stack([m.decode_step(ids[:, t].to(device), torch.full((2,), 13 + t, device=device),
                                                  opts) for t in range(steps)]).float().cpu()
        calls[mode] = len(count)
    return logits, calls, cfg

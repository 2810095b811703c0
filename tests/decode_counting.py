"""A tiny random model's decode steps with one dsv4 op counted, and the same tokens' logits from one prefill of the
whole sequence (the tensor-op path prefill takes): for the tests that check a fused decode op inside the model."""
import torch

from dsv4_model.checkpoint.writer import TINY_CONFIG
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.decode_options import DecodeOptions
from dsv4_model.model.transformer import Transformer
from dsv4_model.quant.random_model import init_random_weights

PROMPT = 13


def decode_counting(monkeypatch, op: str, *, steps: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                    max_seq_len: int = 40, options: DecodeOptions = DecodeOptions(), **fields):
    """(decode fp32 CPU [steps, 2, V], prefill fp32 CPU [steps, 2, V], calls: how many times torch.ops.dsv4.<op>
    ran in the decode steps, cfg). The model: TINY_CONFIG with `fields`, batch 2, a PROMPT-token prefill, then
    `steps` decode steps with `options` feeding fixed random tokens; prefill: the whole sequence at once, teacher
    forced, its logits at the decoded positions."""
    cfg = ModelConfig(**{**TINY_CONFIG, "n_mtp_layers": 0, **fields}).validate()
    ids = torch.randint(0, cfg.vocab_size, (2, PROMPT + steps), generator=torch.Generator().manual_seed(3))
    real, count = getattr(torch.ops.dsv4, op), []
    monkeypatch.setattr(torch.ops.dsv4, op, lambda *a: count.append(1) or real(*a))
    m = Transformer(cfg, max_batch_size=2, max_seq_len=max_seq_len, dtype=dtype, device=device)
    init_random_weights(m, 5)
    full = m.prefill(ids.to(device), all_logits=True)[:, PROMPT:].transpose(0, 1).float().cpu()
    m.prefill(ids[:, :PROMPT].to(device))
    count.clear()
    decode = torch.stack([m.decode_step(ids[:, PROMPT + t].to(device), torch.full((2,), PROMPT + t, device=device),
                                        options) for t in range(steps)]).float().cpu()
    return decode, full, len(count), cfg

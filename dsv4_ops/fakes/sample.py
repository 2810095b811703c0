"""Fake for dsv4::sample: one int64 token id per row; never reads data."""
import torch


def _sample_fake(logits, temperature, top_k, top_p, seed, offset):
    torch._check(logits.dim() == 2, lambda: f"dsv4::sample: logits must be [B, V], got {tuple(logits.shape)}")
    torch._check(logits.dtype == torch.float32, lambda: f"dsv4::sample: logits must be float32, got {logits.dtype}")
    B = logits.shape[0]
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int64),
        ("top_p", top_p, torch.float32),
        ("seed", seed, torch.int64),
        ("offset", offset, torch.int64),
    ):
        torch._check(t.dim() == 1 and t.shape[0] == B, lambda: f"dsv4::sample: {name} must have shape [B]")
        torch._check(t.dtype == dtype, lambda: f"dsv4::sample: {name} must be {dtype}, got {t.dtype}")
    return logits.new_empty((B,), dtype=torch.int64)


torch.library.register_fake("dsv4::sample")(_sample_fake)

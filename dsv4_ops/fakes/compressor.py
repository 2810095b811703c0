"""Fake for dsv4::compressor_decode: mutates kv_state, score_state and pooled (fp32, or the pooling rounded to bf16
/ fp16) in place, returns nothing."""
import torch


def _compressor_decode_fake(kv, score, ape, positions, kv_state, score_state, pooled, kv_batch=0):
    op = "dsv4::compressor_decode"
    for name, t in (("kv", kv), ("score", score), ("ape", ape), ("kv_state", kv_state),
                    ("score_state", score_state)):
        torch._check(t.dtype == torch.float32, lambda: f"{op}: {name} must be float32, got {t.dtype}")
    torch._check(pooled.dtype in (torch.float32, torch.bfloat16, torch.float16),
                 lambda: f"{op}: pooled must be float32, bfloat16 or float16, got {pooled.dtype}")
    torch._check(kv.dim() == 2 and score.shape == kv.shape, lambda: f"{op}: kv and score must be [B, C]")
    B, C = kv.shape
    torch._check(ape.dim() == 2 and ape.shape[1] == C, lambda: f"{op}: ape must be [m, C]")
    m = ape.shape[0]
    torch._check(positions.dtype in (torch.int64, torch.int32) and positions.shape == (B,),
                 lambda: f"{op}: positions must be int64 / int32 [B]")
    torch._check(pooled.dim() == 2 and pooled.shape[0] == B and (pooled.shape[1] == C or 2 * pooled.shape[1] == C),
                 lambda: f"{op}: pooled must be [B, C or C / 2]")
    cm = 2 * m if 2 * pooled.shape[1] == C else m  # overlapping windows: pooled is half as wide as kv
    torch._check(kv_batch == 0 or (kv_batch > 0 and B % kv_batch == 0),
                 lambda: f"{op}: kv_batch must be 0 or divide B = {B}, got {kv_batch}")
    torch._check(kv_state.dim() == 3 and kv_state.shape[0] >= (kv_batch or B) and kv_state.shape[2] == C
                 and kv_state.shape[1] >= cm, lambda: f"{op}: kv_state must be [>= B (kv_batch), >= {cm}, C]")
    torch._check(score_state.shape == kv_state.shape, lambda: f"{op}: score_state must match kv_state")


torch.library.register_fake("dsv4::compressor_decode")(_compressor_decode_fake)

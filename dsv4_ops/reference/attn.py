"""Decode attention reference (dsv4::sparse_attn_decode)."""
import torch

from ._helpers import _rope_rows


def sparse_attn_decode_ref(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                           scale: float, out_rope=None, rope_dim: int = 0, idx2=None,
                           idx2_offset: int = 0, kv_batch: int = 0) -> torch.Tensor:
    """q [B, H, D] against the rows idx [B, J] of kv [B' >= B, N, D] (entries outside [0, N) skipped): fp32 scores
    times scale, one softmax together with the per-head sink [H], the fp32 weighted sum of the rows (K = V), in
    q's dtype (dsv4_model.model.attention.Attention._attend's steps); with out_rope [B, rope_dim / 2, (cos, sin)] the
    inverse RoPE of the trailing rope_dim dims, rounded again (Attention._out's first step). idx2 [B, J2]: more
    rows, idx2 + idx2_offset where idx2 >= 0 (negative: none), listed after idx. kv_batch > 0: row b of q reads
    kv[b % kv_batch] (T tokens of kv_batch sequences, token-major)."""
    if kv_batch:
        kv = kv[:kv_batch].repeat(q.shape[0] // kv_batch, 1, 1)
    if idx2 is not None:
        idx2 = idx2.long()
        idx = torch.cat([idx.long(), torch.where(idx2 >= 0, idx2 + idx2_offset, -1)], dim=1)
    out = _sparse_attn(q, kv, idx, sink, scale)
    if out_rope is None:
        return out
    return _rope_rows(out, out_rope, rope_dim, inverse=True)


def _sparse_attn(q, kv, idx, sink, scale):
    B, D, N = q.shape[0], q.shape[2], kv.shape[1]
    valid = (idx >= 0) & (idx < N)
    rows = torch.where(valid, idx, torch.zeros_like(idx)).long()
    keys = kv[:B].float().gather(1, rows.unsqueeze(-1).expand(-1, -1, D))
    s = torch.einsum("bhd,bjd->bhj", q.float(), keys).masked_fill(~valid.unsqueeze(1), float("-inf")) * scale
    p = torch.cat([s, sink.float().view(1, -1, 1).expand(B, -1, 1)], dim=-1).softmax(dim=-1)
    return torch.einsum("bhj,bjd->bhd", p[..., :-1], keys).to(q.dtype)

"""Fakes for dsv4::indexer_score_topk (int32 [B, topk] indices), dsv4::indexer_prefill_scores (fp32 [B, S, T]) and
dsv4::indexer_topk (int64 [..., topk]); never read data."""
import torch


def _indexer_score_topk_fake(q, weights, k_codes, k_scales, n_valid, topk, weights_scale=1.0, weights_dtype=None,
                             kv_batch=0):
    torch._check(q.dim() == 3, lambda: f"dsv4::indexer_score_topk: q must be [B, H, D], got {tuple(q.shape)}")
    torch._check(q.dtype in (torch.bfloat16, torch.float32),
                 lambda: f"dsv4::indexer_score_topk: q must be bfloat16 or float32, got {q.dtype}")
    B, H, D = q.shape
    torch._check(D % 32 == 0, lambda: "dsv4::indexer_score_topk: D must be a multiple of 32")
    torch._check(weights.dim() == 2 and weights.shape[0] == B and weights.shape[1] == H,
                 lambda: "dsv4::indexer_score_topk: weights must be [B, H]")
    torch._check(weights.dtype == torch.float32, lambda: "dsv4::indexer_score_topk: weights must be float32")
    torch._check(kv_batch == 0 or (kv_batch > 0 and B % kv_batch == 0),
                 lambda: f"dsv4::indexer_score_topk: kv_batch must be 0 or divide B = {B}, got {kv_batch}")
    S = kv_batch or B  # the sequences whose keys the rows score
    torch._check(k_codes.dim() == 3 and k_codes.shape[0] == S and k_codes.shape[2] * 2 == D,
                 lambda: "dsv4::indexer_score_topk: k_codes must be [B or kv_batch, N, D/2]")
    torch._check(k_codes.dtype == torch.uint8, lambda: "dsv4::indexer_score_topk: k_codes must be uint8")
    N = k_codes.shape[1]
    torch._check(k_scales.dim() == 3 and k_scales.shape[0] == S and k_scales.shape[1] == N
                 and k_scales.shape[2] * 32 == D,
                 lambda: "dsv4::indexer_score_topk: k_scales must be [B or kv_batch, N, D/32]")
    torch._check(k_scales.dtype == torch.uint8, lambda: "dsv4::indexer_score_topk: k_scales must be uint8")
    torch._check(n_valid.dim() == 1 and n_valid.shape[0] == B, lambda: "dsv4::indexer_score_topk: n_valid must be [B]")
    torch._check(n_valid.dtype in (torch.int32, torch.int64),
                 lambda: "dsv4::indexer_score_topk: n_valid must be int32 or int64")
    torch._check(topk >= 0, lambda: "dsv4::indexer_score_topk: topk must be >= 0")
    torch._check(weights_dtype in (None, torch.bfloat16, torch.float16),
                 lambda: "dsv4::indexer_score_topk: weights_dtype must be bfloat16, float16 or None, got "
                 f"{weights_dtype}")
    return q.new_empty((B, topk), dtype=torch.int32)


torch.library.register_fake("dsv4::indexer_score_topk")(_indexer_score_topk_fake)


def _indexer_prefill_scores_fake(q, weights, keys, n_visible):
    op = "dsv4::indexer_prefill_scores"
    torch._check(q.dim() == 4, lambda: f"{op}: q must be [B, S, H, D], got {tuple(q.shape)}")
    torch._check(q.dtype in (torch.bfloat16, torch.float32), lambda: f"{op}: q must be bfloat16 or float32")
    B, S, H, D = q.shape
    torch._check(weights.dim() == 3 and tuple(weights.shape) == (B, S, H), lambda: f"{op}: weights must be [B, S, H]")
    torch._check(weights.dtype == torch.float32, lambda: f"{op}: weights must be float32")
    torch._check(keys.dim() == 3 and keys.shape[0] == B and keys.shape[2] == D, lambda: f"{op}: keys must be [B, T, D]")
    torch._check(keys.dtype == q.dtype, lambda: f"{op}: keys must have q's dtype")
    torch._check(n_visible.dim() == 2 and tuple(n_visible.shape) == (B, S), lambda: f"{op}: n_visible must be [B, S]")
    torch._check(n_visible.dtype == torch.int64, lambda: f"{op}: n_visible must be int64")
    return q.new_empty((B, S, keys.shape[1]), dtype=torch.float32)


torch.library.register_fake("dsv4::indexer_prefill_scores")(_indexer_prefill_scores_fake)


def _indexer_topk_fake(scores, topk):
    op = "dsv4::indexer_topk"
    torch._check(scores.dim() >= 1, lambda: f"{op}: scores must be [..., N], got {tuple(scores.shape)}")
    torch._check(scores.dtype == torch.float32, lambda: f"{op}: scores must be float32, got {scores.dtype}")
    torch._check(1 <= topk <= scores.shape[-1], lambda: f"{op}: topk must be in [1, N], got {topk}")
    return scores.new_empty((*scores.shape[:-1], topk), dtype=torch.int64)


torch.library.register_fake("dsv4::indexer_topk")(_indexer_topk_fake)

"""DeepSeek-V4's lightning indexer: per CSA layer, the top index_topk compressed entries a token attends, scored
from FP4 queries and keys.

Top-k order (documented choice): higher score first, equal scores -> lower entry index, -0.0 == +0.0. Only the
selected SET matters to attention; this makes it deterministic across devices."""

from __future__ import annotations

import torch
from torch import nn

from dsv4_ops import ops, supports

from dsv4_model.model.compressor import Compressor, scatter_entries
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.layers import Linear, apply_rope
from dsv4_model.model.quant_sim import fp4_pack_indexer_keys, indexer_fake_quant


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest fp32 scores along the last dim; ties -> lower index (static shapes)."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores).float().contiguous()
    bits = s.view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    n = scores.shape[-1]
    idx = torch.arange(n, device=scores.device, dtype=torch.int64)
    # (n - 1 - idx), not (2**32 - 1 - idx): Inductor's Triton codegen keeps index constants in int32.
    key = key * 4294967296 + ((n - 1) - idx)
    return key.topk(k, dim=-1).indices


class Indexer(nn.Module):
    """Lightning indexer: score(t, i) = sum_h w[t,h] * relu(qI[t,h] . kI[i]); keeps the top index_topk entries."""

    def __init__(self, cfg: ModelConfig, ratio: int, dtype: torch.dtype, max_batch: int, max_seq_len: int):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.rope_head_dim
        self.index_topk = cfg.index_topk
        self.ratio = ratio
        self.max_batch = max_batch
        self.n_entries = -(-max_seq_len // ratio)  # as Attention's
        self.simulate_quant = True
        self.packed = True  # False: decode scores the float cache with PyTorch ops (the reference path)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype)
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.compressor = Compressor(cfg, ratio, self.head_dim, True, max_batch)

    def alloc_runtime(self, device, dtype: torch.dtype) -> None:
        self.register_buffer("kv_cache", torch.zeros(self.max_batch, self.n_entries, self.head_dim, dtype=dtype,
                                                     device=device), persistent=False)
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("k_codes", torch.zeros(self.max_batch, self.n_entries, self.head_dim // 2, **u8),
                             persistent=False)
        self.register_buffer("k_scales", torch.zeros(self.max_batch, self.n_entries, self.head_dim // 32, **u8),
                             persistent=False)
        # What decode's dsv4 kernels take (dsv4_ops.supports) on this device, for the model dtype and this indexer's
        # widths: asked once here, not in every step.
        self.use_score_op = supports.indexer_score_topk(self.kv_cache.device, self.head_dim, self.n_heads,
                                                        min(self.index_topk, self.n_entries))
        self.use_hadamard_op = supports.hadamard_fp4(dtype, self.head_dim)
        self.use_store_keys_op = supports.indexer_store_keys(dtype, self.head_dim)

    def queries(self, qr: torch.Tensor, cs: torch.Tensor, proj: torch.Tensor | None = None) -> torch.Tensor:
        """qr [..., q_lora] -> [..., H_I, Di]; cs broadcastable to the head axis. proj: wq_b(qr) if already
        computed (Attention runs it in the same launch as its own wq_b)."""
        q = (self.wq_b(qr) if proj is None else proj).unflatten(-1, (self.n_heads, self.head_dim))
        if q.dim() == 3 and self.simulate_quant and self.use_hadamard_op:  # decode: cs [B, 1, rope_dim / 2, 2]
            return ops.hadamard_fp4(q, cs=cs.reshape(q.shape[0], self.rope_dim // 2, 2), rope_dim=self.rope_dim)
        q = apply_rope(q, cs, self.rope_dim)
        if self.simulate_quant:
            q = indexer_fake_quant(q)
        return q

    def packed_decode(self) -> bool:
        """Decode scores the packed FP4 cache with dsv4::indexer_score_topk: the keys are FP4 (simulate_quant)
        and the kernel takes the shape (dsv4_ops.supports). Both paths select the same entries up to fp32 summation
        order."""
        return self.simulate_quant and self.packed and self.use_score_op

    def store_prefill(self, keys: torch.Tensor, entries: torch.Tensor | None = None,
                      write: torch.Tensor | None = None) -> None:
        """keys [B, n, Di] (FP4-rounded) -> entries [B, n] (int64 indices; default 0 .. n - 1) of rows [:B] of
        both caches, in the rows where write [B] (default all; compressor.scatter_entries)."""
        B, n = keys.shape[:2]
        if entries is None:
            entries = torch.arange(n, device=keys.device).expand(B, -1)
        if write is None:
            write = torch.ones(B, dtype=torch.bool, device=keys.device)
        scatter_entries(self.kv_cache, entries, keys, write)
        if self.packed_decode():  # FP4 values: the packed form is exact
            codes, scales = fp4_pack_indexer_keys(keys)
            scatter_entries(self.k_codes, entries, codes, write)
            scatter_entries(self.k_scales, entries, scales, write)

    def select(self, q: torch.Tensor, x: torch.Tensor, n_vis: torch.Tensor, k: int,
               proj: torch.Tensor | None = None, seqs: int | None = None) -> torch.Tensor:
        """Decode top-k over the packed cache: q [B, H_I, Di], x [B, dim], n_vis [B] -> int32 [B, k], -1 past
        the valid entries. proj: the fp32 product of weights_proj (Attention._fp32_projections), not yet rounded
        to the weight's dtype. seqs: the B rows are tokens of that many sequences (row b of sequence b % seqs)."""
        B = seqs or q.shape[0]
        if proj is None:
            w, dtype = self.weights_proj(x).float(), None
        else:  # the op rounds it as the module rounds its output, and scales it: no pointwise kernel of its own
            w, dtype = proj, self.weights_proj.weight.dtype
            dtype = None if dtype == torch.float32 else dtype
        return ops.indexer_score_topk(q, w, k_codes=self.k_codes[:B], k_scales=self.k_scales[:B], n_valid=n_vis,
                                      topk=k, weights_scale=self.weight_scale, weights_dtype=dtype,
                                      kv_batch=seqs or 0)

    def scores(self, q: torch.Tensor, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [B, S, H_I, Di], x [B, S, dim], keys [B, T, Di] -> fp32 [B, S, T]."""
        w = self.weights_proj(x).float() * self.weight_scale
        s = torch.einsum("bshd,btd->bsht", q.float(), keys.float()).relu()
        return (s * w.unsqueeze(-1)).sum(dim=2)

    def prefill_scores(self, q: torch.Tensor, x: torch.Tensor, keys: torch.Tensor,
                       n_vis: torch.Tensor) -> torch.Tensor:
        """scores(q, x, keys), -inf where entry t >= n_vis[b, s] (int64 [B, S]: the entries query s sees). Where
        the kernel takes them (supports.indexer_prefill_scores; no gradient) one dsv4::indexer_prefill_scores: the
        torch form's [B, S, H_I, T] fp32 products never exist (64x the scores at V4's 64 heads)."""
        if (q.dtype == keys.dtype and supports.indexer_prefill_scores(q.device, q.dtype, q.shape[-1])
                and not torch.is_grad_enabled()):
            w = self.weights_proj(x).float() * self.weight_scale
            return ops.indexer_prefill_scores(q, w, keys=keys, n_visible=n_vis)
        t = torch.arange(keys.shape[1], device=keys.device)
        return self.scores(q, x, keys).masked_fill(t >= n_vis.unsqueeze(-1), float("-inf"))

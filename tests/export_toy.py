"""A tiny stand-in LM with the real model's export interface (a test fixture of tests/test_export.py).

Same contract as ``dsv4_model.model.Transformer``: caches are preallocated non-persistent buffers,
``decode_step(tokens[B], positions[B]) -> float32 logits [B, V]`` writes one position per row in place,
``prefill(tokens[B, S], lengths[B]) -> float32 logits [B, V]`` at position lengths[b]-1 fills positions
0..S-1 (right-padded rows: what lies past lengths[b] is masked until decode overwrites it). The key
projection round-trips through NVFP4 (``dsv4::nvfp4_quantize`` / ``nvfp4_dequantize``), so its exported graphs
call dsv4 ops through AOTI's proxy executor.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dsv4_ops import ops


class ToyLM(nn.Module):
    def __init__(self, vocab_size: int = 96, dim: int = 64, *, max_batch_size: int = 2, max_seq_len: int = 32,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0):
        super().__init__()
        import dsv4_ops  # noqa: F401  (the NVFP4 ops)

        if dim % 16:
            raise ValueError("dim must be a multiple of 16 (NVFP4 blocks)")
        g = torch.Generator().manual_seed(seed)
        self.config = {"vocab_size": vocab_size, "dim": dim, "kind": "toy"}
        device = torch.device(device)

        def w(*shape):
            return nn.Parameter((torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(device, dtype),
                                requires_grad=False)

        self.embed = w(vocab_size, dim)
        self.wq, self.wk, self.wv, self.wo = w(dim, dim), w(dim, dim), w(dim, dim), w(vocab_size, dim)
        self.register_buffer("k_cache", torch.zeros(max_batch_size, max_seq_len, dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(max_batch_size, max_seq_len, dim, dtype=dtype, device=device),
                             persistent=False)

    def _keys(self, h: torch.Tensor) -> torch.Tensor:
        k = h @ self.wk.t()
        flat = k.reshape(-1, k.shape[-1])
        gs = flat.abs().amax().float() / 2688 + 1e-12  # 2688 = 448 * 6: amax maps to the largest code
        packed, scales = ops.nvfp4_quantize(flat, gs)
        return ops.nvfp4_dequantize(packed, scales, gs, dtype=k.dtype).reshape(k.shape)

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, options=None) -> torch.Tensor:
        b = tokens.shape[0]
        h = self.embed[tokens]
        rows = torch.arange(b, device=tokens.device)
        self.k_cache.index_put_((rows, positions), self._keys(h))
        self.v_cache.index_put_((rows, positions), h @ self.wv.t())
        k, v = self.k_cache[:b], self.v_cache[:b]
        scores = torch.einsum("bd,bsd->bs", h @ self.wq.t(), k) / math.sqrt(h.shape[-1])
        visible = torch.arange(k.shape[1], device=tokens.device)[None, :] <= positions[:, None]
        attn = scores.float().masked_fill(~visible, float("-inf")).softmax(-1).to(h.dtype)
        out = h + torch.einsum("bs,bsd->bd", attn, v)
        return (out @ self.wo.t()).float()

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        b, t = tokens.shape
        if lengths is None:
            lengths = torch.full((b,), t, dtype=torch.long, device=tokens.device)
        h = self.embed[tokens]
        self.k_cache[:b, :t].copy_(self._keys(h))
        self.v_cache[:b, :t].copy_(h @ self.wv.t())
        k, v = self.k_cache[:b, :t], self.v_cache[:b, :t]
        scores = torch.einsum("btd,bsd->bts", h @ self.wq.t(), k) / math.sqrt(h.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        attn = scores.float().masked_fill(~causal, float("-inf")).softmax(-1).to(h.dtype)
        out = h + torch.einsum("bts,bsd->btd", attn, v)
        last = out[torch.arange(b, device=tokens.device), lengths - 1]
        return (last @ self.wo.t()).float()

"""Indexer key store reference (dsv4::indexer_store_keys)."""
import torch

from .indexer import indexer_fp4_quantize_keys


def indexer_store_keys_ref(keys: torch.Tensor, positions: torch.Tensor, ratio: int, kv_cache: torch.Tensor,
                           k_codes: torch.Tensor, k_scales: torch.Tensor, kv_batch: int = 0) -> None:
    """The decode step's indexer key writes (Attention._write_entry of the key and of its FP4 form, by
    indexer_fp4_quantize_keys): rows whose window closed at this token ((pos + 1) % ratio == 0) get the key at
    slot min(pos // ratio, n - 1) of each cache (row b % kv_batch with kv_batch > 0), in place; the other rows keep
    theirs."""
    B, n = keys.shape[0], kv_cache.shape[1]
    rows = torch.arange(B) % kv_batch if kv_batch else torch.arange(B)
    pos = positions.long().cpu()
    done = (pos + 1) % ratio == 0
    slot = (pos // ratio).clamp(max=n - 1)
    codes, scales = indexer_fp4_quantize_keys(keys)
    for cache, value in ((kv_cache, keys), (k_codes, codes), (k_scales, scales)):
        cache[rows[done], slot[done]] = value[done].to(cache.dtype)

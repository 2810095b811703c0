"""Fake for dsv4::indexer_store_keys: writes the three indexer caches in place, returns nothing."""
import torch


def _indexer_store_keys_fake(keys, positions, ratio, kv_cache, k_codes, k_scales, kv_batch=0):
    op = "dsv4::indexer_store_keys"
    torch._check(keys.dtype in (torch.bfloat16, torch.float32), lambda: f"{op}: keys must be bfloat16 or float32")
    torch._check(keys.dim() == 2 and keys.shape[1] % 32 == 0, lambda: f"{op}: keys must be [B, D], D % 32 == 0")
    B, D = keys.shape
    torch._check(positions.dtype in (torch.int64, torch.int32) and positions.shape == (B,),
                 lambda: f"{op}: positions must be int64 / int32 [B]")
    torch._check(ratio >= 1, lambda: f"{op}: ratio must be >= 1")
    torch._check(kv_batch == 0 or (kv_batch > 0 and B % kv_batch == 0),
                 lambda: f"{op}: kv_batch must be 0 or divide B = {B}, got {kv_batch}")
    torch._check(kv_cache.dtype == keys.dtype and kv_cache.dim() == 3 and kv_cache.shape[0] >= (kv_batch or B)
                 and kv_cache.shape[2] == D, lambda: f"{op}: kv_cache must be [>= B (kv_batch), n, D] in keys' dtype")
    rows, n = kv_cache.shape[0], kv_cache.shape[1]
    torch._check(k_codes.dtype == torch.uint8 and k_codes.shape == (rows, n, D // 2),
                 lambda: f"{op}: k_codes must be uint8 [rows, n, D / 2]")
    torch._check(k_scales.dtype == torch.uint8 and k_scales.shape == (rows, n, D // 32),
                 lambda: f"{op}: k_scales must be uint8 [rows, n, D / 32]")


torch.library.register_fake("dsv4::indexer_store_keys")(_indexer_store_keys_fake)

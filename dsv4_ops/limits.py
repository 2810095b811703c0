"""The shapes the kernels take, read once from the op library (dsv4_ops/csrc/kernel_limits.h, which the kernels'
own checks use), so no caller restates a limit. Plain Python values: the model's shape predicates read them while
torch.compile traces, where a call into the library could not be traced."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from dsv4_ops._loader import library_path

# Candidate head / vector widths for the dimension predicates (the kernels take none beyond).
_DIMS = range(16, 4097, 16)


@dataclass(frozen=True)
class KernelLimits:
    router_max_experts: int  # dsv4::router_topk: E
    router_max_topk: int  # ... and k
    indexer_cuda_head_dim: int  # dsv4::indexer_score_topk's CUDA kernel: D ==
    indexer_cuda_max_heads: int  # ... H <=
    indexer_cuda_max_topk: int  # ... top-k <=
    norm_rope_cuda_max_dim: int  # dsv4::rms_norm_rope(_store)'s CUDA kernel: d <=
    hadamard_fp4_dims: tuple[int, ...]  # dsv4::hadamard_fp4: d in
    store_keys_dims: tuple[int, ...]  # dsv4::indexer_store_keys: D in
    attn_mma_dims: tuple[int, ...]  # dsv4::sparse_attn_decode's tensor-core partial kernel: D in


def _read() -> KernelLimits:
    # Same absolute path as the loaded copy: ctypes gets the already-loaded handle.
    fn = ctypes.CDLL(library_path()).dsv4_ops_kernel_limit
    fn.argtypes, fn.restype = (ctypes.c_char_p, ctypes.c_int64), ctypes.c_int64

    def value(name: str, v: int = 0) -> int:
        out = fn(name.encode(), v)
        if out < 0:
            raise RuntimeError(f"the op library does not know the kernel limit {name!r} (rebuild it)")
        return int(out)

    def dims(name: str) -> tuple[int, ...]:
        return tuple(d for d in _DIMS if value(name, d))

    return KernelLimits(
        router_max_experts=value("router_max_experts"), router_max_topk=value("router_max_topk"),
        indexer_cuda_head_dim=value("indexer_cuda_head_dim"), indexer_cuda_max_heads=value("indexer_cuda_max_heads"),
        indexer_cuda_max_topk=value("indexer_cuda_max_topk"), norm_rope_cuda_max_dim=value("norm_rope_cuda_max_dim"),
        hadamard_fp4_dims=dims("hadamard_fp4_dim"), store_keys_dims=dims("store_keys_dim"),
        attn_mma_dims=dims("attn_mma_dim"))


LIMITS = _read()

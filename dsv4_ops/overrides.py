"""Debug overrides of the CUDA kernels' launch choices (the C++ side: csrc/overrides.h).

The defaults are the shipped choices; tests and benchmarks force the others to run every kernel path at the same
shapes. Process-wide and read at each launch, so a CUDA graph keeps the choices it was captured with.

    with kernel_overrides(nvfp4_gemm_kernel="skinny", pdl=False):
        y = ops.nvfp4_linear(...)
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses

from dsv4_ops._loader import library_path

GEMM_KERNELS = ("auto", "tiled", "cublas", "skinny", "wgmma", "wgmma_wide")
FUSED_PATHS = ("auto", "cluster", "grid")
ATTN_KERNELS = ("auto", "simt", "mma_all_heads", "mma_16_heads", "wgmma")
TOPK_KERNELS = ("auto", "cluster", "rows")
MOE_GEMV_ROWS = (0, 2, 8)  # 0: auto


@dataclasses.dataclass(frozen=True)
class KernelOverrides:
    """nvfp4_gemm_kernel: the NVFP4 linear's kernel path ("auto" picks by shape). pdl: programmatic dependent
    launch of the decode kernels and the NVFP4 chain. moe_local_route: the MoE's up / down kernels route themselves
    at decode sizes (off: the route kernel at every size). attn_kernel: "simt" runs the CUDA-core attention kernel
    where the tensor-core one applies, "mma_all_heads" the tensor-core one with 64 heads per CTA (prefill's form)
    at every size, "mma_16_heads" with 16 (decode's form), "wgmma" the warpgroup-MMA kernel at every size (bf16,
    head dim 512, elsewhere the auto choice; auto runs it at 64+ heads and 2048+ listed keys per call).
    nvfp4_fused_path: the per-tensor fused quantizers' scheme. topk_kernel: dsv4::indexer_topk's kernel, "cluster"
    (8 CTAs per row; auto below 64 rows) or "rows" (one CTA per row; auto from 64). moe_gemv_rows: token rows per
    pass of the MoE's gemv kernel, 0 (auto: 2 while T <= 8, else 8), 2 or 8 (2 gives each warp a deeper weight
    ring). gemv_pdl: under pdl, the NVFP4 linear / MoE kernels launched with it too (off: those without it, the
    other decode kernels keep it; an A/B of the gemv's own PDL). gemv_pdl_rows: under gemv_pdl, only the calls of fewer token rows (M; the MoE's T) launch with it (default 8:
    on an H100 the layer was faster with it at B = 1 and 4, 4-6% faster without it at B = 8).
    beside: under pdl,
    on runs dsv4::nvfp4_fp32_linear_multi's fp32 kernel beside its NVFP4 gemv (off, the default until an A/B shows
    it faster: after it, as two ops)."""
    nvfp4_gemm_kernel: str = "auto"
    pdl: bool = True
    moe_local_route: bool = True
    attn_kernel: str = "auto"
    nvfp4_fused_path: str = "auto"
    topk_kernel: str = "auto"
    moe_gemv_rows: int = 0
    gemv_pdl: bool = True
    gemv_pdl_rows: int = 8
    beside: bool = False

    def _as_ints(self) -> dict[str, int]:
        for name, value, allowed in (("nvfp4_gemm_kernel", self.nvfp4_gemm_kernel, GEMM_KERNELS),
                                     ("attn_kernel", self.attn_kernel, ATTN_KERNELS),
                                     ("nvfp4_fused_path", self.nvfp4_fused_path, FUSED_PATHS),
                                     ("topk_kernel", self.topk_kernel, TOPK_KERNELS)):
            if value not in allowed:
                raise ValueError(f"KernelOverrides.{name} must be one of {allowed}, got {value!r}")
        if self.moe_gemv_rows not in MOE_GEMV_ROWS:
            raise ValueError(f"KernelOverrides.moe_gemv_rows must be one of {MOE_GEMV_ROWS}, "
                             f"got {self.moe_gemv_rows!r}")
        return {"nvfp4_gemm_kernel": GEMM_KERNELS.index(self.nvfp4_gemm_kernel), "pdl": int(self.pdl),
                "moe_local_route": int(self.moe_local_route), "attn_kernel": ATTN_KERNELS.index(self.attn_kernel),
                "nvfp4_fused_path": FUSED_PATHS.index(self.nvfp4_fused_path),
                "topk_kernel": TOPK_KERNELS.index(self.topk_kernel), "moe_gemv_rows": self.moe_gemv_rows,
                "gemv_pdl": int(self.gemv_pdl), "gemv_pdl_rows": self.gemv_pdl_rows, "beside": int(self.beside)}


def _lib():
    # Same absolute path as the loaded copy, so ctypes gets the already-loaded handle (one Overrides instance).
    return ctypes.CDLL(library_path())


# What this process set (the library starts at the defaults and only set_overrides changes it): model code
# reads it while torch.compile traces, where a ctypes call could not be traced.
_current = KernelOverrides()


def current() -> KernelOverrides:
    """The overrides in force."""
    return _current


def native() -> KernelOverrides:
    """The overrides as the loaded library holds them (what its kernels read)."""
    lib, got = _lib(), {}
    for name in KernelOverrides()._as_ints():
        v = ctypes.c_int()
        if lib.dsv4_ops_get_override(name.encode(), ctypes.byref(v)) != 0:
            raise RuntimeError(f"the loaded op library has no override {name!r} (rebuild it)")
        got[name] = v.value
    return KernelOverrides(nvfp4_gemm_kernel=GEMM_KERNELS[got["nvfp4_gemm_kernel"]], pdl=bool(got["pdl"]),
                           moe_local_route=bool(got["moe_local_route"]),
                           attn_kernel=ATTN_KERNELS[got["attn_kernel"]],
                           nvfp4_fused_path=FUSED_PATHS[got["nvfp4_fused_path"]],
                           topk_kernel=TOPK_KERNELS[got["topk_kernel"]], moe_gemv_rows=got["moe_gemv_rows"],
                           gemv_pdl=bool(got["gemv_pdl"]), gemv_pdl_rows=got["gemv_pdl_rows"],
                           beside=bool(got["beside"]))


def set_overrides(overrides: KernelOverrides) -> None:
    global _current
    lib = _lib()
    for name, value in overrides._as_ints().items():
        if lib.dsv4_ops_set_override(name.encode(), value) != 0:
            raise RuntimeError(f"the loaded op library has no override {name!r} (rebuild it)")
    _current = overrides


@contextlib.contextmanager
def kernel_overrides(**changes):
    """The current overrides with `changes` (KernelOverrides fields) inside the block, restored after."""
    before = current()
    set_overrides(dataclasses.replace(before, **changes))
    try:
        yield
    finally:
        set_overrides(before)


def parse(spec: str) -> KernelOverrides:
    """'attn_kernel=simt,pdl=0' (a command line's form) -> KernelOverrides."""
    fields = {f.name: f.type for f in dataclasses.fields(KernelOverrides)}
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in fields:
            raise ValueError(f"unknown kernel override {name!r} (known: {', '.join(fields)})")
        kind = fields[name]
        out[name] = value not in ("0", "false", "off") if kind == "bool" else int(value) if kind == "int" else value
    return KernelOverrides(**out)

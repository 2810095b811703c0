"""Kernel debug overrides (dsv4_ops.overrides): what Python sets is what the loaded library holds, scoped
changes restore, bad values are refused; and the library reads no environment switch beyond its three."""
import pathlib
import re

import pytest

from dsv4_ops import overrides as ov

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_defaults_are_what_the_library_starts_with():
    assert ov.native() == ov.KernelOverrides() == ov.current()


def test_scoped_overrides_reach_the_library_and_restore():
    forced = dict(nvfp4_gemm_kernel="skinny", pdl=False, moe_local_route=False, attn_kernel="simt",
                  nvfp4_fused_path="grid", topk_kernel="rows", moe_gemv_rows=2, gemv_pdl=False,
                  gemv_pdl_rows=3, beside=True)
    with pytest.raises(KeyError):
        with ov.kernel_overrides(**forced):
            assert ov.native() == ov.current() == ov.KernelOverrides(**forced)
            with ov.kernel_overrides(pdl=True):
                assert ov.native().pdl and ov.native().attn_kernel == "simt"
            assert not ov.native().pdl
            raise KeyError  # restored on the way out of an error too
    assert ov.native() == ov.current() == ov.KernelOverrides()
    for kernel in ov.GEMM_KERNELS:
        with ov.kernel_overrides(nvfp4_gemm_kernel=kernel):
            assert ov.native().nvfp4_gemm_kernel == kernel


def test_bad_values_are_refused_before_anything_changes():
    with pytest.raises(ValueError, match="nvfp4_gemm_kernel"):
        ov.set_overrides(ov.KernelOverrides(nvfp4_gemm_kernel="fastest"))
    with pytest.raises(ValueError, match="unknown kernel override 'gemv_split'"):
        ov.parse("gemv_split=2:2")
    assert ov.native() == ov.KernelOverrides()
    assert ov.parse("attn_kernel=simt, pdl=0") == ov.KernelOverrides(attn_kernel="simt", pdl=False)
    assert ov.parse("moe_gemv_rows=8") == ov.KernelOverrides(moe_gemv_rows=8)
    assert ov.parse("gemv_pdl=0") == ov.KernelOverrides(gemv_pdl=False)
    with pytest.raises(ValueError, match="moe_gemv_rows"):
        ov.set_overrides(ov.KernelOverrides(moe_gemv_rows=4))
    assert ov.parse("") == ov.KernelOverrides()


def test_library_code_reads_at_most_three_environment_switches():
    names = set()
    for d in ("dsv4_ops", "dsv4_model", "dsv4_export"):
        for f in (ROOT / d).rglob("*"):
            if f.suffix in (".py", ".cpp", ".cu", ".h", ".cuh"):
                text = f.read_text()
                names |= set(re.findall(r'(?:getenv|environ\.get|environ\[)\(?"(DSV4_[A-Z0-9_]+)"', text))
    assert names == {"DSV4_OPS_LIBRARY", "DSV4_CXX", "DSV4_CACHE_DIR"}, names

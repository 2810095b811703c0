"""Compiler choice for AOTI packages (dsv4_export/toolchain.py): pure logic over given paths / versions; the CPU
ISA check skipped for CUDA packages."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from dsv4_export.toolchain import (Candidate, Libstdcxx, ToolchainError, choose_compiler, compiler_libstdcxx,
                              loaded_libstdcxx, max_glibcxx_in_file, parse_glibcxx, select_compiler)

SYS_LIB = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"


def lib(path, n):
    return Libstdcxx(path, (3, 4, n))


def test_gpu_box_prefers_system_compiler_over_opt_gcc():
    # The H200 machine: Python maps the system libstdc++; $CXX=/opt/gcc/bin/g++ links its own copy.
    # Whichever way /opt/gcc's version compares, the compiler linking the loaded file wins.
    for opt_version in (32, 34):
        cands = [Candidate("/opt/gcc/bin/g++", lib(f"/opt/gcc/lib64/libstdc++.so.6.0.{opt_version}", opt_version)),
                 Candidate("/usr/bin/g++", lib(SYS_LIB, 33))]
        choice = choose_compiler(lib(SYS_LIB, 33), cands)
        assert choice.cxx == "/usr/bin/g++"
        assert choice.exact


def test_same_version_other_file_is_accepted():
    cands = [Candidate("/opt/x/g++", lib("/opt/x/lib64/libstdc++.so.6.0.30", 30))]
    choice = choose_compiler(lib("/usr/lib/libstdc++.so.6.0.30", 30), cands)
    assert choice.cxx == "/opt/x/g++" and choice.exact


def test_older_compiler_is_a_flagged_fallback_newest_first():
    cands = [Candidate("/a/g++", lib("/a/libstdc++.so.6.0.28", 28)),
             Candidate("/b/g++", lib("/b/libstdc++.so.6.0.30", 30)),
             Candidate("/c/g++", lib("/c/libstdc++.so.6.0.34", 34))]
    choice = choose_compiler(lib(SYS_LIB, 33), cands)
    assert choice.cxx == "/b/g++"
    assert not choice.exact and "older" in choice.reason


def test_only_newer_compilers_is_a_clear_error():
    cands = [Candidate("/opt/gcc/bin/g++", lib("/opt/gcc/lib64/libstdc++.so.6.0.34", 34)),
             Candidate("/weird/g++", None)]
    with pytest.raises(ToolchainError) as e:
        choose_compiler(lib("/usr/lib/libstdc++.so.6.0.30", 30), cands)
    msg = str(e.value)
    assert "GLIBCXX_3.4.30" in msg and "/opt/gcc/bin/g++" in msg and "DSV4_CXX" in msg


def test_no_compiler_is_a_clear_error():
    with pytest.raises(ToolchainError, match="no C\\+\\+ compiler"):
        choose_compiler(lib(SYS_LIB, 33), [])


def test_process_without_libstdcxx_takes_first_candidate():
    assert choose_compiler(None, [Candidate("/x/g++", None), Candidate("/y/g++", None)]).cxx == "/x/g++"


def test_parse_maps_and_versions(tmp_path):
    fake = tmp_path / "libstdc++.so.6.0.31"
    fake.write_bytes(b"\x7fELF junk GLIBCXX_3.4\x00GLIBCXX_3.4.29\x00GLIBCXX_3.4.31\x00CXXABI_1.3.13\x00")
    maps = (f"7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/libm.so.6\n"
            f"7f0000002000-7f0000003000 r-xp 00000000 08:01 2 {fake}\n")
    got = loaded_libstdcxx(maps)
    assert got == Libstdcxx(str(fake), (3, 4, 31))
    assert max_glibcxx_in_file(str(fake)) == (3, 4, 31)
    assert parse_glibcxx("needs GLIBCXX_3.4.32 here") == (3, 4, 32)
    assert loaded_libstdcxx("7f00-7f01 r-xp 0 0:0 0 /usr/lib/libc.so.6\n") is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_this_machine_chooses_a_compiler_linking_the_loaded_libstdcxx():
    import torch  # noqa: F401  (maps libstdc++ into the process)

    here = loaded_libstdcxx()
    assert here is not None and os.path.isfile(here.path)
    choice = select_compiler()
    linked = compiler_libstdcxx(choice.cxx)
    assert linked is not None and linked.glibcxx == here.glibcxx


def test_cuda_packages_skip_the_cpu_isa_probe_and_cpu_work_keeps_it():
    # In a fresh process (the ISA list is cached per process): inside the block for CUDA the ISA comes back
    # without a single dry-compile, and on the way out the list it cached is dropped; for CPU nothing changes.
    code = textwrap.dedent("""
        import torch._inductor.config as ic
        from torch._inductor import cpu_vec_isa
        from dsv4_export.toolchain import cpu_isa_probe_skipped

        def refuse(self, code):
            raise AssertionError("dry-compiled an ISA probe")

        real = cpu_vec_isa.VecISA.check_build
        cpu_vec_isa.VecISA.check_build = refuse
        with cpu_isa_probe_skipped("cuda:0"):
            assert ic.cpp.vec_isa_ok is False
            assert cpu_vec_isa.pick_vec_isa() == cpu_vec_isa.invalid_vec_isa
        assert ic.cpp.vec_isa_ok is None
        assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
        with cpu_isa_probe_skipped("cpu"):
            assert ic.cpp.vec_isa_ok is None
        probed = []
        def record(self, code):
            probed.append(str(self))
            return real(self, code)
        cpu_vec_isa.VecISA.check_build = record
        cpu_vec_isa.pick_vec_isa()
        assert probed or not cpu_vec_isa.valid_vec_isa_list(), "a CPU compile after the block must still check"
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]

"""Picks the C++ compiler Inductor uses for AOTI wrappers, so the package loads in this very process.

Why: an AOTI package is a shared library that is dlopen'ed into the running process, which already has ONE
libstdc++ mapped (the one torch pulled in). On the H200 machine Inductor's default compiler is
/opt/gcc/bin/g++, whose own libstdc++ is not the one Python loads (/usr/lib/x86_64-linux-gnu/...); the
wrapper's inlined std::regex / locale code then runs against the other library's facets and the package
segfaults on load. A compiler whose libstdc++ IS the loaded one (same file, or at least the same GLIBCXX
version) gives packages that load. A compiler whose libstdc++ is older is usable as a fallback (libstdc++ is
backward compatible); a newer one is not (its symbols are missing from the loaded library).

The choice itself is ``choose_compiler`` (a pure function over paths and versions, unit-tested); the rest
gathers the facts from this machine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
from typing import Iterable, Sequence

_GLIBCXX_RE = re.compile(rb"GLIBCXX_(\d+)\.(\d+)(?:\.(\d+))?")
_SONAME_RE = re.compile(r"libstdc\+\+\.so\.(\d+)\.(\d+)\.(\d+)$")

Version = tuple  # (3, 4, N) for GLIBCXX_3.4.N


class ToolchainError(RuntimeError):
    """No compiler can build an AOTI package that this process could load."""


@dataclasses.dataclass(frozen=True)
class Libstdcxx:
    path: str  # real path (symlinks resolved)
    glibcxx: Version | None  # highest GLIBCXX_x.y.z symbol version it defines; None if unknown

    def describe(self) -> str:
        v = "GLIBCXX_" + ".".join(map(str, self.glibcxx)) if self.glibcxx else "unknown GLIBCXX"
        return f"{self.path} ({v})"


@dataclasses.dataclass(frozen=True)
class Candidate:
    cxx: str  # compiler path as given to Inductor
    lib: Libstdcxx | None  # the libstdc++ it links against; None if it could not be determined


@dataclasses.dataclass(frozen=True)
class Choice:
    cxx: str
    reason: str
    exact: bool  # True when the compiler links the very library (or version) the process has loaded


def parse_glibcxx(text: str) -> Version | None:
    """'GLIBCXX_3.4.32' -> (3, 4, 32)."""
    m = _GLIBCXX_RE.search(text.encode())
    return _version_from_match(m) if m else None


def _version_from_match(m: re.Match) -> Version:
    return tuple(int(g) for g in m.groups() if g is not None)


def max_glibcxx_in_file(path: str) -> Version | None:
    """Highest GLIBCXX symbol version a libstdc++ binary defines (read from its version strings)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    versions = [_version_from_match(m) for m in _GLIBCXX_RE.finditer(data)]
    return max(versions) if versions else None


def _glibcxx_from_soname(path: str) -> Version | None:
    # libstdc++.so.6.0.N defines GLIBCXX_3.4.N for every GCC since 3.4 (6.0.30 -> 3.4.30, 6.0.33 -> 3.4.33).
    m = _SONAME_RE.search(os.path.basename(path))
    return (3, 4, int(m.group(3))) if m else None


def describe_lib(path: str) -> Libstdcxx:
    real = os.path.realpath(path)
    return Libstdcxx(real, max_glibcxx_in_file(real) or _glibcxx_from_soname(real))


def loaded_libstdcxx(maps_text: str | None = None) -> Libstdcxx | None:
    """The libstdc++ mapped into this process (from /proc/self/maps), or None if there is none."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            return None
    for line in maps_text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and "libstdc++.so" in os.path.basename(parts[-1]):
            return describe_lib(parts[-1])
    return None


def compiler_libstdcxx(cxx: str) -> Libstdcxx | None:
    """The libstdc++ a compiler links by default (``-print-file-name``), or None if it cannot be asked."""
    for name in ("libstdc++.so", "libstdc++.so.6"):
        try:
            out = subprocess.run(
                [cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        # A bare name back means the compiler does not know the file.
        if out and os.path.isabs(out) and os.path.exists(out):
            return describe_lib(out)
    return None


def choose_compiler(process_lib: Libstdcxx | None, candidates: Sequence[Candidate]) -> Choice:
    """Ranks compilers for building AOTI wrappers that load into a process with ``process_lib`` loaded.

    1. a compiler linking the same libstdc++ file;  2. one linking the same GLIBCXX version;
    3. one linking an older GLIBCXX (newest first; backward compatible, with a warning in ``reason``).
    A compiler whose libstdc++ is newer, or unknown, is never chosen. Raises ToolchainError if none fits.
    """
    if not candidates:
        raise ToolchainError("no C++ compiler found (looked for /usr/bin/g++, $CXX, g++, c++ on PATH)")
    if process_lib is None:
        # No libstdc++ in the process yet (nothing C++ loaded): any compiler's runtime will be the one loaded.
        return Choice(candidates[0].cxx, "this process has no libstdc++ loaded; using the first compiler", True)
    same_file = [c for c in candidates if c.lib is not None and c.lib.path == process_lib.path]
    if same_file:
        return Choice(same_file[0].cxx, f"links the loaded {process_lib.describe()}", True)
    if process_lib.glibcxx is not None:
        known = [c for c in candidates if c.lib is not None and c.lib.glibcxx is not None]
        same_version = [c for c in known if c.lib.glibcxx == process_lib.glibcxx]
        if same_version:
            c = same_version[0]
            return Choice(c.cxx, f"links {c.lib.describe()}, same version as the loaded {process_lib.path}", True)
        older = sorted((c for c in known if c.lib.glibcxx < process_lib.glibcxx), key=lambda c: c.lib.glibcxx,
                       reverse=True)
        if older:
            c = older[0]
            return Choice(
                c.cxx,
                f"no compiler links the loaded {process_lib.describe()}; {c.cxx} links the older "
                f"{c.lib.describe()} (backward compatible, but a separately built toolchain can still crash "
                f"on load: prefer the system compiler that matches)",
                False,
            )
    lines = "\n".join(
        f"  {c.cxx}: {c.lib.describe() if c.lib else 'its libstdc++ could not be determined'}" for c in candidates
    )
    raise ToolchainError(
        "No C++ compiler can build an AOTInductor package that this process can load.\n"
        f"The process has {process_lib.describe()} loaded; the package's wrapper .so is dlopen'ed into it and "
        "must use that same libstdc++ (a newer one's symbols are missing -> load error; a different build's "
        "inlined locale/regex code -> segfault on load).\nCompilers found:\n"
        f"{lines}\nInstall the system g++ that matches the loaded libstdc++ or set DSV4_CXX=/path/to/g++."
    )


def candidate_compilers(env: dict | None = None) -> list[str]:
    """Compilers to consider, in order of preference (existing, deduplicated by real path)."""
    env = os.environ if env is None else env
    names: list[str] = []
    # The system compiler first: it links the system libstdc++, which is what a pip/venv Python loads.
    names += ["/usr/bin/g++", "/usr/bin/c++"]
    for var in ("CXX",):
        if env.get(var):
            names.append(env[var])
    for exe in ("g++", "c++", "clang++"):
        found = shutil.which(exe)
        if found:
            names.append(found)
    names += sorted((os.path.join("/usr/bin", n) for n in _listdir("/usr/bin") if re.fullmatch(r"g\+\+-\d+", n)),
                    reverse=True)
    seen: set[str] = set()
    out: list[str] = []
    for n in names:
        path = n if os.path.isabs(n) else (shutil.which(n) or "")
        if not path or not os.access(path, os.X_OK):
            continue
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        out.append(path)
    return out


def _listdir(d: str) -> Iterable[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def select_compiler(verbose: bool = False) -> Choice:
    """Chooses the compiler for this process. ``DSV4_CXX`` forces one (still reported, never vetoed)."""
    import torch  # noqa: F401  (torch's import maps the libstdc++ that packages will be loaded against)

    process_lib = loaded_libstdcxx()
    forced = os.environ.get("DSV4_CXX")
    if forced:
        lib = compiler_libstdcxx(forced)
        return Choice(forced, f"forced by DSV4_CXX (links {lib.describe() if lib else 'unknown libstdc++'}; "
                              f"process has {process_lib.describe() if process_lib else 'none'})",
                      lib is not None and process_lib is not None and lib.glibcxx == process_lib.glibcxx)
    candidates = [Candidate(c, compiler_libstdcxx(c)) for c in candidate_compilers()]
    choice = choose_compiler(process_lib, candidates)
    if verbose:
        print(f"[export] C++ compiler for AOTI: {choice.cxx} ({choice.reason})", flush=True)
    return choice


def configure_inductor(verbose: bool = False) -> Choice:
    """Selects the compiler and makes Inductor (AOTI wrappers and CPU kernels) use it."""
    import torch._inductor.config as inductor_config

    choice = select_compiler(verbose=verbose)
    inductor_config.cpp.cxx = (choice.cxx,)
    return choice


@contextlib.contextmanager
def cpu_isa_probe_skipped(device: str):
    """For a CUDA package, Inductor's CPU vector-ISA check is skipped while the block runs.

    Why: AOTI asks for the host's vector ISA when it compiles a package and again when it loads one (only to
    compare it with the package's record), and each check dry-compiles a program per ISA and dlopens it in a
    fresh Python: on the H200 machine most of the default decode entry's compile time and of a fresh process's
    package load (the C++ runner, which does not check, loads it far faster; bench/RESULTS.md). A CUDA wrapper
    has no vectorized CPU code, so the ISA is moot there. The ISA list is cached per process: one worked out
    inside the block is dropped on the way out, so a later CPU compile in this process still checks."""
    import torch

    if torch.device(device).type != "cuda":
        yield
        return
    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa

    fresh = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
    try:
        with inductor_config.patch({"cpp.vec_isa_ok": False}):
            yield
    finally:
        if fresh:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()


if __name__ == "__main__":
    # `python -m dsv4_export.toolchain` prints the chosen compiler (dsv4_export/cpp/build.sh builds the runner with it).
    import sys

    try:
        print(select_compiler().cxx)
    except ToolchainError as e:
        print(e, file=sys.stderr)
        sys.exit(1)

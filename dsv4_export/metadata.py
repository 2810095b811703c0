"""The package's metadata: what it was built for, and the checks a loader runs before touching the .so.

Stored twice, with the same content: as AOTI model metadata (``aot_inductor.metadata``, string -> string;
readable from C++ via ``AOTIModelPackageLoader::get_metadata()`` and from Python via
``AOTICompiledModel.get_metadata()``) and as ``extra/dsv4_metadata.json`` in the archive, which Python reads
without loading anything, so a mismatch is reported clearly instead of failing inside dlopen.

Keys (all values are strings; JSON where noted). The flat ``dsv4.cpp.*`` keys are for the C++ runner, which
has no JSON parser.
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile

import torch

FORMAT_VERSION = "1"
EXTRA_FILE = "dsv4_metadata.json"  # stored under <archive>/extra/

K_FORMAT = "dsv4.format"
K_TORCH = "dsv4.torch_version"
K_DEVICE = "dsv4.device"  # "cpu" | "cuda"
K_ARCH = "dsv4.gpu_arch"  # "sm_90" | "" on CPU
K_CONFIG = "dsv4.config"  # JSON: the model config
K_ENTRIES = "dsv4.entries"  # JSON: {name: {"kind", "batch", "seq_len", "dynamic_seq", "max_seq"}}
K_CACHES = "dsv4.caches"  # JSON: [{"name", "shape", "dtype"}] in input order
K_OPS_USED = "dsv4.ops_used"  # JSON: {"dsv4::op": "schema"} for every dsv4 op the graphs call
K_OPS_TABLE = "dsv4.ops_table_sha256"  # hash of the loaded library's whole dsv4 schema table (informational)
K_OPS_LIB = "dsv4.ops_library_sha256"  # hash of libdsv4_ops.so's bytes (informational)
K_MAX_BATCH = "dsv4.max_batch_size"
K_MAX_SEQ = "dsv4.max_seq_len"
K_DTYPE = "dsv4.dtype"
K_QUANT = "dsv4.quant_info"  # JSON: the model's NVFP4 conversion info ({} for float weights)
K_VOCAB = "dsv4.vocab_size"
K_CXX = "dsv4.cxx"  # the compiler of the wrapper .so files
K_CXX_GLIBCXX = "dsv4.cxx_glibcxx"  # "3.4.33": the newest GLIBCXX its libstdc++ defines ("" if unknown)
# The tokenizer of text prompts: "tokenizer.json" (the checkpoint's, stored as extra/TOKENIZER_FILE) or "bytes" (the
# byte-level fallback the config sizes, as for a checkpoint without one); absent in packages built before.
K_TOKENIZER = "dsv4.tokenizer"
TOKENIZER_FILE = "tokenizer.json"
# For C++: "decode_b1,decode_b2" / "prefill_b1" ; caches "name:dtype:d0xd1x..;..." ; "4" / "256".
K_CPP_DECODE = "dsv4.cpp.decode_entries"
K_CPP_PREFILL = "dsv4.cpp.prefill_entries"
K_CPP_PREFILL_CHUNK = "dsv4.cpp.prefill_chunk_entries"  # "prefill_chunk_b1_s4096" ("" if none)
K_CPP_CACHES = "dsv4.cpp.caches"


class PackageMismatch(RuntimeError):
    """The package was built for another torch / device / GPU / op library / config."""


def gpu_arch(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"


def dsv4_schemas() -> dict[str, str]:
    """Every registered dsv4 op -> its schema string (the op library's interface as the dispatcher sees it)."""
    out = {}
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if name.startswith("dsv4::"):
            out[name] = str(torch._C._get_schema(name, ""))
    return out


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def environment(device: str) -> dict[str, str]:
    import dsv4_ops

    table = dsv4_schemas()
    return {
        K_FORMAT: FORMAT_VERSION,
        K_TORCH: torch.__version__,
        K_DEVICE: torch.device(device).type,
        K_ARCH: gpu_arch(device),
        K_OPS_TABLE: hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest(),
        K_OPS_LIB: file_sha256(dsv4_ops.library_path()),
    }


def read_from_archive(path: str) -> dict[str, str]:
    """The metadata stored in a package, without loading it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no package at {path}")
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/extra/" + EXTRA_FILE) or n == "extra/" + EXTRA_FILE]
            if not names:
                raise PackageMismatch(f"{path} is not a dsv4 export package (no extra/{EXTRA_FILE}); "
                                      "build it with `python -m dsv4_export build`")
            return json.loads(z.read(names[0]))
    except zipfile.BadZipFile as e:
        raise PackageMismatch(f"{path} is not a .pt2 archive: {e}") from e


def check(meta: dict[str, str], *, device: str | None = None, config: dict | None = None) -> None:
    """Raises PackageMismatch with the reason when this process cannot run the package as built."""
    if meta.get(K_FORMAT) != FORMAT_VERSION:
        raise PackageMismatch(f"package format {meta.get(K_FORMAT)!r}, this loader reads {FORMAT_VERSION!r}: "
                              "rebuild it")
    built_torch = meta[K_TORCH]
    if built_torch != torch.__version__:
        raise PackageMismatch(
            f"package built with torch {built_torch}, this process runs torch {torch.__version__}: AOTInductor "
            "packages are tied to the torch build that compiled them; rebuild it with `python -m dsv4_export build` "
            "here")
    built_device = meta[K_DEVICE]
    want = torch.device(device).type if device else built_device
    if want != built_device:
        raise PackageMismatch(f"package built for {built_device}, asked to run on {want}: rebuild it for {want}")
    if built_device == "cuda":
        if not torch.cuda.is_available():
            raise PackageMismatch("package built for CUDA, but this process sees no CUDA device")
        here = gpu_arch(device or "cuda")
        if here != meta[K_ARCH]:
            raise PackageMismatch(f"package built for GPU arch {meta[K_ARCH]}, this GPU is {here}: rebuild it here")
    check_libstdcxx(meta.get(K_CXX_GLIBCXX, ""))
    check_ops(json.loads(meta[K_OPS_USED]))
    if config is not None:
        built = json.loads(meta[K_CONFIG])
        if built != config:
            diff = sorted(k for k in set(built) | set(config) if built.get(k) != config.get(k))
            raise PackageMismatch(f"package built for another model config (differs in {', '.join(diff)})")


def check_libstdcxx(built: str) -> None:
    """The wrapper .so may need GLIBCXX symbols up to ``built``: the loaded libstdc++ must have them."""
    from dsv4_export.toolchain import loaded_libstdcxx

    here = loaded_libstdcxx()
    if not built or here is None or here.glibcxx is None:
        return
    need = tuple(int(x) for x in built.split("."))
    if need > here.glibcxx:
        raise PackageMismatch(
            f"package compiled against a libstdc++ with GLIBCXX_{built}, this process has {here.describe()} "
            "loaded: its wrapper .so cannot load here (missing symbols); rebuild the package on this machine")


def check_ops(used: dict[str, str]) -> None:
    """Every dsv4 op the package calls must be registered here with the same schema."""
    if not used:
        return
    here = dsv4_schemas()
    missing = [n for n in used if n not in here]
    if missing and not here:
        raise PackageMismatch(
            f"the dsv4 op library is not loaded, and the package calls {', '.join(sorted(used))}: "
            "`import dsv4_ops` first (C++: dlopen libdsv4_ops.so with RTLD_GLOBAL before loading the package)")
    if missing:
        raise PackageMismatch(f"the loaded dsv4 op library lacks {', '.join(missing)} that the package calls: "
                              "load the library the package was built with, or rebuild the package")
    changed = [f"{n}: package {used[n]!r} vs library {here[n]!r}" for n in used if here[n] != used[n]]
    if changed:
        raise PackageMismatch("dsv4 op schemas changed since the package was built:\n  " + "\n  ".join(changed))

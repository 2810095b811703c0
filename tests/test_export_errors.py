"""dsv4_export's argument and package checks: one clear error before any weight is read or any kernel runs (no
package is compiled here: the checks run before the load, on metadata-only archives, or on stubbed builds)."""
import json
import os
import zipfile

import pytest
import torch

from dsv4_export import metadata as md
from dsv4_export.__main__ import main
from dsv4_export.build import write_package
from dsv4_export.load import ExportedEngine, PackageMismatch, check_archive
from dsv4_model.checkpoint.loader import load_config
from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR


@pytest.fixture
def no_load(monkeypatch):
    """A build that reaches the checkpoint fails the test: these errors must come first."""
    import dsv4_model.checkpoint.loader as loader

    def load_model(*a, **k):
        raise AssertionError("the checkpoint was loaded before the bad argument was refused")

    monkeypatch.setattr(loader, "load_model", load_model)


@pytest.mark.parametrize("args, want", [
    (["--out", "x/a.txt"], "--out x/a.txt: a package path must end in .pt2"),
    (["--max-batch-size", "2", "--decode-batches", "3"],
     "--decode-batches: batch bucket 3 outside [1, --max-batch-size=2]"),
    (["--max-batch-size", "2", "--prefill-batches", "5"],
     "--prefill-batches: batch bucket 5 outside [1, --max-batch-size=2]"),
    (["--max-seq-len", "64", "--prefill-lengths", "999"], "--prefill-lengths: length 999 outside [1, --max-seq-len=64]"),
    (["--max-seq-len", "64", "--prefill-chunks", "0"], "--prefill-chunks: chunk length 0 outside [1, --max-seq-len=64]"),
    (["--out", "{file}/a.pt2"], "{file} is a file, not a directory"),
    (["--out", "/proc/a.pt2"], "--out /proc/a.pt2: directory /proc is not writable"),
])
def test_cli_build_refuses_bad_arguments_before_the_load(tmp_path, capsys, no_load, args, want):
    if "/proc" in want and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    file = tmp_path / "file"
    file.write_text("")
    args = [a.format(file=file) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "m.pt2")]
    rc = main(["build", "--model", str(DEFAULT_MODEL_DIR), "--device", "cpu", *out, *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert want.format(file=file) in err and "loading" not in err
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_build_from_checkpoint_names_the_argument_before_the_load(tmp_path, no_load):
    from dsv4_export.build import build_from_checkpoint

    kw = dict(max_batch_size=2, max_seq_len=64, device="cpu")
    with pytest.raises(ValueError, match=r"^decode_batches: batch bucket 3 outside \[1, max_batch_size=2\]$"):
        build_from_checkpoint(str(DEFAULT_MODEL_DIR), str(tmp_path / "m.pt2"), decode_batches=[3], **kw)
    with pytest.raises(ValueError, match=r"^out .*m\.txt: a package path must end in \.pt2"):
        build_from_checkpoint(str(DEFAULT_MODEL_DIR), str(tmp_path / "m.txt"), **kw)


def test_a_failed_build_leaves_no_folder_it_created(tmp_path, monkeypatch):
    """--out in folders that do not exist yet: the build creates them, and removes them again when it fails (here:
    Ctrl-C while compiling); a folder that existed stays. (The compile is stubbed: no entries in the package.)"""
    import dsv4_export.build as build
    from export_toy import ToyLM

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    def build_toy():
        build.build_package(ToyLM(max_batch_size=1, max_seq_len=8), {"vocab_size": 96}, str(out), max_batch_size=1,
                            max_seq_len=8, device="cpu", prefill_lengths=[8], jobs=1, verbose=False,
                            save_exported_programs=False)

    out = tmp_path / "new" / "sub" / "m.pt2"
    monkeypatch.setattr(build, "export_and_compile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_toy()
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(build, "export_and_compile", lambda model, names, entries, *a, **k:
                        {e.name: ([], {}) for e in entries})
    build_toy()
    assert os.listdir(out.parent) == ["m.pt2"]


def test_cli_run_bad_device_is_one_line(capsys):
    rc = main(["run", "/nonexistent/m.pt2", "--prompt-ids", "1", "2", "--device", "foo"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "error: device 'foo' is not a device (use cpu, cuda or cuda:N)\n", err


def _metadata_package(path, config: dict) -> str:
    """An archive with a dsv4 package's metadata for this process and no entries: ExportedEngine gets through its
    checks and loads nothing."""
    meta = dict(md.environment("cpu"), **{md.K_CONFIG: json.dumps(config), md.K_ENTRIES: "{}", md.K_CACHES: "[]",
                                           md.K_OPS_USED: "{}", md.K_MAX_BATCH: "1", md.K_MAX_SEQ: "64",
                                           md.K_VOCAB: str(config["vocab_size"])})
    return write_package({}, str(path), meta)


def test_config_may_be_a_model_config(tmp_path):
    config = load_config(DEFAULT_MODEL_DIR)
    pkg = _metadata_package(tmp_path / "m.pt2", config.to_dict())
    assert ExportedEngine(pkg, config=config).config_dict == config.to_dict()
    assert ExportedEngine(pkg, config=config.to_dict()).entries == {}
    other = load_config(DEFAULT_MODEL_DIR)
    other.dim *= 2
    with pytest.raises(PackageMismatch, match="differs in dim"):
        ExportedEngine(pkg, config=other)
    with pytest.raises(ValueError, match="^config must be a ModelConfig or a dict, got int$"):
        ExportedEngine(pkg, config=3)
    with pytest.raises(ValueError, match="^device 'foo' is not a device"):
        ExportedEngine(pkg, device="foo")


def test_a_damaged_member_is_named_before_the_load(tmp_path):
    """Same size, one byte changed inside an entry's .so: the CRC-32 check names the member (entries not loaded are
    not read)."""
    path = tmp_path / "m.pt2"
    name = "m/data/aotinductor/decode_b1/x.wrapper.so"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(name, bytes(range(256)) * 64)
        z.writestr("m/extra/" + md.EXTRA_FILE, "{}")
    check_archive(str(path), ["decode_b1"])
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    data = bytearray(path.read_bytes())
    at = info.header_offset + 30 + len(name) + 1000  # inside the member's data (stored, no extra field)
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    check_archive(str(path), ["prefill_b1_s64"])
    with pytest.raises(PackageMismatch, match=f"damaged package .*Bad CRC-32 for file '{name}'"):
        check_archive(str(path), ["decode_b1"])


def test_eager_numerics_while_a_cpu_entry_is_lowered():
    """build.eager_numerics: ATen's mean and softmax kernels (eager's summation order) and no constants inlined as
    literals while CPU entries are lowered; Inductor's own decomposition, lowering and inlining back afterwards; CUDA
    entries untouched."""
    from torch._inductor import decomposition, lowering
    from torch._inductor.graph import GraphLowering

    from dsv4_export.build import eager_numerics

    mean, softmax, small = torch.ops.aten.mean.dim, torch.ops.aten._softmax.default, torch.ones(3)
    before = lowering.lowerings[mean], decomposition.decompositions[softmax]
    assert GraphLowering.can_inline_constant(small)
    with eager_numerics("cpu"):
        assert lowering.lowerings[mean] is not before[0] and {mean, softmax} <= set(lowering.fallbacks)
        assert softmax not in decomposition.decompositions and not GraphLowering.can_inline_constant(small)
    with eager_numerics("cuda"):
        assert lowering.lowerings[mean] is before[0] and decomposition.decompositions[softmax] is before[1]
    assert (lowering.lowerings[mean], decomposition.decompositions[softmax]) == before
    assert not {mean, softmax} & set(lowering.fallbacks) and GraphLowering.can_inline_constant(small)


def test_eager_numerics_sees_past_the_decomposition_table_inductor_cached():
    """Inductor lowers with a cached copy of its decomposition table, made by the process's first compile: one
    made before eager_numerics must not decompose the softmax inside it (a CPU package built after any compile
    in the process was ~4e-3 from eager), and one made inside must not keep it out of later compiles."""
    import torch._inductor.config as inductor_config
    from torch._inductor import decomposition

    from dsv4_export.build import eager_numerics

    softmax = torch.ops.aten._softmax.default
    with inductor_config.patch(fallback_random=False, fallback_embedding_bag_byte_unpack=False):
        assert softmax in decomposition.select_decomp_table()  # the cached copy, as after a compile
        with eager_numerics("cpu"):
            assert softmax not in decomposition.select_decomp_table()
        assert softmax in decomposition.select_decomp_table()


def test_run_takes_the_engine_cli_spelling_of_no_cuda_graphs():
    from dsv4_export.__main__ import _parser

    for flag in ("--no-cuda-graphs", "--no-cuda-graph"):  # the engine CLI's spelling, and the one scripts used
        assert _parser().parse_args(["run", "m.pt2", "--prompt-ids", "1", flag]).no_cuda_graph
    assert not _parser().parse_args(["run", "m.pt2", "--prompt-ids", "1"]).no_cuda_graph

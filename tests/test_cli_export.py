"""The tokenizer a dsv4_export package carries: write_package stores the checkpoint's tokenizer.json and the
metadata names it; package_tokenizer gives back the tokenizer load_tokenizer builds from the checkpoint (no
compile: a package of metadata only)."""
from dsv4_export import metadata as md
from dsv4_export.build import write_package
from dsv4_export.load import package_tokenizer
from dsv4_model.checkpoint.loader import load_config
from dsv4_model.checkpoint.tokenizer import load_tokenizer
from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR


def test_package_carries_the_checkpoints_tokenizer(tmp_path):
    config = load_config(DEFAULT_MODEL_DIR)
    want = load_tokenizer(DEFAULT_MODEL_DIR, config)
    assert want.kind == "tokenizer.json"
    out = str(tmp_path / "t.pt2")
    write_package({}, out, {md.K_TOKENIZER: md.TOKENIZER_FILE}, str(DEFAULT_MODEL_DIR / md.TOKENIZER_FILE))
    got = package_tokenizer(out, md.read_from_archive(out), config)
    text = "def fibonacci(n):\n    return n"
    assert got.kind == "tokenizer.json" and got.encode(text) == want.encode(text) != load_tokenizer(None, config).encode(text)
    assert package_tokenizer(out, {}, config) is None  # a package built before: none recorded


def test_build_head_quant_exports_the_nvfp4_head(tmp_path, monkeypatch):
    """--head-quant nvfp4: the model build_package exports holds the NVFP4 head and says so in its quant info; a bad
    value is refused before the checkpoint is read (no compile: build_package is stubbed)."""
    import pytest

    from dsv4_export import build
    from dsv4_export.__main__ import main
    from dsv4_model.quant.nvfp4_modules import is_nvfp4

    seen = {}
    monkeypatch.setattr(build, "build_package", lambda model, cfg, out, **kw: seen.update(model=model) or out)
    out = str(tmp_path / "m.pt2")
    assert main(["build", "--model", str(DEFAULT_MODEL_DIR), "--out", out, "--device", "cpu", "--dtype", "float32",
                 "--head-quant", "nvfp4"]) == 0
    assert is_nvfp4(seen["model"].head) and seen["model"].quant_info["head"] == "nvfp4"
    with pytest.raises(ValueError, match="head_quant must be"):
        build.build_from_checkpoint(str(tmp_path / "missing"), out, max_batch_size=1, max_seq_len=64, device="cpu",
                                    head_quant="fp8")

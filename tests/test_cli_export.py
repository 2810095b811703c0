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

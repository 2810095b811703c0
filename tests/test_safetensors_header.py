"""read_header checks a shard's header as strictly as the safetensors library parses it, so a header the library
would refuse (`SafetensorError: Error while deserializing header ...` at the first tensor read, a traceback) is one
CheckpointError naming the file, the tensor and the bad field, raised before any weight is read: a non-string
`__metadata__` value, a float / bool / negative shape entry, an unknown dtype tag (even on a tensor the loader
skips), malformed data_offsets, a sub-byte tensor that does not fill whole bytes, a size overflowing 64 bits. The
tiny files here are written by hand: 8-byte little-endian header length + JSON header + data."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from dsv4_model.checkpoint import io as ckpt_io
from dsv4_model.checkpoint.io import SINGLE_NAME, CheckpointError, TensorInfo, TensorReader, list_tensors, read_header
from dsv4_model.checkpoint.loader import load_model
from dsv4_model.checkpoint.writer import write_tiny_checkpoint


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Any tensor read fails the test: the error must come from the headers alone."""
    def read(self, info):
        raise AssertionError(f"weight {info.key!r} read before the error")

    monkeypatch.setattr(ckpt_io.TensorReader, "read", read)


def _pack(header: dict, data: bytes) -> bytes:
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def _write(path: Path, header: dict, data: bytes = b"") -> Path:
    path.write_bytes(_pack(header, data))
    return path


def _library_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())
    except SafetensorError:
        return True
    return False


def _u8(n=1, begin=0):
    return {"dtype": "U8", "shape": [n], "data_offsets": [begin, begin + n]}


# (name, header, data, what the message says) -- each one the safetensors library refuses as a whole
BAD = [
    ("metadata_int_value", {"__metadata__": {"format": "pt", "step": 1}, "a": _u8()}, b"\0",
     "__metadata__ entry 'step' is 1, not a string"),
    ("metadata_null_value", {"__metadata__": {"x": None}, "a": _u8()}, b"\0", "__metadata__ entry 'x' is None"),
    ("metadata_list", {"__metadata__": ["pt"], "a": _u8()}, b"\0", "__metadata__ is ['pt'], not an object"),
    ("metadata_string", {"__metadata__": "pt", "a": _u8()}, b"\0", "__metadata__ is 'pt', not an object"),
    ("shape_float", {"a": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}}, bytes(16),
     "tensor 'a': malformed header entry: shape [4.0] is not a list of non-negative integers"),
    ("shape_bool", {"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0",
     "tensor 'a': malformed header entry: shape [True] is not a list"),
    ("shape_negative", {"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b"",
     "tensor 'a': malformed header entry: shape [-1] is not a list"),
    ("shape_string", {"a": {"dtype": "U8", "shape": "1", "data_offsets": [0, 1]}}, b"\0",
     "tensor 'a': malformed header entry: shape '1' is not a list"),
    ("shape_too_big", {"a": {"dtype": "U8", "shape": [0, 2 ** 64], "data_offsets": [0, 0]}}, b"",
     "tensor 'a': malformed header entry: shape [0, 18446744073709551616] is not a list"),
    ("dtype_unknown", {"a": _u8(), "b": {"dtype": "Q4", "shape": [1], "data_offsets": [1, 2]}}, b"\0\0",
     "tensor 'b': malformed header entry: unknown dtype 'Q4'"),
    ("dtype_lowercase", {"a": {"dtype": "bf16", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0",
     "tensor 'a': malformed header entry: unknown dtype 'bf16'"),
    ("dtype_not_string", {"a": {"dtype": 1, "shape": [1], "data_offsets": [0, 1]}}, b"\0",
     "tensor 'a': malformed header entry: unknown dtype 1"),
    ("offsets_three", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}}, b"\0",
     "tensor 'a': malformed header entry: data_offsets [0, 1, 1] is not two non-negative integers"),
    ("offsets_float", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1.0]}}, b"\0",
     "tensor 'a': malformed header entry: data_offsets [0, 1.0] is not two"),
    ("entry_not_object", {"a": [1]}, b"\0", "tensor 'a': malformed header entry [1] (not an object)"),
    ("entry_no_offsets", {"a": {"dtype": "U8", "shape": [1]}}, b"\0",
     "tensor 'a': malformed header entry {'dtype': 'U8', 'shape': [1]} (no 'data_offsets')"),
    ("f4_half_byte", {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\0\0",
     "tensor 'a' (F4 [3]) is 12 bits, not a whole number of bytes"),
    ("f4_wrong_size", {"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 4]}}, bytes(4),
     "tensor 'a' (F4 [4]) needs 2 bytes, its header gives 4"),
    ("size_overflow", {"a": {"dtype": "U8", "shape": [2 ** 40, 2 ** 40, 0], "data_offsets": [0, 0]}}, b"",
     "tensor 'a' (U8 [1099511627776, 1099511627776, 0]): its size overflows 64 bits"),
]


@pytest.mark.parametrize("name, header, data, what", BAD, ids=[b[0] for b in BAD])
def test_a_header_the_library_refuses_is_one_checkpoint_error(tmp_path, name, header, data, what):
    path = _write(tmp_path / f"{name}.safetensors", header, data)
    assert _library_refuses(path)  # the library's own verdict on the file
    with pytest.raises(CheckpointError) as e:
        read_header(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and what in msg, msg


def test_nan_and_non_utf8_headers_are_refused(tmp_path):
    hb = b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}'
    nan = tmp_path / "nan.safetensors"
    nan.write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0")
    hb16 = json.dumps({"a": _u8()}).encode("utf-16")  # Python's json would detect UTF-16, the library does not
    utf16 = tmp_path / "utf16.safetensors"
    utf16.write_bytes(struct.pack("<Q", len(hb16)) + hb16 + b"\0")
    for path in (nan, utf16):
        assert _library_refuses(path)
        with pytest.raises(CheckpointError, match=f"^{path}: cannot read safetensors header: "):
            read_header(path)


def test_a_header_longer_than_the_format_allows_is_refused_unread(tmp_path):
    path = tmp_path / "huge.safetensors"
    n = ckpt_io.MAX_HEADER_BYTES + 8
    with open(path, "wb") as f:  # sparse: the header is never read
        f.write(struct.pack("<Q", n) + b"{}")
        f.truncate(8 + n)
    assert _library_refuses(path)
    with pytest.raises(CheckpointError, match=f"^{path}: safetensors header length {n} exceeds the format's limit"):
        read_header(path)


# headers the library accepts stay accepted: null metadata, every dtype tag it knows, sub-byte F4 / F6, an extra
# field, a 0-d tensor, a zero-size tensor with a huge dimension
GOOD = [
    ("metadata_null", {"__metadata__": None, "a": _u8()}, b"\0"),
    ("extra_field", {"a": {**_u8(), "note": 1}}, b"\0"),
    ("scalar", {"a": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}}, b"\0"),
    ("zero_size", {"a": {"dtype": "F64", "shape": [0, 2 ** 62], "data_offsets": [0, 0]}}, b""),
    ("f4", {"a": {"dtype": "F4", "shape": [2, 2], "data_offsets": [0, 2]}}, b"\0\0"),
    ("f6", {"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, bytes(3)),
]


@pytest.mark.parametrize("name, header, data", GOOD, ids=[g[0] for g in GOOD])
def test_headers_the_library_accepts_still_pass(tmp_path, name, header, data):
    path = _write(tmp_path / f"{name}.safetensors", header, data)
    assert not _library_refuses(path)
    got = read_header(path)
    assert set(got) == {k for k in header if k != "__metadata__"}


@pytest.mark.parametrize("tag", sorted(ckpt_io.ST_BITS))
def test_every_dtype_tag_the_library_knows_is_accepted(tmp_path, tag):
    nbytes = ckpt_io.ST_BITS[tag] * 8 // 8  # 8 elements: whole bytes for every tag
    path = _write(tmp_path / "t.safetensors", {"a": {"dtype": tag, "shape": [8], "data_offsets": [0, nbytes]}},
                  bytes(nbytes))
    assert not _library_refuses(path)
    assert read_header(path) == {"a": (tag, (8,))}


# ------------------------------------------------------------------ through the loader: before any weight is read

def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
    path.write_bytes(_pack(header, data))


def _first_tensor(header) -> tuple[str, dict]:
    return min(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])


def _metadata_int(header, data):
    header["__metadata__"] = {**header.get("__metadata__", {}), "step": 7}
    return header, data


def _shape_float(header, data):
    _, v = _first_tensor(header)
    v["shape"] = [float(d) for d in v["shape"]]
    return header, data


def _mtp_unknown_dtype(header, data):
    end = len(data)
    header["mtp.0.extra.weight"] = {"dtype": "Q4", "shape": [2], "data_offsets": [end, end + 2]}
    return header, data + b"\0\0"


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, progress=False, max_seq_len=64)


@pytest.mark.parametrize("edit, what", [
    (_metadata_int, "__metadata__ entry 'step' is 7, not a string"),
    (_shape_float, "malformed header entry: shape ["),
    (_mtp_unknown_dtype, "tensor 'mtp.0.extra.weight': malformed header entry: unknown dtype 'Q4'"),
], ids=["metadata_int", "shape_float", "mtp_unknown_dtype"])
def test_the_loader_refuses_a_bad_header_before_any_weight_is_read(tmp_path, no_weight_reads, capfd, edit, what):
    d = tmp_path / "ckpt"
    write_tiny_checkpoint(d, "official")
    shard = d / SINGLE_NAME
    _rewrite_header(shard, edit)
    assert _library_refuses(shard)
    with pytest.raises(CheckpointError) as e:
        list_tensors(d)
    assert str(e.value).startswith(f"{shard}: ") and what in str(e.value), str(e.value)
    with pytest.raises(CheckpointError) as e:
        _load(d)  # no_weight_reads: the error comes from the header alone
    assert str(e.value).startswith(f"{shard}: ") and what in str(e.value), str(e.value)

    from dsv4_model.runtime.cli import main

    rc = main(["generate", "--model", str(d), "--prompt", "x"])
    out, err = capfd.readouterr()
    lines = [ln for ln in err.splitlines() if not ln.startswith("[dsv4] ")]
    assert rc == 2 and out == "" and "Traceback" not in err and "SafetensorError" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(shard) in lines[0] and what in lines[0], err


# ------------------------------------------------------------------ the reader's last line of defence

def test_the_reader_wraps_a_safetensors_failure_naming_the_file(tmp_path):
    path = _write(tmp_path / "bad.safetensors", {"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    info = TensorInfo("a", path, "U8", (1,))  # as if the header had changed after list_tensors
    with TensorReader("cpu") as reader, pytest.raises(CheckpointError) as e:
        reader.read(info)
    assert str(e.value).startswith(f"{path}: cannot open as safetensors: ")
    assert isinstance(e.value.__cause__, SafetensorError)


def test_the_reader_wraps_a_missing_tensor_naming_file_and_tensor(tmp_path):
    path = _write(tmp_path / "ok.safetensors", {"a": _u8()}, b"\0")
    with TensorReader("cpu") as reader:
        assert reader.read(TensorInfo("a", path, "U8", (1,))).tolist() == [0]
        with pytest.raises(CheckpointError, match=f"^{path}: tensor 'b': cannot read: "):
            reader.read(TensorInfo("b", path, "U8", (1,)))

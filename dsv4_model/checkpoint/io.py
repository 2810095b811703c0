"""Safetensors plumbing shared by the loader and the writers: header-only inventory of a (sharded)
checkpoint, lazy per-tensor reads straight onto a device, and sharded writing with an index."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: missing / unexpected / mis-shaped / mis-typed tensors,
    an unreadable index, or an invalid config field."""


# safetensors dtype tag -> torch dtype
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# every dtype tag the safetensors library (0.8) accepts in a header -> its size in bits; a header with any other tag
# (even on a tensor the loader skips) is refused by the library as a whole, so read_header refuses it too
ST_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit on the JSON header
_USIZE_END = 1 << 64  # shapes, offsets and sizes are usize in the library
FLOAT_TAGS = frozenset({"F64", "F32", "F16", "BF16"})
INT_TAGS = frozenset({"I64", "I32", "I16", "I8", "U8"})


@dataclass(frozen=True)
class TensorInfo:
    key: str
    file: Path
    dtype: str  # safetensors tag, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * ST_DTYPES[self.dtype].itemsize if self.dtype in ST_DTYPES else 0


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (dtype tag, shape)} from a safetensors file's JSON header, without touching tensor data. The header's
    data extents are checked against the file: every tensor's byte range lies inside it, holds exactly its dtype x
    shape bytes, and the ranges, in offset order, follow each other from byte 0 to the data section's end without a
    gap or an overlap, as safetensors requires (a truncated, padded or overlapping shard fails here, before any
    weight is read). The header itself is checked as strictly as the safetensors library parses it: UTF-8 JSON,
    `__metadata__` an object of strings, every tensor an object with a known `dtype` tag, a `shape` list of
    non-negative integers and two integer `data_offsets` (anything the library would refuse fails here, not at the
    first tensor read)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (no header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise CheckpointError(f"{path}: safetensors header length {n} exceeds the file size {size}")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header length {n} exceeds the format's limit of "
                                      f"{MAX_HEADER_BYTES} bytes")
            header = json.loads(f.read(n).decode("utf-8"), parse_constant=_no_constant)
    except CheckpointError:
        raise
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    out, data_len, extents = {}, size - 8 - n, []
    for key, v in header.items():
        if key == "__metadata__":
            _check_metadata(path, v)
            continue
        dtype, shape, (begin, end) = _entry(path, key, v)
        bits = _nbits(path, key, dtype, shape)
        if bits % 8:
            raise CheckpointError(f"{path}: tensor {key!r} ({dtype} {list(shape)}) is {bits} bits, not a whole number "
                                  f"of bytes (safetensors refuses it)")
        want = bits // 8
        if end - begin != want:
            raise CheckpointError(f"{path}: tensor {key!r} ({dtype} {list(shape)}) needs {want} bytes, its header "
                                  f"gives {end - begin} ([{begin}, {end}))")
        if not 0 <= begin <= end:
            raise CheckpointError(f"{path}: tensor {key!r}: invalid data offsets [{begin}, {end})")
        if end > data_len:
            raise CheckpointError(f"{path}: truncated: tensor {key!r} ends at byte {8 + n + end} of the file, which "
                                  f"has {size} bytes")
        extents.append((begin, end, key))
        out[key] = (dtype, shape)
    pos, prev = 0, None
    for begin, end, key in sorted(extents):
        if begin > pos:
            after = f"after tensor {prev[2]!r} ([{prev[0]}, {prev[1]}))" if prev else "at the start of the data"
            raise CheckpointError(f"{path}: tensor {key!r} ([{begin}, {end})): a hole of {begin - pos} bytes {after} "
                                  f"(safetensors needs the tensors' data back to back: a damaged shard)")
        if begin < pos:
            raise CheckpointError(f"{path}: tensor {key!r} ([{begin}, {end})) overlaps tensor {prev[2]!r} "
                                  f"([{prev[0]}, {prev[1]})) (safetensors needs each tensor's bytes to be its own: a "
                                  f"damaged shard)")
        pos, prev = end, (begin, end, key)
    if pos != data_len:
        raise CheckpointError(f"{path}: {data_len - pos} bytes after the last tensor's data (the header does not "
                              f"describe the file: a damaged or partly overwritten shard)")
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (safetensors refuses it)")


def _short(v, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _is_usize(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _USIZE_END


def _check_metadata(path: Path, meta) -> None:
    """`__metadata__`: absent, null or an object mapping strings to strings, as the safetensors library requires."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: malformed header: __metadata__ is {_short(meta)}, not an object of strings")
    for k, val in meta.items():
        if not isinstance(val, str):
            raise CheckpointError(f"{path}: malformed header: __metadata__ entry {k!r} is {_short(val)}, not a "
                                  f"string (safetensors needs string -> string metadata)")


def _entry(path: Path, key: str, v) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype tag, shape, (begin, end)) of one tensor's header entry, each checked as the safetensors library
    parses it; a CheckpointError naming the file, the tensor and the bad field otherwise."""
    bad = f"{path}: tensor {key!r}: malformed header entry"
    if not isinstance(v, dict):
        raise CheckpointError(f"{bad} {_short(v)} (not an object)")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in v:
            raise CheckpointError(f"{bad} {_short(v)} (no {field!r})")
    dtype, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ST_BITS:
        raise CheckpointError(f"{bad}: unknown dtype {_short(dtype)} (safetensors knows {', '.join(ST_BITS)})")
    if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
        raise CheckpointError(f"{bad}: shape {_short(shape)} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_usize(o) for o in offsets):
        raise CheckpointError(f"{bad}: data_offsets {_short(offsets)} is not two non-negative integers")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _nbits(path: Path, key: str, dtype: str, shape: tuple[int, ...]) -> int:
    """Size of the tensor in bits, refusing a shape whose element or bit count overflows 64 bits (as the library
    does, even when a later dimension is 0)."""
    n = 1
    for d in shape:
        n *= d
        if n >= _USIZE_END:
            break
    else:
        n *= ST_BITS[dtype]
        if n < _USIZE_END:
            return n
    raise CheckpointError(f"{path}: tensor {key!r} ({dtype} {list(shape)}): its size overflows 64 bits")


def _inside(root: Path, name: str) -> Path | None:
    """`root / name` if that path, taken lexically (before any symlink), stays inside `root`; None for an absolute
    name or one whose `..` climbs out. The index names the files; where a symlinked file then points is the
    folder's business (see _check_link)."""
    base = os.path.abspath(root)
    path = os.path.normpath(os.path.join(base, name))
    return Path(path) if path != base and os.path.commonpath([base, path]) == base else None


def _hf_repo_dir(root: str | os.PathLike) -> Path | None:
    """`.../models--ORG--NAME` when `root` is a snapshot of the Hugging Face hub cache
    (`.../models--ORG--NAME/snapshots/REV`, whose files are symlinks into `../../blobs/`), else None."""
    snaps = Path(os.path.abspath(root)).parent
    return snaps.parent if snaps.name == "snapshots" and snaps.parent.name.startswith("models--") else None


def _check_link(root: Path, path: Path) -> None:
    """A symlinked shard of a Hugging Face cache snapshot must point inside that repo's cache folder (its blobs);
    in any other folder a symlink is followed wherever it points (the folder's owner made it, not the index)."""
    repo = _hf_repo_dir(root)
    if repo is None:
        return
    target = path.resolve()
    homes = {repo.resolve(), (repo / "blobs").resolve()}  # blobs/ may itself be a link to another disk
    if not any(h in target.parents for h in homes):
        raise CheckpointError(f"{path}: resolves to {target}, outside its Hugging Face cache folder {repo.resolve()}")


def list_tensors(ckpt_dir: str | os.PathLike) -> dict[str, TensorInfo]:
    """Inventory of every tensor of the checkpoint in `ckpt_dir`: via `model.safetensors.index.json`
    if present, else `model.safetensors`, else all `*.safetensors` files in the directory."""
    root = Path(ckpt_dir)
    index_path = root / INDEX_NAME
    out: dict[str, TensorInfo] = {}
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: cannot read weight_map: {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map tensor names to shard file names")
        headers: dict[str, dict] = {}
        for key, shard in weight_map.items():
            shard_path = _inside(root, shard)
            if shard_path is None:
                raise CheckpointError(f"{index_path}: shard {shard!r} of {key!r} lies outside {root}")
            if shard not in headers:
                if not shard_path.is_file():
                    raise CheckpointError(f"{index_path}: shard file {shard!r} (holding {key!r}) does not exist")
                _check_link(root, shard_path)
                headers[shard] = read_header(shard_path)
            if key not in headers[shard]:
                raise CheckpointError(f"{index_path}: {key!r} is mapped to {shard!r} but that shard has no such tensor")
            dtype, shape = headers[shard][key]
            out[key] = TensorInfo(key, shard_path, dtype, shape)
        return out
    files = [root / SINGLE_NAME] if (root / SINGLE_NAME).is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors files")
    for path in files:
        _check_link(root, path)
        for key, (dtype, shape) in read_header(path).items():
            if key in out:
                raise CheckpointError(f"{key!r} appears in both {out[key].file.name} and {path.name}")
            out[key] = TensorInfo(key, path, dtype, shape)
    return out


class TensorReader:
    """Reads single tensors lazily (mmap) from their shard directly onto `device`. At most `max_open` shards stay
    mapped (the least recently read is closed first), so the pages a load has touched stay bounded by a few
    shards, whatever the checkpoint's size (a mapped page counts as the process's host memory until unmapped)."""

    def __init__(self, device: torch.device | str, max_open: int = 2):
        self.device = torch.device(device)
        self.max_open = max(1, int(max_open))
        self._handles: dict[Path, object] = {}  # in order of last use

    def _handle(self, path: Path):
        h = self._handles.pop(path, None)
        if h is None:
            while len(self._handles) >= self.max_open:
                self._handles.pop(next(iter(self._handles)))
            dev = "cpu" if self.device.type == "cpu" else str(self.device)
            try:
                h = safe_open(str(path), framework="pt", device=dev)
            except (SafetensorError, OSError) as e:  # read_header should have refused it: a last line of defence
                raise CheckpointError(f"{path}: cannot open as safetensors: {e}") from e
        self._handles[path] = h
        return h

    def read(self, info: TensorInfo) -> torch.Tensor:
        h = self._handle(info.file)
        try:
            return h.get_tensor(info.key)
        except SafetensorError as e:
            raise CheckpointError(f"{info.file}: tensor {info.key!r}: cannot read: {e}") from e

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_sharded(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike, *,
                  num_shards: int | None = None, max_shard_bytes: int | None = None,
                  metadata: dict[str, str] | None = None) -> list[str]:
    """Write tensors as one `model.safetensors` or as `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json`. Tensors move to CPU one shard at a time. Returns the file names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = [(k, t) for k, t in named]
    total = sum(t.numel() * t.element_size() for _, t in items)
    if num_shards is None:
        num_shards = 1 if not max_shard_bytes else max(1, -(-total // max_shard_bytes))
    num_shards = max(1, min(num_shards, len(items)))
    target = -(-total // num_shards)
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    acc = 0
    for k, t in items:
        size = t.numel() * t.element_size()
        if groups[-1] and acc + size > target and len(groups) < num_shards:
            groups.append([])
            acc = 0
        groups[-1].append((k, t))
        acc += size
    meta = {"format": "pt", **(metadata or {})}
    if len(groups) == 1:
        save_file({k: t.detach().to("cpu").contiguous() for k, t in groups[0]}, str(out / SINGLE_NAME), metadata=meta)
        return [SINGLE_NAME]
    names = _shard_names(len(groups))
    for name, group in zip(names, groups):
        save_file({k: t.detach().to("cpu").contiguous() for k, t in group}, str(out / name), metadata=meta)
    _write_index(out, names, [[k for k, _ in group] for group in groups], total)
    return names


def _shard_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_index(out: Path, names: list[str], keys: list[list[str]], total: int) -> None:
    weight_map = {k: name for name, ks in zip(names, keys) for k in ks}
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_shards(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike, *, max_shard_bytes: int,
                 metadata: dict[str, str] | None = None) -> list[str]:
    """write_sharded for a stream of tensors of any total size: holds one shard (<= max_shard_bytes, or a single
    larger tensor) on the host at a time; the shard count is known at the end, so shards are renamed then.
    Returns the file names (`model.safetensors` when one shard suffices)."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    temps: list[Path] = []
    keys: list[list[str]] = []
    group: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    size = total = 0

    def flush():
        temps.append(out / f".shard-{len(temps):05d}.tmp")
        save_file(group, str(temps[-1]), metadata=meta)
        keys.append(list(group))
        group.clear()

    for k, t in named:
        if k in seen:
            raise ValueError(f"tensor {k!r} written twice")
        seen.add(k)
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if group and size + n > max_shard_bytes:
            flush()
            size = 0
        group[k] = t
        size += n
        total += n
    if group or not temps:
        flush()
    if len(temps) == 1:
        temps[0].replace(out / SINGLE_NAME)
        return [SINGLE_NAME]
    names = _shard_names(len(temps))
    for tmp, name in zip(temps, names):
        tmp.replace(out / name)
    _write_index(out, names, keys, total)
    return names

"""Checkpoints in the Hugging Face hub cache: a snapshot folder (files symlinked into ../../blobs) loads by path,
and `org/name[@rev]` resolves offline from the cache (dsv4_model/checkpoint/hub.py) for the API and the CLI.
The cache is the built-in default model written in the hub's own layout (checked with huggingface_hub's
scan_cache_dir). Symlink rules (docs/checkpoints.md): an index entry must name a path inside the folder; a
symlinked shard is followed, except that in a hub snapshot it must stay inside the repo's cache folder."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_model.checkpoint.hub import resolve_checkpoint
from dsv4_model.checkpoint.io import CheckpointError, list_tensors
from dsv4_model.runtime.cli import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
FILES = ("config.json", "tokenizer.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
         "model-00002-of-00002.safetensors")
REV = hashlib.sha1(b"tiny-v4 rev 1").hexdigest()
PROMPT = "import os"

needs_default = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file(), reason="no built-in model")


def _blob_name(name: str, data: bytes) -> str:
    """The hub's blob names: an LFS file's sha256, a plain git file's blob sha1."""
    if name.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_repo(cache: Path, repo_id: str, files: dict[str, bytes | Path], rev: str = REV) -> Path:
    """`cache/models--ORG--NAME` as huggingface_hub leaves it after a download: blobs/, snapshots/REV/ of relative
    symlinks into ../../blobs, refs/main holding REV (no newline). Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for name, src in files.items():
        data = src.read_bytes() if isinstance(src, Path) else src
        blob = _blob_name(name, data)
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    snap = write_hub_repo(cache, "testorg/tiny-v4", {n: DEFAULT_MODEL_DIR / n for n in FILES})
    return cache, snap


@pytest.fixture
def hub_env(hub, monkeypatch):
    """HF_HUB_CACHE for this process: huggingface_hub reads the variable once at import, into its constants."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub[0]))
    return hub


def _greedy(ref) -> list[int]:
    from dsv4_model.checkpoint.tokenizer import load_tokenizer
    from dsv4_model.runtime.engine import Engine
    from dsv4_model.runtime.generate import generate

    engine = Engine.from_pretrained(ref, device="cpu", max_seq_len=64, progress=False)
    tok = load_tokenizer(engine.path, engine.config)
    assert tok.kind == "tokenizer.json"
    return generate(engine, [PROMPT], max_new_tokens=4, temperature=0.0, tokenizer=tok).token_ids[0]


@pytest.fixture(scope="module")
def reference():
    return _greedy(DEFAULT_MODEL_DIR)


def test_the_layout_is_what_huggingface_hub_reads(hub):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub[0])
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == "testorg/tiny-v4" and repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == REV and rev.refs == frozenset({"main"}) and {f.file_name for f in rev.files} == set(FILES)
    assert all((hub[1] / n).is_symlink() for n in FILES)


@needs_default
def test_a_snapshot_path_loads_the_built_in_model(hub, reference):
    snap = hub[1]
    assert resolve_checkpoint(snap) == snap
    infos = list_tensors(snap)
    assert {i.file.name for i in infos.values()} == set(FILES[3:])  # named as in the index, not as blobs
    assert _greedy(snap) == reference and len(reference) == 4


@needs_default
def test_a_repo_id_resolves_offline_from_the_cache(hub_env, reference, monkeypatch):
    cache, snap = hub_env
    for ref in ("testorg/tiny-v4", "testorg/tiny-v4@main", f"testorg/tiny-v4@{REV}"):
        assert resolve_checkpoint(ref).resolve() == snap.resolve(), ref
    assert _greedy("testorg/tiny-v4") == reference
    # the cache is huggingface_hub's, not a path of ours: another HF_HUB_CACHE does not have the repo
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache.parent / "elsewhere"))
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache at .*elsewhere"):
        resolve_checkpoint("testorg/tiny-v4")


def test_unresolvable_references_name_the_argument_and_the_cache(hub_env, monkeypatch):
    cache = str(hub_env[0])
    cases = [("testorg/absent", f"--model testorg/absent: not a directory, and not in the Hugging Face cache at "
                                f"{cache} (download it with `hf download testorg/absent`)"),
             ("testorg/tiny-v4@v9", "--model testorg/tiny-v4@v9: not a directory, and not in the Hugging Face "
                                    "cache (revision v9) at"),
             ("/no/such/dir", "--model /no/such/dir: no such checkpoint directory"),
             ("a/b/c", "--model a/b/c: no such checkpoint directory"),
             ("../x", "--model ../x: no such checkpoint directory"),
             # a relative path to a file looks like ORG/NAME: it is a file, not an uncached repo
             ("tests/test_hf_cache.py", "--model tests/test_hf_cache.py: a file, not a checkpoint directory")]
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for ref, want in cases:
        with pytest.raises(CheckpointError) as e:
            resolve_checkpoint(ref, "--model")
        assert str(e.value).startswith(want) and "\n" not in str(e.value), (ref, str(e.value))


def test_a_partial_download_is_said_as_such(hub_env, monkeypatch):
    errors = pytest.importorskip("huggingface_hub.errors")
    if not hasattr(errors, "IncompleteSnapshotError"):
        pytest.skip("this huggingface_hub does not tell a partial download")

    def partial(repo_id, **kw):
        raise errors.IncompleteSnapshotError(f"The cached snapshot for '{repo_id}' is incomplete", snapshot_path="x")

    monkeypatch.setattr("huggingface_hub.snapshot_download", partial)
    with pytest.raises(CheckpointError, match=r"--model testorg/tiny-v4: not a directory, and only partly in the "
                                              r"Hugging Face cache at .* \(an interrupted download: finish it with "
                                              r"`hf download testorg/tiny-v4`\)$"):
        resolve_checkpoint("testorg/tiny-v4", "--model")


def _cli(*args, cache, module="dsv4_model", command="generate"):
    env = dict(os.environ, HF_HUB_CACHE=str(cache),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", module, command, *args], cwd=ROOT, env=env,
                          capture_output=True, timeout=300)


@needs_default
def test_the_cli_takes_a_repo_id(hub, reference):
    from dsv4_model.checkpoint.tokenizer import load_tokenizer
    from dsv4_model.checkpoint.loader import load_config

    r = _cli("--model", "testorg/tiny-v4", "--prompt", PROMPT, "--max-new-tokens", "4", "--max-seq-len", "64",
             "--quant", "nvfp4", "--no-compile", "--device", "cpu", cache=hub[0])
    assert r.returncode == 0, r.stderr.decode()
    tok = load_tokenizer(DEFAULT_MODEL_DIR, load_config(DEFAULT_MODEL_DIR))
    assert r.stdout.decode() == PROMPT + tok.decode(reference) + "\n"
    # the progress line names the repo, not the snapshot folder (a commit hash)
    assert "loading testorg/tiny-v4" in r.stderr.decode() and f"loading {REV}" not in r.stderr.decode()


@pytest.mark.parametrize("module,args", [("dsv4_model", ["--prompt", "x"]),
                                         ("dsv4_export", ["--out", "{tmp}/never.pt2", "--device", "cpu"])])
def test_the_clis_refuse_an_uncached_id_in_one_line(hub, module, args, tmp_path):
    args = [a.format(tmp=tmp_path) for a in args]
    r = _cli("--model", "testorg/absent", *args, cache=hub[0], module=module,
             command="generate" if module == "dsv4_model" else "build")
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 2 and r.stdout == b"" and len(lines) == 1, r.stderr.decode()
    assert not list(tmp_path.iterdir())
    assert lines[0].startswith(f"error: --model testorg/absent: not a directory, and not in the Hugging Face cache "
                               f"at {hub[0]}"), lines[0]


def _with_index(d: Path, shard_name: str) -> None:
    idx = json.loads((DEFAULT_MODEL_DIR / FILES[2]).read_text())
    first = next(k for k, v in idx["weight_map"].items() if v == FILES[3])
    idx["weight_map"] = {first: shard_name, **{k: v for k, v in idx["weight_map"].items() if k != first}}
    (d / FILES[2]).unlink(missing_ok=True)
    (d / FILES[2]).write_text(json.dumps(idx))


@pytest.mark.parametrize("hub_layout", [False, True], ids=["plain folder", "hub snapshot"])
@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs/outside.safetensors", "sub/../../x.safetensors"])
def test_an_index_entry_outside_the_folder_is_refused(tmp_path, hub_layout, name):
    if hub_layout:
        d = write_hub_repo(tmp_path / "hub", "testorg/evil", {n: DEFAULT_MODEL_DIR / n for n in FILES[3:]})
    else:
        d = tmp_path / "plain"
        d.mkdir()
    (d.parent / "outside.safetensors").write_bytes((DEFAULT_MODEL_DIR / FILES[3]).read_bytes())
    _with_index(d, name)
    with pytest.raises(CheckpointError, match=f"shard '{name}' of .* lies outside"):
        list_tensors(d)


def test_a_symlinked_shard_is_followed_in_a_plain_folder_but_not_out_of_a_hub_repo(tmp_path):
    """Plain folder: the index names files inside it; where its symlinks point is its owner's choice. Hub snapshot:
    every file is a symlink into the repo's blobs, so one pointing elsewhere is a damaged cache, refused."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for n in FILES[2:]:
        os.symlink(DEFAULT_MODEL_DIR / n, plain / n)  # absolute, outside the folder
    assert len(list_tensors(plain)) == len(list_tensors(DEFAULT_MODEL_DIR))
    snap = write_hub_repo(tmp_path / "hub", "testorg/tampered", {n: DEFAULT_MODEL_DIR / n for n in FILES[2:]})
    assert len(list_tensors(snap)) == len(list_tensors(DEFAULT_MODEL_DIR))
    (snap / FILES[4]).unlink()
    os.symlink(DEFAULT_MODEL_DIR / FILES[4], snap / FILES[4])
    with pytest.raises(CheckpointError, match=f"{FILES[4]}: resolves to .* outside its Hugging Face cache folder"):
        list_tensors(snap)


def test_a_cache_whose_blobs_folder_lives_on_another_disk_loads(tmp_path):
    """A hub repo folder whose blobs/ is a symlink to another disk (a cache moved to make room): huggingface_hub
    reads it, and so does the loader (its snapshot links resolve into the blobs' real folder)."""
    snap = write_hub_repo(tmp_path / "hub", "testorg/moved", {n: DEFAULT_MODEL_DIR / n for n in FILES[2:]})
    repo = snap.parent.parent
    shutil.move(str(repo / "blobs"), str(tmp_path / "other_disk_blobs"))
    os.symlink(tmp_path / "other_disk_blobs", repo / "blobs")
    assert len(list_tensors(snap)) == len(list_tensors(DEFAULT_MODEL_DIR))


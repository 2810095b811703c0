"""Training data for the built-in default model: the Python standard library's own source text.

The corpus is read at training time from the running interpreter (``sysconfig.get_paths()["stdlib"]``), so
nothing has to be downloaded. Files are split into train / validation / test BY FILE, by a hash of the relative
path: a file present in two Python versions lands in the same split in both, so the shipped held-out sample
(cut from test files on the training machine) is unseen by the model whatever interpreter trains it.
"""
from __future__ import annotations

import hashlib
import io
import sysconfig
import tokenize as py_tokenize
from pathlib import Path

import torch

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
BOS_ID = 0
EOS_ID = 1

# Test suites are excluded (the task is "library code"), and so are generated tables: the charmap codecs and
# pydoc's topic dump are megabytes of machine output that would dominate a 12 MB corpus.
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data",
                  "__pycache__", "__phello__"}

# Hash buckets out of 1000: [0, 20) test (2%), [20, 40) validation (2%), the rest train.
_TEST_BUCKETS = 20
_VAL_BUCKETS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: str) -> bool:
    parts = rel.split("/")
    if any(p in _EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
        return True
    name = parts[-1]
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def list_stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted relative POSIX paths of the stdlib's non-test ``*.py`` files (sorted: the order fixes the data)."""
    root = stdlib_root() if root is None else Path(root)
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    return sorted(r for r in rels if not _excluded(r))


def split_of(rel: str) -> str:
    """'test', 'val' or 'train' for one relative path; depends on the path only."""
    bucket = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little") % 1000
    if bucket < _TEST_BUCKETS:
        return "test"
    if bucket < _TEST_BUCKETS + _VAL_BUCKETS:
        return "val"
    return "train"


def split_files(rels: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for r in rels:
        out[split_of(r)].append(r)
    return out


def read_source(path: Path) -> str:
    """Decode as Python would (PEP 263 coding cookie); undecodable bytes become U+FFFD rather than failing."""
    raw = Path(path).read_bytes()
    try:
        encoding, _ = py_tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError:
        encoding = "utf-8"
    return raw.decode(encoding, errors="replace")


def read_texts(rels: list[str], root: Path | None = None) -> list[str]:
    root = stdlib_root() if root is None else Path(root)
    return [read_source(root / r) for r in rels]


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """Byte-level BPE (every byte is reachable, so any text encodes); <bos>=0 and <eos>=1.

    ``encode`` prepends <bos> by itself (post-processor), so a prompt encoded by the CLI starts the way every
    training document starts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(BOS_TOKEN) == BOS_ID and tok.token_to_id(EOS_TOKEN) == EOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    return tok


def encode_documents(tok, texts: list[str]) -> torch.Tensor:
    """One int64 stream: ``<bos> doc <eos> <bos> doc <eos> ...``."""
    encs = tok.encode_batch(texts, add_special_tokens=True)
    ids: list[int] = []
    for e in encs:
        ids.extend(e.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def heldout_sample(texts: list[str], n_chars: int) -> str:
    """The first ``n_chars`` characters of the test files, whole files first (cut at a line end)."""
    out: list[str] = []
    left = n_chars
    for t in texts:
        if left <= 0:
            break
        if len(t) > left:
            t = t[:left]
            t = t[: t.rfind("\n") + 1] or t
        out.append(t)
        left -= len(t)
    return "\x00".join(out)


def sample_documents(sample: str) -> list[str]:
    """Inverse of :func:`heldout_sample`'s joining (NUL never occurs in stdlib source)."""
    return sample.split("\x00")


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping [n, seq_len + 1] windows (inputs = w[:, :-1], targets = w[:, 1:]); tail dropped."""
    n = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


class WindowSampler:
    """Random [batch, seq_len + 1] windows of a token stream, reproducible from a seed."""

    def __init__(self, stream: torch.Tensor, batch_size: int, seq_len: int, seed: int, device="cpu"):
        if stream.numel() <= seq_len + 1:
            raise ValueError(f"stream of {stream.numel()} tokens is too short for seq_len {seq_len}")
        self.stream = stream.to(device)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=device)

    def next(self) -> torch.Tensor:
        hi = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, hi + 1, (self.batch_size,), generator=self.gen).to(self.stream.device)
        return self.stream[starts[:, None] + self.offsets[None, :]]

"""Tokenizer of a checkpoint directory, plus incremental (streaming) detokenization.

`load_tokenizer(path, config)` wraps `<path>/tokenizer.json` (HF `tokenizers`); a checkpoint without one
(random tiny checkpoints: a vocabulary of at most BYTE_FALLBACK_MAX_VOCAB ids) gets `ByteTokenizer`, a byte-level
fallback sized to the vocabulary. BOS/EOS ids come from the model config, so both kinds agree with the model about
special tokens.
"""
from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_NAME = "tokenizer.json"
# A byte-level vocabulary is 256 byte ids plus a few specials (rounded up, as vocabularies are padded); a larger
# one was trained with its own tokenizer, and byte ids would feed it text it never saw (meaningless output).
BYTE_FALLBACK_MAX_VOCAB = 512


class HFTokenizer:
    """`tokenizers.Tokenizer` from tokenizer.json; `encode` starts with exactly one BOS."""

    kind = "tokenizer.json"

    def __init__(self, path: str | os.PathLike, bos_id: int, eos_id: int):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # ids need not be dense: the largest one bounds what the model's embedding must hold
        self.n_ids = max(self.vocab_size, max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_bos).ids
        if add_bos and (not ids or ids[0] != self.bos_id):  # the post-processor may or may not add it
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class ByteTokenizer:
    """Byte-level fallback: id = special ids, then one id per byte in a fixed preference order.

    With V >= 256 + specials every byte has an id (lossless). A smaller vocabulary (tiny test models) keeps
    newline, printable ASCII, then the rest in order of usefulness; a byte without an id encodes as '?'.
    """

    kind = "bytes"

    def __init__(self, vocab_size: int, bos_id: int, eos_id: int):
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self.vocab_size = int(vocab_size)
        self._first = max(self.bos_id, self.eos_id) + 1
        order = [10, 9] + list(range(32, 127)) + [b for b in range(256) if b not in (9, 10) and not 32 <= b < 127]
        n = max(0, self.vocab_size - self._first)
        self._bytes = order[:n]
        self._id_of = {b: self._first + i for i, b in enumerate(self._bytes)}
        self._unknown = self._id_of.get(ord("?"), self._first if n else self.eos_id)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self._id_of.get(b, self._unknown) for b in text.encode("utf-8")]
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            j = int(i) - self._first
            if 0 <= j < len(self._bytes):
                out.append(self._bytes[j])
        return out.decode("utf-8", errors="replace")


def load_tokenizer(path: str | os.PathLike | None, config, *, require: bool = True) -> HFTokenizer | ByteTokenizer:
    """The tokenizer for a checkpoint at `path` (None: the byte-level fallback; a directory without tokenizer.json:
    the fallback too where the vocabulary is byte-sized, see BYTE_FALLBACK_MAX_VOCAB). Raises CheckpointError naming
    tokenizer.json when it cannot be read, holds more ids than the model's vocabulary, or (require) is missing for a
    model whose vocabulary needs it; require=False: the fallback then, with a warning (a random full-size
    checkpoint driven by token ids, whose texts mean nothing anyway)."""
    bos, eos = int(getattr(config, "bos_token_id", 0)), int(getattr(config, "eos_token_id", 1))
    vocab = int(config.vocab_size)
    if path is not None:
        f = Path(path) / TOKENIZER_NAME
        if f.is_file():
            try:
                tok = HFTokenizer(f, bos, eos)
            except ImportError:
                raise
            except Exception as e:  # `tokenizers` raises a bare Exception for any bad file
                raise _error(f"{f}: cannot read the tokenizer: {e}") from e
            if tok.n_ids > vocab:
                raise _error(f"{f}: the tokenizer has {tok.n_ids} token ids (added tokens included), more than the "
                             f"model's vocab_size {vocab}: it is not this model's tokenizer")
            return tok
        if Path(path).is_dir() and vocab > BYTE_FALLBACK_MAX_VOCAB and not require:
            import warnings

            warnings.warn(f"{f} is missing: byte-level fallback tokenizer for a model of vocab_size {vocab} (its "
                          "texts mean nothing; give token ids, or put the model's tokenizer.json there)", stacklevel=2)
        elif Path(path).is_dir() and vocab > BYTE_FALLBACK_MAX_VOCAB:
            raise _error(f"{f}: missing: a model with vocab_size {vocab} needs its own tokenizer (the byte-level "
                         f"fallback serves vocabularies of at most {BYTE_FALLBACK_MAX_VOCAB} ids); `hf download` of "
                         "the model's repo brings tokenizer.json with the weights")
    return ByteTokenizer(vocab, bos, eos)


def _error(msg: str) -> Exception:
    from dsv4_model.checkpoint.io import CheckpointError  # (io imports torch; the tokenizer alone does not)

    return CheckpointError(msg)


class StreamDecoder:
    """Turns a growing list of token ids into text increments.

    Byte-level BPE tokens can end inside a UTF-8 character and decoding is context dependent (leading
    spaces), so each increment is the difference of two decodes over a short trailing window, held back
    while the text ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window that gives decode context
        self._read = 0  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self._prefix : self._read])
        after = self.tok.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self.tok.decode(self.ids[self._prefix : self._read])
        after = self.tok.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]

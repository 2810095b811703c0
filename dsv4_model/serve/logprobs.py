"""Log-probability objects of the responses: /v1/completions' (tokens, token_logprobs, top_logprobs, text_offset)
and /v1/chat/completions' (content[].token / logprob / bytes / top_logprobs), from the scheduler's per-token
entries (log-probability, [(id, log-probability)] of the most likely)."""
from __future__ import annotations

from dsv4_model.checkpoint.tokenizer import StreamDecoder


def text_offsets(tok, ids: list[int], start: int, end: int | None = None) -> list[int]:
    """Where each token's text starts in the text the streaming detokenizer makes of `ids` (from `start`; a token
    ending inside a character: where that character starts), so offsets rise as the returned text does; clamped to
    `end` (an echoed prompt whose given text is shorter than its tokens' decode, e.g. a BOS token)."""
    dec, out, at = StreamDecoder(tok), [], start
    for t in ids:
        out.append(at if end is None else min(at, end))
        at += len(dec.push(t))
    return out


def completion_logprobs(tok, ids: list[int], entries: list, offsets: list[int]) -> dict:
    """/v1/completions' logprobs object for tokens `ids` whose texts start at `offsets` of the returned text. Each
    top_logprobs entry holds the k most likely tokens and the chosen one (so up to k + 1, as OpenAI and vLLM give),
    keyed by their text: distinct tokens of one text (byte pieces of characters all read U+FFFD) share a key, which
    keeps the most likely's value (so the chosen token's is its own log-probability where it is the most likely)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for t, (lp, top) in zip(ids, entries):
        s = tok.decode([t])
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        alts: dict[str, float | None] = {}
        for key, v in [(tok.decode([a]), v) for a, v in top] + [(s, lp)]:
            if key not in alts or (v is not None and (alts[key] is None or v > alts[key])):
                alts[key] = v
        out["top_logprobs"].append(alts)
    return out


def prompt_logprobs(tok, ids: list[int], entries: list, end: int) -> dict:
    """/v1/completions' logprobs object for an echoed prompt `ids` whose returned text is `end` characters long
    (entries: its tokens' from the second; the first has none, null as OpenAI gives it)."""
    out = completion_logprobs(tok, ids, [(None, [])] + list(entries), text_offsets(tok, ids, 0, end))
    out["top_logprobs"][0] = None
    return out


def chat_logprobs(tok, token_bytes: "TokenBytes", ids: list[int], entries: list) -> dict:
    """/v1/chat/completions' logprobs object ({"content": [...]}) for tokens `ids`."""
    def one(t: int, lp: float) -> dict:
        return {"token": tok.decode([t]), "logprob": lp, "bytes": list(token_bytes(t))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(a, v) for a, v in top]} for t, (lp, top) in
                        zip(ids, entries)]}


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode, inverted): the character that stands for each byte in
    a vocabulary string -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in bs]  # the bytes not printable as themselves: U+0100 on, in order
    return {**{chr(b): b for b in bs}, **{chr(256 + n): b for n, b in enumerate(rest)}}


class TokenBytes:
    """A token's own UTF-8 bytes (chat logprobs' `bytes`). A byte-level BPE tokenizer (tokenizer.json with a
    ByteLevel decoder, as DeepSeek's) spells each token's bytes in its vocabulary string, so a token holding part
    of a character gives those bytes (its decoded text is U+FFFD's); added tokens and other tokenizers: the bytes of
    the token's decoded text."""

    def __init__(self, tok):
        self.tok = tok
        hf = getattr(tok, "_tok", None)  # HFTokenizer's tokenizers.Tokenizer
        self.hf = hf if hf is not None and type(hf.decoder).__name__ == "ByteLevel" else None
        self.added = set() if self.hf is None else set(self.hf.get_added_tokens_decoder())
        self.alphabet = _byte_alphabet()

    def __call__(self, t: int) -> bytes:
        if self.hf is not None and t not in self.added:
            s = self.hf.id_to_token(t)
            if s is not None and all(c in self.alphabet for c in s):
                return bytes(self.alphabet[c] for c in s)
        return self.tok.decode([t]).encode("utf-8")


class Entries:
    """A choice's generated tokens and their logprob entries, each let out once the text returned so far reaches
    into its token's text. A stop string's tokens (their text cut from the response) never are, and a token whose
    text is held back (a possible stop string, a character's first bytes) waits for it: a stream lets out exactly
    the entries of the whole response, with offsets into the text returned."""

    def __init__(self, tok, start: int = 0):
        self.dec, self.at = StreamDecoder(tok), start
        self.pending: list[tuple[int, tuple, int]] = []  # (token id, entry, where its text starts)

    def push(self, token_id: int, entry: tuple) -> None:
        self.pending.append((token_id, entry, self.at))
        self.at += len(self.dec.push(token_id))

    def take(self, shown: int) -> tuple[list[int], list[tuple], list[int]]:
        """(ids, entries, offsets) of the tokens whose text starts before `shown`, the returned text's end."""
        n = next((j for j, p in enumerate(self.pending) if p[2] >= shown), len(self.pending))
        out, self.pending = self.pending[:n], self.pending[n:]
        return [p[0] for p in out], [p[1] for p in out], [p[2] for p in out]

    def finish(self, shown: int, cut: bool) -> tuple[list[int], list[tuple], list[int]]:
        """At the end: the rest (cut: a stop string ended the text, and tokens past its end stay out)."""
        if not cut:
            shown = self.at + 1  # every one: none starts past the decoded text
        out = self.take(shown)
        self.pending = []
        return out

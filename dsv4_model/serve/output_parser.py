"""Model output (DeepSeek-V4 format) -> reasoning, content and tool calls, incrementally.

Text arrives in pieces that may end anywhere, also inside a tag; a piece's tail that could still become a tag is
held back until the next piece decides it. In thinking mode the text up to `</think>` is reasoning; then content up
to a DSML block `<｜DSML｜tool_calls> <｜DSML｜invoke name="f"> <｜DSML｜parameter name="k" string="true|false">v
</｜DSML｜parameter> ... </｜DSML｜invoke> ... </｜DSML｜tool_calls>`, whose invokes become tool calls, streamed as
OpenAI streams them: a call opens with its name (and `{`) once its invoke tag is complete, then its arguments come
in pieces, a JSON object string built up as the model writes it (a parameter's key once its tag is complete, a
string="true" value's text JSON-escaped as it arrives, a string="false" value, JSON, whole at its closing tag, `}`
at `</｜DSML｜invoke>`). On well-formed output the result is the one of parse_message_from_completion_text in the
checkpoint's encoding/encoding_dsv4.py (which raises on anything else): the blank line before the block is not
content, arguments are `{"k": v, ...}` with string values JSON-quoted and string="false" values as the model wrote
them (tests/test_output_parser.py holds its results). Text the parser cannot read as DSML goes to content as it is,
never dropped: a block that does not start with an invoke from its opening tag on, an invoke that stops being DSML
(also one repeating a parameter name) from that point on, its call closed (`}`) where it stopped. An invoke cut off
by the end of the output (max_tokens) stays as far as it came: its arguments unfinished; a block's opening tag cut
off is not text. The server reads the parser through WholeCalls, which lets a call out only once it is closed."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from dsv4_model.serve.chat_encoding import (DSML, INVOKE_CLOSE, PARAM_CLOSE, THINK, THINK_END, TOOL_CALLS_CLOSE,
                                            TOOL_CALLS_OPEN)

INVOKE_OPEN = f"<{DSML}invoke"
PARAM_OPEN = f"<{DSML}parameter"
_INVOKE_ATTRS = (("name", None),)
_PARAM_ATTRS = (("name", None), ("string", ("true", "false")))


@dataclass
class ToolCall:
    """A tool call, or a piece of one while it streams: the first piece of a call carries its name (a client
    gets id, type and name with it), the pieces after carry name None and the next part of the arguments; the
    pieces' arguments joined are the call's JSON object."""

    index: int  # order in this response
    name: str | None
    arguments: str


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: "Delta") -> None:
        """Append `other`; pieces of one call join into one entry (so a sum of deltas holds whole calls)."""
        self.reasoning += other.reasoning
        self.content += other.content
        for c in other.tool_calls:
            if self.tool_calls and self.tool_calls[-1].index == c.index:
                self.tool_calls[-1].arguments += c.arguments
            else:
                self.tool_calls.append(ToolCall(c.index, c.name, c.arguments))  # a copy: it grows here


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper beginning of one of `tags`."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


def _before_block(text: str) -> str:
    """Text before a DSML block, less the block's blank line (the encoder writes `\\n\\n<｜DSML｜tool_calls>`)."""
    for _ in range(2):
        if text.endswith("\n"):
            text = text[:-1]
    return text


def _uncut(text: str, tags: tuple[str, ...]) -> int:
    """At the end of the output: how much of `text` is text, less a block's opening tag cut off there (one that
    got as far as DSML is markup) and the blank line before it."""
    n = _partial_tag(text, tags)
    if n == 0 or DSML not in text[-n:]:
        return len(text)
    return len(_before_block(text[:-n]))


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How much of `text` is certain: all but a tag's possible beginning and the newlines before it (the blank
    line before a DSML block belongs to the block); no tags: all of it."""
    if not tags:
        return len(text)
    n = len(text) - _partial_tag(text, tags)
    while n > 0 and text[n - 1] == "\n":
        n -= 1
    return n


def _json(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_value(text: str) -> str:
    """A string="false" value as the encoder's parser writes it: as it is when it is JSON, else JSON-quoted (so
    the arguments stay JSON)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return _json(text)
    return text


def _scan_tag(text: str, head: str, attrs) -> tuple[list[str], int] | None | bool:
    """Read the tag `head attr="v" ... >` at the start of `text` (whitespace where the encoder's parser allows
    it: some before each attribute, any before `>`; attrs: (name, allowed values or None)). Returns (values,
    the tag's length) when it is complete, None while `text` may still become it (it ends first), False when it
    cannot."""
    n = len(text)

    def literal(i: int, s: str):
        got = text[i:i + len(s)]
        if got == s:
            return i + len(s)
        return None if i + len(got) == n and s.startswith(got) else False

    i = literal(0, head)
    if not i:
        return i
    values = []
    for attr, allowed in attrs:
        j = i
        while j < n and text[j].isspace():
            j += 1
        if j == n:
            return None
        if j == i:
            return False
        i = literal(j, attr + '="')
        if not i:
            return i
        k = text.find('"', i)
        value = text[i:] if k < 0 else text[i:k]
        if allowed is not None and not any(a.startswith(value) if k < 0 else a == value for a in allowed):
            return False
        if k < 0:
            return None
        values.append(value)
        i = k + 1
    while i < n and text[i].isspace():
        i += 1
    if i == n:
        return None
    return (values, i + 1) if text[i] == ">" else False


class OutputParser:
    """feed(text) -> Delta of what is certain so far; finish() -> the rest. thinking: the prompt ended with
    `<think>`, so the output starts as reasoning. tools: read DSML blocks as tool calls (False: the request gave no
    tools or tool_choice 'none', and whatever the model writes is reasoning / content text).

    States: reasoning, content, tools (in a DSML block, between invokes), invoke (in an invoke, between
    parameters), string / literal (in a string="true" / "false" parameter's value)."""

    def __init__(self, thinking: bool, tools: bool = True):
        self.state = "reasoning" if thinking else "content"
        self.block_open = (TOOL_CALLS_OPEN,) if tools else ()  # the tags that open a block of calls
        self.buf = ""
        self.started = False  # reasoning emitted yet (a leading "<think>" echoed by the model is dropped)
        self.calls = 0  # calls opened; the one being read is calls - 1
        self.closed = 0  # calls whose arguments are complete (`}` written)
        self.block_calls = 0  # calls opened in the current DSML block
        self.keys: set[str] = set()  # parameter names of the call being read
        self.scanned = 0  # literal state: how much of buf is known to hold no closing tag

    def feed(self, text: str) -> Delta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> Delta:
        return self._run(final=True)

    def _run(self, final: bool) -> Delta:
        out = Delta()
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out, final)
            if (self.state, len(self.buf)) == before:  # waiting for more text
                break
        return out

    def _args(self, out: Delta, text: str, name: str | None = None) -> None:
        """The call being read: `text` more of its arguments (name: it opens here)."""
        index = self.calls - 1
        if out.tool_calls and out.tool_calls[-1].index == index:
            out.tool_calls[-1].arguments += text
        else:
            out.tool_calls.append(ToolCall(index, name, text))

    # ------------------------------------------------------------------ states
    def _reasoning(self, out: Delta, final: bool) -> None:
        if not self.started:
            if THINK.startswith(self.buf) and not final:
                return
            if self.buf.startswith(THINK):
                self.buf = self.buf[len(THINK):]
            self.started = True
        ends = [(i, tag) for tag in (THINK_END, *self.block_open) if (i := self.buf.find(tag)) >= 0]
        if ends:
            i, tag = min(ends)
            if tag == THINK_END:
                out.reasoning += self.buf[:i]
                self.state = "content"
            else:
                out.reasoning += _before_block(self.buf[:i])
                self._open_block()
            self.buf = self.buf[i + len(tag):]
            return
        tags = (THINK_END, *self.block_open)
        n = _uncut(self.buf, tags) if final else _held(self.buf, tags)
        out.reasoning += self.buf[:n]
        self.buf = self.buf[n:]

    def _content(self, out: Delta, final: bool) -> None:
        i = self.buf.find(TOOL_CALLS_OPEN) if self.block_open else -1
        if i >= 0:
            out.content += _before_block(self.buf[:i])  # the blank line before a block belongs to the block
            self.buf = self.buf[i + len(TOOL_CALLS_OPEN):]
            self._open_block()
            return
        n = _uncut(self.buf, self.block_open) if final else _held(self.buf, self.block_open)
        out.content += self.buf[:n]
        self.buf = self.buf[n:]

    def _open_block(self) -> None:
        self.state = "tools"
        self.block_calls = 0

    def _tools(self, out: Delta, final: bool) -> None:
        rest = self.buf.lstrip()
        if rest.startswith(TOOL_CALLS_CLOSE):
            self.buf = rest[len(TOOL_CALLS_CLOSE):]
            self.state = "content"
            return
        tag = _scan_tag(rest, INVOKE_OPEN, _INVOKE_ATTRS)
        if tag:
            (name,), end = tag
            self.calls += 1
            self.block_calls += 1
            self.keys = set()
            self._args(out, "{", name)
            self.buf = rest[end:]
            self.state = "invoke"
            return
        if not rest or tag is None or TOOL_CALLS_CLOSE.startswith(rest):
            if final:  # the output ended inside a tag: nothing of it is text
                self.buf = ""
            return  # a tag still arriving
        # not DSML after all: from the block's opening tag when no call came out of it, else from here
        out.content += TOOL_CALLS_OPEN if self.block_calls == 0 else ""
        self.buf = rest
        self.state = "content"

    def _invoke(self, out: Delta, final: bool) -> None:
        rest = self.buf.lstrip()
        if rest.startswith(INVOKE_CLOSE):
            self._args(out, "}")
            self.closed = self.calls
            self.buf = rest[len(INVOKE_CLOSE):]
            self.state = "tools"
            return
        tag = _scan_tag(rest, PARAM_OPEN, _PARAM_ATTRS)
        if tag and tag[0][0] not in self.keys:  # a repeated name is not the format (the encoder's parser refuses it)
            (key, string), end = tag
            self._args(out, (", " if self.keys else "") + _json(key) + ": " + ('"' if string == "true" else ""))
            self.keys.add(key)
            self.buf = rest[end:]
            self.state = "string" if string == "true" else "literal"
            return
        if not rest or tag is None or INVOKE_CLOSE.startswith(rest):
            if final:  # cut off: the call stays as far as it came
                self.buf = ""
            return
        # not DSML from here: the call ends where it stopped, the rest is text
        self._args(out, "}")
        self.closed = self.calls
        self.buf = rest
        self.state = "content"

    def _string(self, out: Delta, final: bool) -> None:
        i = self.buf.find(PARAM_CLOSE)
        if i >= 0:
            self._args(out, _json(self.buf[:i])[1:-1] + '"')
            self.buf = self.buf[i + len(PARAM_CLOSE):]
            self.state = "invoke"
            return
        n = len(self.buf) - _partial_tag(self.buf, (PARAM_CLOSE,))
        if n:
            # JSON escapes one character at a time, so escaped pieces join into the escaped whole
            self._args(out, _json(self.buf[:n])[1:-1])
        self.buf = "" if final else self.buf[n:]  # final: cut off (a closing tag's beginning is not text)

    def _literal(self, out: Delta, final: bool) -> None:
        # a value held until its closing tag is searched from where the last search stopped (a long one would
        # otherwise be rescanned at every token)
        i = self.buf.find(PARAM_CLOSE, max(0, self.scanned - len(PARAM_CLOSE) + 1))
        if i >= 0:
            self._args(out, _json_value(self.buf[:i]))
            self.buf = self.buf[i + len(PARAM_CLOSE):]
            self.state = "invoke"
            self.scanned = 0
        elif final:  # cut off: a JSON value is sent whole or not at all
            self.buf = ""
        else:
            self.scanned = len(self.buf)


class WholeCalls:
    """An OutputParser whose tool calls come out whole: a call's pieces are held until its arguments are complete
    (its invoke closed), and a call the output cut off (max_tokens, a stop string, EOS inside it) never comes out:
    its arguments would be unfinished JSON a client would run or fail on. Streamed or not, the same calls."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self.held: list[ToolCall] = []  # pieces of calls not closed yet, joined per call

    def feed(self, text: str) -> Delta:
        return self._gate(self.parser.feed(text), final=False)

    def finish(self) -> Delta:
        return self._gate(self.parser.finish(), final=True)

    def _gate(self, d: Delta, final: bool) -> Delta:
        held = Delta(tool_calls=self.held)
        held.add(Delta(tool_calls=d.tool_calls))
        done = self.parser.closed
        d.tool_calls = [c for c in held.tool_calls if c.index < done]
        self.held = [] if final else [c for c in held.tool_calls if c.index >= done]  # final: cut off, dropped
        return d

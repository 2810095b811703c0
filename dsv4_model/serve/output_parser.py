"""Model output (DeepSeek-V4 format) -> reasoning, content and tool calls, incrementally.

Text arrives in pieces that may end anywhere, also inside a tag; a piece's tail that could still become a tag is
held back until the next piece decides it. In thinking mode the text up to `</think>` is reasoning; then content up
to a DSML block `<｜DSML｜tool_calls> <｜DSML｜invoke name="f"> <｜DSML｜parameter name="k" string="true|false">v
</｜DSML｜parameter> ... </｜DSML｜invoke> ... </｜DSML｜tool_calls>`, whose invokes become tool calls (each one
whole, when its closing tag arrives; arguments a JSON object string). On well-formed output the result is the one
of parse_message_from_completion_text in the checkpoint's encoding/encoding_dsv4.py (which raises on anything else):
the blank line before the block is not content, arguments are `{"k": v, ...}` with string values JSON-quoted and
string="false" values as the model wrote them (tests/test_output_parser.py holds its results). Text the parser cannot
read as DSML (also an invoke repeating a parameter name) goes to content as it is, never dropped; an invoke cut off by
the end of the output (max_tokens) is dropped."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from dsv4_model.serve.chat_encoding import DSML, INVOKE_CLOSE, THINK, THINK_END, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN

INVOKE_OPEN = f"<{DSML}invoke"
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>(.*){re.escape(INVOKE_CLOSE)}', re.DOTALL)
_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{DSML}parameter>',
                    re.DOTALL)


@dataclass
class ToolCall:
    index: int  # order in this response
    name: str
    arguments: str  # a JSON object


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: "Delta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


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


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How much of `text` is certain: all but a tag's possible beginning and the newlines before it (the blank
    line before a DSML block belongs to the block)."""
    n = len(text) - _partial_tag(text, tags)
    while n > 0 and text[n - 1] == "\n":
        n -= 1
    return n


def _json(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_invoke(text: str, index: int) -> ToolCall | None:
    """One complete `<｜DSML｜invoke ...>...</｜DSML｜invoke>` -> ToolCall, None when malformed (also a parameter
    name given twice). Arguments as the encoder's decode_dsml_to_arguments writes them: `{"k": v, ...}`, a
    string="true" value JSON-quoted, a string="false" value as it is (it is JSON; one that is not is quoted)."""
    m = _INVOKE.fullmatch(text)
    if m is None:
        return None
    name, body = m.group(1), m.group(2)
    args: dict[str, str] = {}
    for key, is_str, value in _PARAM.findall(body):
        if key in args:
            return None
        if is_str == "false":
            try:
                json.loads(value)
            except json.JSONDecodeError:
                value = _json(value)
        else:
            value = _json(value)
        args[key] = value
    if _PARAM.sub("", body).strip():  # text between parameters: not the format
        return None
    return ToolCall(index, name, "{" + ", ".join(f"{_json(k)}: {v}" for k, v in args.items()) + "}")


class OutputParser:
    """feed(text) -> Delta of what is certain so far; finish() -> the rest. thinking: the prompt ended with
    `<think>`, so the output starts as reasoning."""

    def __init__(self, thinking: bool):
        self.state = "reasoning" if thinking else "content"
        self.buf = ""
        self.started = False  # reasoning emitted yet (a leading "<think>" echoed by the model is dropped)
        self.calls = 0
        self.dropped_partial_call = False

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out, final=False)
            if (self.state, len(self.buf)) == before:  # waiting for more text
                break
        return out

    def finish(self) -> Delta:
        out = Delta()
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out, final=True)
            if (self.state, len(self.buf)) == before:
                break
        return out

    # ------------------------------------------------------------------ states
    def _reasoning(self, out: Delta, final: bool) -> None:
        if not self.started:
            if THINK.startswith(self.buf) and not final:
                return
            if self.buf.startswith(THINK):
                self.buf = self.buf[len(THINK):]
            self.started = True
        ends = [(i, tag) for tag in (THINK_END, TOOL_CALLS_OPEN) if (i := self.buf.find(tag)) >= 0]
        if ends:
            i, tag = min(ends)
            out.reasoning += self.buf[:i] if tag == THINK_END else _before_block(self.buf[:i])
            self.buf = self.buf[i + len(tag):]
            self.state = "content" if tag == THINK_END else "tools"
            return
        n = len(self.buf)
        if not final:
            n = _held(self.buf, (THINK_END, TOOL_CALLS_OPEN))
        out.reasoning += self.buf[:n]
        self.buf = self.buf[n:]

    def _content(self, out: Delta, final: bool) -> None:
        i = self.buf.find(TOOL_CALLS_OPEN)
        if i >= 0:
            out.content += _before_block(self.buf[:i])  # the blank line before a block belongs to the block
            self.buf = self.buf[i + len(TOOL_CALLS_OPEN):]
            self.state = "tools"
            return
        n = len(self.buf) if final else _held(self.buf, (TOOL_CALLS_OPEN,))
        out.content += self.buf[:n]
        self.buf = self.buf[n:]

    def _tools(self, out: Delta, final: bool) -> None:
        rest = self.buf.lstrip()
        if rest.startswith(TOOL_CALLS_CLOSE):
            self.buf = rest[len(TOOL_CALLS_CLOSE):]
            self.state = "content"
            return
        if rest.startswith(INVOKE_OPEN):
            j = rest.find(INVOKE_CLOSE)
            if j >= 0:
                end = j + len(INVOKE_CLOSE)
                call = parse_invoke(rest[:end], self.calls)
                if call is None:
                    return self._malformed(out, rest[:end], rest[end:])
                self.calls += 1
                out.tool_calls.append(call)
                self.buf = rest[end:]
            elif final:
                self.dropped_partial_call, self.buf = True, ""
            return
        if rest and not final and any(t.startswith(rest) for t in (INVOKE_OPEN, TOOL_CALLS_CLOSE)):
            return  # a tag still arriving
        if final and not rest:
            self.buf = ""
            return
        if rest:
            self._malformed(out, "", rest)

    def _malformed(self, out: Delta, text: str, rest: str) -> None:
        """Not DSML after all: the block's text goes to content as it came (from its opening tag)."""
        out.content += TOOL_CALLS_OPEN + text
        self.buf = rest
        self.state = "content"

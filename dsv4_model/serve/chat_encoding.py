"""DeepSeek-V4's chat prompt, written from the rules of the checkpoint's `encoding/encoding_dsv4.py`
(encode_messages; V4 ships no jinja template; vLLM's tokenizer mode `deepseek_v4` and SGLang apply that encoder) and
checked against it: tests/test_chat_encoding.py holds the strings that encoder gives for a table of conversations.
docs/serving.md "Chat format" lists the rules, and what of the encoder the API does not express.

    BOS [effort text] {system} [\\n\\n## Tools ...] <｜User｜>{user} <｜Assistant｜> <think> | </think>
    assistant turn: [{reasoning}</think>]{content}[\\n\\n<｜DSML｜tool_calls>...]<｜end▁of▁sentence｜>
    latest_reminder message: <｜latest_reminder｜>{text}

There is no tool role: tool results (and user text around them) fold into one user turn as
`<tool_result>...</tool_result>` blocks in the order of the calls. In thinking mode, reasoning of assistant turns
before the last user turn is dropped, unless tools are present or drop_thinking is off."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML)

TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_CLOSE = f"</{DSML}parameter>"

_ABSOLUTE_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose"
    " the problem into its most fundamental components, trace every causal chain to its root, and resolve the"
    " underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain"
    " that no assumption remains unchecked and no error remains undiscovered.\n\n")

# Effort level -> text put before message 0 in thinking mode, per encoder release. "v4": the encoder vLLM quotes
# (levels high = default, nothing; max). "v4-tiered": later copies (low = default, nothing; high; max).
EFFORT_TABLES: dict[str, dict[str, str]] = {
    "v4": {"high": "", "max": _ABSOLUTE_MAX},
    "v4-tiered": {"low": "", "high": _ABSOLUTE_MAX, "max": _BEYOND_MAX},
}
# OpenAI's reasoning_effort values -> a table's level ("none" turns thinking off); "v4" as vLLM's deepseek_v4
# tokenizer maps them onto the encoder's levels (max and xhigh -> max, the rest -> high)
_EFFORT_ALIASES = {
    "v4": {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max", "max": "max"},
    "v4-tiered": {"minimal": "low", "low": "low", "medium": "low", "high": "high", "xhigh": "high", "max": "max"},
}

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{d}tool_calls>" block like the following:

<{d}tool_calls>
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
</{d}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {t}), you MUST output your complete reasoning inside {t}...{te} BEFORE any tool calls or final response.

Otherwise, output directly after {te} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatError(ValueError):
    """A conversation the format cannot encode; `param` names the request field (an HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatOptions:
    """thinking: `<think>` after the last `<｜Assistant｜>` (else `</think>`). effort: a level of
    EFFORT_TABLES[table], None = the table's default (nothing added)."""

    thinking: bool = True
    effort: str | None = None
    table: str = "v4"
    drop_thinking: bool = True


def resolve_options(thinking: bool | None, reasoning_effort: str | None, table: str = "v4",
                    drop_thinking: bool | None = None) -> ChatOptions:
    """The request's switches -> ChatOptions (encode_messages' thinking_mode, reasoning_effort, drop_thinking):
    thinking on unless turned off; reasoning_effort "none" turns it off; other OpenAI levels map onto the table's
    levels (as vLLM's deepseek_v4 mode maps them); drop_thinking on unless turned off."""
    on = True if thinking is None else bool(thinking)
    drop = True if drop_thinking is None else bool(drop_thinking)
    if reasoning_effort is None:
        return ChatOptions(thinking=on, table=table, drop_thinking=drop)
    if reasoning_effort == "none":
        return ChatOptions(thinking=False, table=table, drop_thinking=drop)
    level = _EFFORT_ALIASES[table].get(reasoning_effort)
    if level is None:
        allowed = ["none", *_EFFORT_ALIASES[table]]
        raise ChatError(f"reasoning_effort must be one of {allowed}, got {reasoning_effort!r}", "reasoning_effort")
    return ChatOptions(thinking=on, effort=level, table=table, drop_thinking=drop)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """OpenAI `tools` ([{"type": "function", "function": {...}}]) -> the tools section of the system text."""
    schemas = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatError(f"tools[{i}]: needs a function with a name", "tools")
        schemas.append(_json(fn))
    return _TOOLS_SECTION.format(d=DSML, t=THINK, te=THINK_END, schemas="\n".join(schemas))


def _arguments(call: dict, where: str) -> dict:
    """A call's arguments as the parameters to write. As the encoder does: a string that is not JSON (also "")
    becomes one string parameter `arguments`. Beyond it: missing / null -> no parameters, an object as it is."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatError(f"{where}: needs a function with a name", "messages")
    args = fn.get("arguments")
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {"arguments": args}
    if not isinstance(args, dict):
        raise ChatError(f"{where}.function.arguments: must be a JSON object", "messages")
    return args


def render_tool_calls(calls: list[dict], where: str) -> str:
    """An assistant turn's tool_calls as the DSML block (preceded by a blank line)."""
    invokes = []
    for j, call in enumerate(calls):
        args = _arguments(call, f"{where}.tool_calls[{j}]")
        params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else _json(v)}{PARAM_CLOSE}' for k, v in args.items()]
        name = call["function"]["name"]
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"\n\n{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _text(content: Any, where: str, sep: str = "") -> str:
    """Message content: a string, None, or OpenAI text parts (joined by `sep`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}.content: only text parts are supported, got {kind!r}", "messages")
            out.append(part["text"])
        return sep.join(out)
    raise ChatError(f"{where}.content: must be a string or a list of text parts", "messages")


@dataclass
class _Turn:
    role: str  # system | developer | user | assistant | latest_reminder
    text: str = ""
    reasoning: str = ""
    calls: list | None = None
    tools: list | None = None
    where: str = ""


def _fold(messages: list[dict]) -> list[_Turn]:
    """OpenAI messages -> turns: runs of tool / user messages become one user turn whose parts are joined by a
    blank line, tool results ordered as the preceding assistant turn called them."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages: needs at least one message", "messages")
    turns: list[_Turn] = []
    parts: list[tuple[int, str]] = []  # (call order or -1 for text, rendered part) of the pending user turn
    order: dict[str, int] = {}

    def close_user():
        if parts:
            results = sorted((p for p in parts if p[0] >= 0), key=lambda p: p[0])
            it = iter(results)
            joined = [p[1] if p[0] < 0 else next(it)[1] for p in parts]  # results sorted in their own slots
            turns.append(_Turn("user", "\n\n".join(joined)))
            parts.clear()

    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where}: must be an object", "messages")
        role = m.get("role")
        if role in ("user", "system", "tool") and m.get("content") is None:  # (as OpenAI: only an assistant
            raise ChatError(f"{where}.content: a {role} message needs content", "messages")  # turn may omit it)
        if role == "tool":  # the encoder joins a result's text parts by a blank line
            k = order.get(m.get("tool_call_id") or "", 0)
            parts.append((k, f"<tool_result>{_text(m.get('content'), where, sep=chr(10) * 2)}</tool_result>"))
        elif role == "user":
            parts.append((-1, _text(m.get("content"), where)))
        elif role in ("system", "developer", "assistant", "latest_reminder"):
            close_user()
            t = _Turn(role, _text(m.get("content"), where), where=where)
            if role == "assistant":
                r = m.get("reasoning_content", m.get("reasoning"))
                t.reasoning = _text(r, where)
                t.calls = m.get("tool_calls") or None
                if t.calls is not None and not isinstance(t.calls, list):
                    raise ChatError(f"{where}.tool_calls: must be a list", "messages")
                if t.calls:  # the encoder keeps the last call order until another turn calls tools
                    order = {}
                    for j, c in enumerate(t.calls):
                        cid = (c.get("id") or (c.get("function") or {}).get("id")) if isinstance(c, dict) else None
                        if cid:
                            order[cid] = j
            elif role == "developer" and not t.text:
                raise ChatError(f"{where}: a developer message needs content", "messages")
            turns.append(t)
        else:
            raise ChatError(f"{where}.role: must be system, developer, user, assistant, tool or latest_reminder, "
                            f"got {role!r}", "messages")
    close_user()
    if turns[-1].role not in ("user", "developer"):
        raise ChatError("messages: the last message must be from the user, a developer or a tool", "messages")
    return turns


def encode_chat(messages: list[dict], tools: list[dict] | None = None,
                options: ChatOptions = ChatOptions()) -> str:
    """The prompt text (BOS first) for OpenAI-style `messages` and request `tools`, ending with the generation
    header `<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>`."""
    turns = _fold(messages)
    if tools:
        if turns[0].role == "system":
            turns[0].tools = tools
        else:  # as vLLM does: a system message of its own carries them
            turns.insert(0, _Turn("system", tools=tools))
    thinking = options.thinking
    drop = options.drop_thinking and not tools
    if thinking and drop:
        last_user = max(i for i, t in enumerate(turns) if t.role in ("user", "developer"))
        # before the last user turn: reasoning goes, developer turns go
        turns = [t for i, t in enumerate(turns) if not (i < last_user and t.role == "developer")]
        for t in turns[:last_user]:
            t.reasoning = ""
    last_user = max(i for i, t in enumerate(turns) if t.role in ("user", "developer"))
    table = EFFORT_TABLES[options.table]
    effort = options.effort or next(iter(table))  # each table lists its default first
    out = [BOS, table[effort] if thinking else ""]
    for i, t in enumerate(turns):
        if t.role == "system":
            out.append(t.text)
            if t.tools:
                out.append("\n\n" + render_tools(t.tools))
        elif t.role in ("user", "developer"):
            out.append(USER + t.text)
            if t.role == "developer" and t.tools:
                out.append("\n\n" + render_tools(t.tools))
        elif t.role == "latest_reminder":
            out.append(LATEST_REMINDER + t.text)
        else:
            if thinking and (not drop or i > last_user):
                out.append(t.reasoning + THINK_END)
            out.append(t.text)
            if t.calls:
                out.append(render_tool_calls(t.calls, t.where))
            out.append(EOS)
        nxt = turns[i + 1].role if i + 1 < len(turns) else None
        # the encoder writes the header after a user turn followed by an assistant turn, a latest_reminder or the end
        if t.role in ("user", "developer") and nxt in (None, "assistant", "latest_reminder"):
            out.append(ASSISTANT + (THINK if thinking and (not drop or i >= last_user) else THINK_END))
    return "".join(out)

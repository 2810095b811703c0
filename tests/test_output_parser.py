"""The reasoning / DSML output parser (dsv4_model.serve.output_parser): each model output gives the same reasoning,
content and tool calls whole, split at every possible point, and fed one character at a time; no piece of a tag
ever reaches reasoning or content. Outputs follow the format of the checkpoint's encoder (parse_message_from_
completion_text in encoding_dsv4.py: `{reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>...`); OFFICIAL holds
that function's results for some of them. Tool calls stream as OpenAI's do (a call's first piece carries its
name, the pieces after it the next part of the arguments); the pieces joined equal the whole reading of the invoke
(`_reference_arguments`, a regex over the complete invoke) whatever the split."""
import json
import re

import pytest

from dsv4_model.serve.output_parser import Delta, OutputParser

D = "｜DSML｜"
CALL_BLOCK = (f"\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">São Paulo</{D}parameter>\n"
              f"<{D}parameter name=\"days\" string=\"false\">3</{D}parameter>\n</{D}invoke>\n"
              f"<{D}invoke name=\"now\">\n\n</{D}invoke>\n</{D}tool_calls>")
CALLS = [("get_weather", {"city": "São Paulo", "days": 3}), ("now", {})]

# (name, thinking, output text, reasoning, content, calls)
CASES = [
    ("thinking", True, "Let me add: 2+2 = 4.</think>The answer is 4.", "Let me add: 2+2 = 4.", "The answer is 4.",
     []),
    ("chat", False, "The answer is 4.\n", "", "The answer is 4.\n", []),
    ("echoed <think>", True, "<think>hmm</think>ok", "hmm", "ok", []),
    ("tool calls after reasoning", True, "I need the weather.</think>Checking." + CALL_BLOCK, "I need the weather.",
     "Checking.", CALLS),
    ("tool calls in chat mode", False, CALL_BLOCK, "", "", CALLS),
    ("tool calls without </think>", True, "think" + CALL_BLOCK, "think", "", CALLS),
    ("look-alikes stay text", True, "a < b and </thin k></think>x <｜DSM y\n\n<", "a < b and </thin k>",
     "x <｜DSM y\n\n<", []),
    ("cut inside reasoning", True, "partial </thi", "partial </thi", "", []),
    ("malformed block is content", False, f"hi\n\n<{D}tool_calls>\nnot dsml", "", f"hi<{D}tool_calls>not dsml", []),
    # the call opened with its invoke tag; the arguments stay unfinished, as OpenAI's do at max_tokens
    ("cut inside an invoke", False, f"ok\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}param", "", "ok",
     [("f", "{")]),
    ("cut inside a string value", False, f"<{D}tool_calls><{D}invoke name=\"f\"><{D}parameter name=\"k\" "
     f"string=\"true\">a\"b</{D}para", "", "", [("f", '{"k": "a\\"b')]),
    ("cut inside a JSON value", False, f"<{D}tool_calls><{D}invoke name=\"f\"><{D}parameter name=\"k\" "
     f"string=\"false\">[1, 2", "", "", [("f", '{"k": ')]),
]


def _collect(parser: OutputParser, pieces) -> Delta:
    total = Delta()
    for p in pieces:
        d = parser.feed(p)
        for part in (d.reasoning, d.content):
            assert D not in part or "not dsml" in "".join(pieces), part  # no DSML leaks into text
        total.add(d)
    total.add(parser.finish())
    return total


def _check(total: Delta, reasoning, content, calls):
    """calls: (name, arguments as an object, or the exact string of an unfinished call's arguments)."""
    assert total.reasoning == reasoning
    assert total.content == content
    assert [(c.name, c.arguments if isinstance(a, str) else json.loads(c.arguments))
            for c, (_, a) in zip(total.tool_calls, calls)] == calls
    assert [c.index for c in total.tool_calls] == list(range(len(calls)))


@pytest.mark.parametrize("name,thinking,text,reasoning,content,calls", CASES, ids=[c[0] for c in CASES])
def test_every_split_point(name, thinking, text, reasoning, content, calls):
    _check(_collect(OutputParser(thinking), [text]), reasoning, content, calls)
    for i in range(len(text) + 1):
        _check(_collect(OutputParser(thinking), [text[:i], text[i:]]), reasoning, content, calls)
    for i in range(0, len(text), 7):  # two splits: every pair is quadratic, a stride keeps it short
        for j in range(i, len(text) + 1):
            _check(_collect(OutputParser(thinking), [text[:i], text[i:j], text[j:]]), reasoning, content, calls)
    _check(_collect(OutputParser(thinking), list(text)), reasoning, content, calls)


def test_deltas_are_not_held_longer_than_needed():
    """Plain text streams at once; only a possible tag's beginning (or a trailing newline) waits."""
    p = OutputParser(thinking=True)
    assert p.feed("abc").reasoning == "abc"
    assert p.feed(" </th").reasoning == " "
    assert p.feed("ink>x").content == "x"
    assert p.feed("y\n").content == "y"
    assert p.feed("z").content == "\nz"
    assert p.feed("\n\n<｜DS").content == ""
    d = p.feed(f"ML｜tool_calls>\n<{D}invoke name=\"f\">\n</{D}invoke>")
    assert d.content == "" and [c.name for c in d.tool_calls] == ["f"]


# [O] parse_message_from_completion_text(text + "<｜end▁of▁sentence｜>", thinking_mode) of the official encoder,
# `encoding/encoding_dsv4.py` of deepseek-ai/DeepSeek-V4-Flash: its reasoning_content, content and each tool call's
# (function.name, function.arguments), pasted as literals. The first three outputs are what that file's
# encode_messages writes for an assistant message (its render_message), the fourth is written by hand.
# (name, thinking, output text, reasoning, content, [(name, arguments string)])
OFFICIAL = [
    ("rendered, thinking", True,
     f'I need the weather.</think>Checking.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter '
     f'name="city" string="true">São Paulo</{D}parameter>\n<{D}parameter name="days" string="false">3</{D}parameter>'
     f'\n</{D}invoke>\n<{D}invoke name="now">\n\n</{D}invoke>\n</{D}tool_calls>',
     "I need the weather.", "Checking.", [("get_weather", '{"city": "São Paulo", "days": 3}'), ("now", "{}")]),
    ("rendered, values of every type", False,
     f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="s" string="true">a\nb "q" <i></{D}parameter>'
     f'\n<{D}parameter name="e" string="true"></{D}parameter>\n<{D}parameter name="n" string="false">-0.0015'
     f'</{D}parameter>\n<{D}parameter name="z" string="false">[]</{D}parameter>\n<{D}parameter name="b" '
     f'string="false">true</{D}parameter>\n<{D}parameter name="x" string="false">null</{D}parameter>\n<{D}parameter '
     f'name="o" string="false">{{"k": [1, {{"y": "é"}}]}}</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
     "", "", [("f", '{"s": "a\\nb \\"q\\" <i>", "e": "", "n": -0.0015, "z": [], "b": true, "x": null, '
                   '"o": {"k": [1, {"y": "é"}]}}')]),
    ("rendered, content ending in a newline", True,
     f'multi\nline\n</think>line1\n\nline2\n\n\n<{D}tool_calls>\n<{D}invoke name="g">\n<{D}parameter name="x" '
     f'string="true"></{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
     "multi\nline\n", "line1\n\nline2\n", [("g", '{"x": ""}')]),
    ("string=false values as written", True,
     f'r</think>c\n\n\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="false">[1,2]'
     f'</{D}parameter>\n<{D}parameter name="y" string="false"> 2 </{D}parameter>\n<{D}parameter name="z" '
     f'string="false">{{"a" : 1}}</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
     "r", "c\n\n", [("f", '{"x": [1,2], "y":  2 , "z": {"a" : 1}}')]),
]


@pytest.mark.parametrize("name,thinking,text,reasoning,content,calls", OFFICIAL, ids=[c[0] for c in OFFICIAL])
def test_official_parse_results(name, thinking, text, reasoning, content, calls):
    """The same reasoning, content and exact arguments strings as the official parser, whole and character by
    character."""
    for pieces in ([text], list(text)):
        total = _collect(OutputParser(thinking), pieces)
        assert (total.reasoning, total.content) == (reasoning, content)
        assert [(c.name, c.arguments) for c in total.tool_calls] == calls


def test_repeated_parameter_ends_the_call():
    """The official parser refuses an invoke that names a parameter twice. Streaming, the call is out by then: it
    ends (closed) before the repeated parameter, which stays text with the rest."""
    p = OutputParser(thinking=False)
    block = (f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"true\">1</{D}parameter>\n"
             f"<{D}parameter name=\"x\" string=\"true\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    d = p.feed("ok\n\n" + block)
    d.add(p.finish())
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("f", '{"x": "1"}')]
    assert d.content == "ok" + block[block.index(f'<{D}parameter name="x" string="true">2'):]


def test_text_between_parameters_ends_the_call():
    p = OutputParser(thinking=False)
    d = p.feed(f"<{D}tool_calls><{D}invoke name=\"f\"><{D}parameter name=\"x\" string=\"false\">1</{D}parameter>"
               f" oops</{D}invoke></{D}tool_calls>")
    d.add(p.finish())
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("f", '{"x": 1}')]
    assert d.content == f"oops</{D}invoke></{D}tool_calls>"


def test_string_false_value_that_is_not_json_is_kept_as_text():
    p = OutputParser(thinking=False)
    d = p.feed(f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">[1, 2</{D}"
               f"parameter>\n</{D}invoke>\n</{D}tool_calls>")
    d.add(p.finish())
    assert json.loads(d.tool_calls[0].arguments) == {"x": "[1, 2"}


# ---------------------------------------------------------------------------------------- streamed tool calls
_INVOKE = re.compile(rf'<{D}invoke\s+name="([^"]*)"\s*>(.*?)</{D}invoke>', re.DOTALL)
_PARAM = re.compile(rf'<{D}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{D}parameter>', re.DOTALL)


def _reference_arguments(text: str) -> list[tuple[str, str]]:
    """Each invoke of a well-formed output read whole, as the encoder's decode_dsml_to_arguments writes it:
    (name, `{"k": v, ...}`), a string="true" value JSON-quoted, a string="false" one as written (JSON-quoted when
    it is not JSON)."""
    out = []
    for name, body in _INVOKE.findall(text):
        args = []
        for key, is_str, value in _PARAM.findall(body):
            if is_str == "false":
                try:
                    json.loads(value)
                except ValueError:
                    value = json.dumps(value, ensure_ascii=False)
            else:
                value = json.dumps(value, ensure_ascii=False)
            args.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
        out.append((name, "{" + ", ".join(args) + "}"))
    return out


NASTY = 'say "hi" \\ C:\\dir\\n\nline2\t é 中文 😀 </{d}parameterX <{d}invoke name="z"> \\u00e9 \\"'.format(d=D)
ONE_CALL = (f"Plan: search.</think>Let me look.\n\n<{D}tool_calls>\n<{D}invoke name=\"search\">\n"
            f"<{D}parameter name=\"query\" string=\"true\">{NASTY}</{D}parameter>\n"
            f"<{D}parameter name=\"opts\" string=\"false\">"
            f"{{\"q\": \"a\\\"b\\\\c\\u00e9\\n\", \"n\": [1, -2.5e3, null]}}"
            f"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
TWO_CALLS = (f"\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
             f"<{D}parameter name=\"city\" string=\"true\">São \"Paulo\"\n</{D}parameter>\n"
             f"<{D}parameter name=\"days\" string=\"false\">3</{D}parameter>\n"
             f"<{D}parameter name=\"ok\" string=\"false\">true</{D}parameter>\n"
             f"<{D}parameter name=\"ké\\y\" string=\"true\"></{D}parameter>\n</{D}invoke>\n"
             f"<{D}invoke name=\"write\">\n"
             f"<{D}parameter name=\"path\" string=\"true\">C:\\tmp\\a b.txt</{D}parameter>\n"
             f"<{D}parameter name=\"body\" string=\"true\">{NASTY}</{D}parameter>\n"
             f"<{D}parameter name=\"bad\" string=\"false\">[1, 2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
# (name, thinking, output text, reasoning, content, [(name, arguments string, arguments object)])
STREAMED = [
    ("one call", True, ONE_CALL, "Plan: search.", "Let me look.",
     [("search", '{"query": ' + json.dumps(NASTY, ensure_ascii=False) + ', "opts": {"q": "a\\"b\\\\c\\u00e9\\n", '
       '"n": [1, -2.5e3, null]}}', {"query": NASTY, "opts": {"q": 'a"b\\cé\n', "n": [1, -2500.0, None]}})]),
    ("two calls", False, TWO_CALLS, "", "",
     [("get_weather", '{"city": "São \\"Paulo\\"\\n", "days": 3, "ok": true, "ké\\\\y": ""}',
       {"city": 'São "Paulo"\n', "days": 3, "ok": True, "ké\\y": ""}),
      ("write",
       '{"path": "C:\\\\tmp\\\\a b.txt", "body": ' + json.dumps(NASTY, ensure_ascii=False) + ', "bad": "[1, 2"}',
       {"path": "C:\\tmp\\a b.txt", "body": NASTY, "bad": "[1, 2"})]),
]


def _stream(thinking: bool, pieces) -> tuple[Delta, list]:
    """The parser fed `pieces`: the deltas summed, and every tool-call piece as it came."""
    parser, total, calls = OutputParser(thinking), Delta(), []
    for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
        for part in (d.reasoning, d.content):
            assert D not in part, part
        calls += [(c.index, c.name, c.arguments) for c in d.tool_calls]
        total.add(d)
    return total, calls


def _check_stream(total, pieces, reasoning, content, calls, text):
    assert (total.reasoning, total.content) == (reasoning, content)
    # indices 0, 1, ... in order; a call's first piece names it, the pieces after it do not
    indices = [i for i, _, _ in pieces]
    assert indices == sorted(indices) and sorted(set(indices)) == list(range(len(calls)))
    for k, (name, args, obj) in enumerate(calls):
        mine = [(n, a) for i, n, a in pieces if i == k]
        assert mine[0][0] == name and all(n is None for n, _ in mine[1:])
        joined = "".join(a for _, a in mine)
        assert joined == args and json.loads(joined) == obj
    assert [(c.name, c.arguments) for c in total.tool_calls] == [(n, a) for n, a, _ in calls]
    assert _reference_arguments(text) == [(n, a) for n, a, _ in calls]


@pytest.mark.parametrize("name,thinking,text,reasoning,content,calls", STREAMED, ids=[c[0] for c in STREAMED])
def test_tool_calls_stream_at_every_split_point(name, thinking, text, reasoning, content, calls):
    """Arguments stream in pieces that join into the whole reading's exact string, whatever the token boundaries:
    one piece, every split point, pairs of split points (a stride on the first), one character at a time."""
    splits = [[text], list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 11) for j in range(i, len(text) + 1)]
    for pieces in splits:
        total, got = _stream(thinking, pieces)
        _check_stream(total, got, reasoning, content, calls, text)


def test_arguments_stream_as_they_are_written():
    """A call opens with its invoke tag; a key once its parameter tag is complete; a string value's text at once
    (JSON-escaped, a possible closing tag held back); a JSON value whole at its closing tag; `}` at the end."""
    p = OutputParser(thinking=False)

    def args(text):
        return [(c.index, c.name, c.arguments) for c in p.feed(text).tool_calls]

    assert args(f"<{D}tool_calls>\n<{D}invoke name=\"f\"") == []
    assert args(">\n") == [(0, "f", "{")]
    assert args(f"<{D}parameter name=\"a b\" string=\"tr") == []
    assert args("ue\">x \"") == [(0, None, '"a b": "x \\"')]
    assert args("y\n</") == [(0, None, "y\\n")]
    assert args(f"{D}param") == []
    assert args(f"eter>\n<{D}parameter name=\"n\" string=\"false\">[1,") == [(0, None, '", "n": ')]
    assert args(f" 2]</{D}parameter>\n</{D}invoke>") == [(0, None, "[1, 2]}")]
    assert args(f"\n<{D}invoke name=\"g\">\n</{D}invoke>") == [(1, "g", "{}")]

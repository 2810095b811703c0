"""The reasoning / DSML output parser (dsv4_model.serve.output_parser): each model output gives the same reasoning,
content and tool calls whole, split at every possible point, and fed one character at a time; no piece of a tag
ever reaches reasoning or content. Outputs follow the format of the checkpoint's encoder (parse_message_from_
completion_text in encoding_dsv4.py: `{reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>...`); OFFICIAL holds
that function's results for some of them."""
import json

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
    ("cut inside an invoke", False, f"ok\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}param", "", "ok", []),
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
    assert total.reasoning == reasoning
    assert total.content == content
    assert [(c.name, json.loads(c.arguments)) for c in total.tool_calls] == calls
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


def test_repeated_parameter_is_not_a_call():
    """The official parser refuses an invoke that names a parameter twice; here it stays text."""
    p = OutputParser(thinking=False)
    block = (f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"true\">1</{D}parameter>\n"
             f"<{D}parameter name=\"x\" string=\"true\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    d = p.feed("ok\n\n" + block)
    d.add(p.finish())
    assert d.tool_calls == [] and d.content.startswith("ok<｜DSML｜tool_calls>") and "2</" in d.content


def test_string_false_value_that_is_not_json_is_kept_as_text():
    p = OutputParser(thinking=False)
    d = p.feed(f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">[1, 2</{D}"
               f"parameter>\n</{D}invoke>\n</{D}tool_calls>")
    d.add(p.finish())
    assert json.loads(d.tool_calls[0].arguments) == {"x": "[1, 2"}

"""DeepSeek-V4's chat encoding (dsv4_model.serve.chat_encoding): a table of conversations, each against the exact
string the checkpoint's encoder gives.

[O] Every expected string of CASES (except the two `tiered` ones) is the output of the official encoder,
    `encoding/encoding_dsv4.py` of deepseek-ai/DeepSeek-V4-Flash, function encode_messages(messages, thinking_mode,
    drop_thinking=..., reasoning_effort=...), pasted here as a literal (the file itself is not in this repository).
    The call: thinking_mode "thinking" / "chat" from ChatOptions.thinking, reasoning_effort "max" / "high" / None
    from ChatOptions.effort, drop_thinking from ChatOptions.drop_thinking, and the request `tools` put on the leading
    system message (a system message {"content": ""} of its own at index 0 when there is none), add_default_bos_token
    and context left at their defaults. TOOLS_HEAD / TOOLS_TAIL are that encoder's TOOLS_TEMPLATE around the schemas
    (render_tools), ABS_MAX its REASONING_EFFORT_MAX.
[T] the tiered effort table (low default / high / max) of the later encoder (REASONING_EFFORT_PROMPTS in
    encoding/encoding_dsv4.py of deepseek-ai/DeepSeek-V4-Flash-0731 and the Vision-Exp release).
[V] vllm/tokenizers/deepseek_v4.py (the request switches): reasoning_effort "none" -> chat mode, "max" / "xhigh"
    -> the encoder's "max", other levels -> "high"; chat_template_kwargs.drop_thinking -> drop_thinking.
Beyond the encoder (it has no defined output there, see docs/serving.md): `reasoning` read as `reasoning_content`,
OpenAI text parts joined, content null as ""."""
import json

import pytest

from dsv4_model.serve.chat_encoding import ChatError, ChatOptions, encode_chat, resolve_options

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"

ABS_MAX = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
           "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
           "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
           "scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
           "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

# [T] REASONING_EFFORT_PROMPTS["max"] of the 0731 encoder
BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\nYou MUST reason with the utmost "
    "depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most "
    "fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any "
    "surface symptom.\nDo not stop reasoning until you have independently verified the solution from multiple angles "
    "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
NOW = {"type": "function", "function": {"name": "now", "description": "Zeit — jetzt",
                                        "parameters": {"type": "object", "properties": {}}}}
# [O] render_tools: TOOLS_TEMPLATE with one schema a line, json.dumps(ensure_ascii=False) of the function object
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f"writing a \"<{D}tool_calls>\" block like the following:\n\n<{D}tool_calls>\n<{D}invoke name=\"$TOOL_NAME\">\n"
    f"<{D}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{D}parameter>\n...\n"
    f"</{D}invoke>\n<{D}invoke name=\"$TOOL_NAME2\">\n...\n</{D}invoke>\n</{D}tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
W_SCHEMA = ('{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", '
            '"properties": {"city": {"type": "string"}}}}')
NOW_SCHEMA = '{"name": "now", "description": "Zeit — jetzt", "parameters": {"type": "object", "properties": {}}}'
TOOLS = TOOLS_HEAD + W_SCHEMA + TOOLS_TAIL

# [O] encode_arguments_to_dsml: strings as they are (string="true"), other values json.dumps (string="false")
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Oslo", "days": 2, "hourly": false}'}}]
DSML_CALLS = (f"\n\n<{D}tool_calls>\n"
              f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
              f"</{D}invoke>\n"
              f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Oslo</{D}parameter>\n'
              f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
              f'<{D}parameter name="hourly" string="false">false</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')

SYS = {"role": "system", "content": "You are a helpful assistant."}
Q = {"role": "user", "content": "What is 2+2?"}
CHAT = ChatOptions(thinking=False)

CASES = [
    # [O] the checkpoint's encoding/README.md example: system, one user turn, thinking (our default)
    ("readme", [SYS, Q], None, ChatOptions(),
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}<think>"),
    # [O] chat mode: the header closes thinking at once
    ("chat mode", [SYS, Q], None, CHAT,
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}</think>"),
    ("no system", [Q], None, ChatOptions(), f"{B}{U}What is 2+2?{A}<think>"),
    # [O] multi-turn, thinking: the earlier turn's reasoning is dropped (no </think>), its header closes thinking
    ("multi-turn thinking", [SYS, Q, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},
                             {"role": "user", "content": "And 3+3?"}], None, ChatOptions(),
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}</think>4{E}{U}And 3+3?{A}<think>"),
    # [O] multi-turn, chat mode
    ("multi-turn chat", [Q, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}], None,
     CHAT, f"{B}{U}What is 2+2?{A}</think>4{E}{U}And 3+3?{A}</think>"),
    # [O] reasoning_effort max: the effort text before message 0 (thinking mode only)
    ("effort max", [SYS, Q], None, ChatOptions(effort="max"),
     f"{B}{ABS_MAX}You are a helpful assistant.{U}What is 2+2?{A}<think>"),
    ("effort max, chat mode", [SYS, Q], None, ChatOptions(thinking=False, effort="max"),
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}</think>"),
    # [T] the tiered table: high is the "Absolute maximum" text, low (default) adds nothing
    ("tiered high", [Q], None, ChatOptions(effort="high", table="v4-tiered"), f"{B}{ABS_MAX}{U}What is 2+2?{A}<think>"),
    ("tiered default", [Q], None, ChatOptions(table="v4-tiered"), f"{B}{U}What is 2+2?{A}<think>"),
    ("tiered max", [Q], None, ChatOptions(effort="max", table="v4-tiered"),
     f"{B}{BEYOND_MAX}{U}What is 2+2?{A}<think>"),
    # [O] request tools on the system message: TOOLS_TEMPLATE after "\n\n"
    ("tools with system", [SYS, {"role": "user", "content": "Weather in Paris?"}], [WEATHER], ChatOptions(),
     f"{B}You are a helpful assistant.\n\n{TOOLS}{U}Weather in Paris?{A}<think>"),
    ("tools without system", [{"role": "user", "content": "Weather in Paris?"}], [WEATHER], CHAT,
     f"{B}\n\n{TOOLS}{U}Weather in Paris?{A}</think>"),
    # [O] tool calls in DSML, results folded into one user turn in call order (c2's result sent first); with
    # tools, reasoning is kept and every user turn's header opens thinking
    ("tool round trip", [SYS, {"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": "", "reasoning_content": "need tools", "tool_calls": CALLS},
                         {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                         {"role": "tool", "tool_call_id": "c1", "content": "sun"}], [WEATHER], ChatOptions(),
     f"{B}You are a helpful assistant.\n\n{TOOLS}{U}Weather?{A}<think>need tools</think>{DSML_CALLS}{E}"
     f"{U}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}<think>"),
    # [O] a user message after tool results joins the same user turn
    ("tool result then user text", [{"role": "user", "content": "Weather?"},
                                    {"role": "assistant", "content": "Checking.", "tool_calls": CALLS[:1]},
                                    {"role": "tool", "tool_call_id": "c1", "content": "sun"},
                                    {"role": "user", "content": "Thanks"}], None, CHAT,
     f"{B}{U}Weather?{A}</think>Checking.\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
     f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}"
     f"{U}<tool_result>sun</tool_result>\n\nThanks{A}</think>"),
    # [O] (the encoder given `reasoning` as reasoning_content, the parts joined) without tools, an assistant turn
    # after the last user turn is impossible here; reasoning of two earlier turns dropped
    ("earlier reasoning dropped", [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]},
                                   {"role": "assistant", "content": "1", "reasoning": "r1"},
                                   {"role": "user", "content": "c"},
                                   {"role": "assistant", "content": "2", "reasoning_content": "r2"},
                                   {"role": "user", "content": "d"}], None, ChatOptions(),
     f"{B}{U}ab{A}</think>1{E}{U}c{A}</think>2{E}{U}d{A}<think>"),
    # [O] developer: `<｜User｜>` + text; developer turns before the last user turn are dropped in thinking mode
    ("developer", [{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "hi"}], None,
     ChatOptions(), f"{B}{U}hi{A}<think>"),
    ("developer last", [SYS, {"role": "developer", "content": "dev rules"}], None, ChatOptions(),
     f"{B}You are a helpful assistant.{U}dev rules{A}<think>"),
    # [O] encoding/tests/test_input_2.json of the checkpoint without its last assistant turn: the prompt is
    # encoding/tests/test_output_2.txt up to that turn
    ("official test 2", [SYS, {"role": "user", "content": "Hello"},
                         {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.",
                          "content": "Hi there! How can I help you?"},
                         {"role": "user", "content": "What is the capital of France?"}], None, ChatOptions(),
     f"{B}You are a helpful assistant.{U}Hello{A}</think>Hi there! How can I help you?{E}"
     f"{U}What is the capital of France?{A}<think>"),
    # [O] system messages are raw text wherever they stand (no role token)
    ("two systems", [SYS, {"role": "system", "content": "Be brief."}, Q], None, ChatOptions(),
     f"{B}You are a helpful assistant.Be brief.{U}What is 2+2?{A}<think>"),
    ("system mid-conversation", [Q, {"role": "assistant", "content": "4", "reasoning_content": "r"},
                                 {"role": "system", "content": "New rules."}, {"role": "user", "content": "And 3+3?"}],
     None, ChatOptions(), f"{B}{U}What is 2+2?{A}</think>4{E}New rules.{U}And 3+3?{A}<think>"),
    ("assistant before any user", [SYS, {"role": "assistant", "content": "Hello!"}, Q], None, ChatOptions(),
     f"{B}You are a helpful assistant.Hello!{E}{U}What is 2+2?{A}<think>"),
    ("empty user content", [{"role": "user", "content": ""}], None, CHAT, f"{B}{U}{A}</think>"),
    # [O] text as it is (json.dumps ensure_ascii=False for schemas), braces and quotes untouched
    ("unicode", [{"role": "system", "content": "日本語 — ✓"}, {"role": "user", "content": "Ünïcödé 🙂 \"q\" <b> {x}"}],
     [NOW], ChatOptions(),
     f'{B}日本語 — ✓\n\n{TOOLS_HEAD}{NOW_SCHEMA}{TOOLS_TAIL}{U}Ünïcödé 🙂 "q" <b> {{x}}{A}<think>'),
    # [O] merge_tool_messages: consecutive user messages, and user text before tool results, are one user turn
    ("consecutive users join", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None,
     ChatOptions(), f"{B}{U}a\n\nb{A}<think>"),
    ("user text then tool result", [{"role": "user", "content": "Weather?"},
                                    {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
                                    {"role": "user", "content": "btw"},
                                    {"role": "tool", "tool_call_id": "c1", "content": "sun"}], None, CHAT,
     f'{B}{U}Weather?{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
     f'string="true">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}{U}btw\n\n<tool_result>sun</tool_result>'
     f'{A}</think>'),
    # [O] sort_tool_results_by_call_order: a result without a known id sorts as call 0 (stable)
    ("results without / with unknown ids", [{"role": "user", "content": "Weather?"},
                                            {"role": "assistant", "content": "", "tool_calls": CALLS},
                                            {"role": "tool", "tool_call_id": "zz", "content": "x"},
                                            {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                                            {"role": "tool", "content": "y"},
                                            {"role": "tool", "tool_call_id": "c1", "content": "sun"}], None, CHAT,
     f"{B}{U}Weather?{A}</think>{DSML_CALLS}{E}{U}<tool_result>x</tool_result>\n\n<tool_result>y</tool_result>\n\n"
     f"<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}</think>"),
    # [O] with tools every turn keeps its reasoning and every header opens thinking; effort text before message 0;
    # a call without arguments is an invoke with an empty line
    ("two tool rounds keep all reasoning", [SYS, {"role": "user", "content": "Weather?"},
                                            {"role": "assistant", "content": "", "reasoning_content": "r1",
                                             "tool_calls": CALLS[:1]},
                                            {"role": "tool", "tool_call_id": "c1", "content": "sun"},
                                            {"role": "assistant", "content": "Sunny.", "reasoning_content": "r2"},
                                            {"role": "user", "content": "Time?"},
                                            {"role": "assistant", "content": "", "reasoning_content": "r3",
                                             "tool_calls": [{"id": "c3", "type": "function",
                                                             "function": {"name": "now", "arguments": "{}"}}]},
                                            {"role": "tool", "tool_call_id": "c3", "content": "12:00"}],
     [WEATHER, NOW], ChatOptions(effort="max"),
     f'{B}{ABS_MAX}You are a helpful assistant.\n\n{TOOLS_HEAD}{W_SCHEMA}\n{NOW_SCHEMA}{TOOLS_TAIL}{U}Weather?{A}'
     f'<think>r1</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
     f'string="true">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}{U}<tool_result>sun</tool_result>{A}'
     f'<think>r2</think>Sunny.{E}{U}Time?{A}<think>r3</think>\n\n<{D}tool_calls>\n<{D}invoke name="now">\n\n'
     f'</{D}invoke>\n</{D}tool_calls>{E}{U}<tool_result>12:00</tool_result>{A}<think>'),
    # [O] merge_tool_messages / render_message: a result's text parts joined by a blank line
    ("tool result text parts", [{"role": "user", "content": "Weather?"},
                                {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
                                {"role": "tool", "tool_call_id": "c1",
                                 "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]}],
     None, CHAT,
     f'{B}{U}Weather?{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
     f'string="true">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}{U}<tool_result>p1\n\np2</tool_result>'
     f'{A}</think>'),
    # [O] encode_arguments_to_dsml: arguments that are not JSON (also "") are one string parameter `arguments`;
    # strings as they are (newlines, quotes, tags), other values json.dumps
    ("arguments not JSON, empty, values of every type",
     [{"role": "user", "content": "go"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}},
          {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
          {"id": "c", "type": "function", "function": {"name": "h", "arguments": json.dumps(
              {"s": "a\nb \"q\" <i>", "e": "", "u": "日本", "n": -1.5e-3, "z": [], "b": True, "x": None,
               "o": {"k": [1, {"y": 2}]}}, ensure_ascii=False)}}]},
      {"role": "tool", "tool_call_id": "a", "content": "1"}], None, CHAT,
     f'{B}{U}go{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="arguments" string="true">'
     f'{{oops</{D}parameter>\n</{D}invoke>\n<{D}invoke name="g">\n<{D}parameter name="arguments" string="true">'
     f'</{D}parameter>\n</{D}invoke>\n<{D}invoke name="h">\n<{D}parameter name="s" string="true">a\nb "q" <i>'
     f'</{D}parameter>\n<{D}parameter name="e" string="true"></{D}parameter>\n<{D}parameter name="u" string="true">'
     f'日本</{D}parameter>\n<{D}parameter name="n" string="false">-0.0015</{D}parameter>\n<{D}parameter name="z" '
     f'string="false">[]</{D}parameter>\n<{D}parameter name="b" string="false">true</{D}parameter>\n<{D}parameter '
     f'name="x" string="false">null</{D}parameter>\n<{D}parameter name="o" string="false">{{"k": [1, {{"y": 2}}]}}'
     f'</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}{U}<tool_result>1</tool_result>{A}</think>'),
    # [O] sort_tool_results_by_call_order: a call's id may sit in its function object
    ("call order from function.id", [{"role": "user", "content": "go"},
                                     {"role": "assistant", "content": "", "tool_calls": [
                                         {"type": "function", "function": {"id": "f1", "name": "a",
                                                                           "arguments": "{}"}},
                                         {"type": "function", "function": {"id": "f2", "name": "b",
                                                                           "arguments": "{}"}}]},
                                     {"role": "tool", "tool_call_id": "f2", "content": "B"},
                                     {"role": "tool", "tool_call_id": "f1", "content": "A"}], None, CHAT,
     f'{B}{U}go{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name="a">\n\n</{D}invoke>\n<{D}invoke name="b">\n\n'
     f'</{D}invoke>\n</{D}tool_calls>{E}{U}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>{A}</think>'),
    # [O] latest_reminder: `<｜latest_reminder｜>` + text; a user turn followed by one gets the header
    ("latest_reminder before the user turn", [SYS, {"role": "latest_reminder", "content": "2026-02-21, Paris, App"},
                                              Q], None, ChatOptions(),
     f"{B}You are a helpful assistant.<｜latest_reminder｜>2026-02-21, Paris, App{U}What is 2+2?{A}<think>"),
    ("latest_reminder after a user turn", [{"role": "user", "content": "hi"},
                                           {"role": "latest_reminder", "content": "R"}, Q], None, ChatOptions(),
     f"{B}{U}hi{A}</think><｜latest_reminder｜>R{U}What is 2+2?{A}<think>"),
    ("latest_reminder after tool results", [{"role": "user", "content": "Weather?"},
                                            {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
                                            {"role": "tool", "tool_call_id": "c1", "content": "sun"},
                                            {"role": "latest_reminder", "content": "R"}, Q], None, CHAT,
     f'{B}{U}Weather?{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
     f'string="true">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}{U}<tool_result>sun</tool_result>{A}'
     f'</think><｜latest_reminder｜>R{U}What is 2+2?{A}</think>'),
    # [O] drop_thinking=False: earlier reasoning kept, every header opens thinking (chat mode: nothing changes)
    ("drop_thinking off", [SYS, Q, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},
                           {"role": "user", "content": "And 3+3?"}], None, ChatOptions(drop_thinking=False),
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}<think>2+2=4</think>4{E}{U}And 3+3?{A}<think>"),
    ("drop_thinking off, chat mode", [Q, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},
                                      {"role": "user", "content": "And 3+3?"}], None,
     ChatOptions(thinking=False, drop_thinking=False), f"{B}{U}What is 2+2?{A}</think>4{E}{U}And 3+3?{A}</think>"),
    # [O] _drop_thinking_messages: a developer turn before the last user turn goes in thinking mode only
    ("developer mid, thinking", [Q, {"role": "assistant", "content": "4"}, {"role": "developer", "content": "dev"},
                                 {"role": "user", "content": "And 3+3?"}], None, ChatOptions(),
     f"{B}{U}What is 2+2?{A}</think>4{E}{U}And 3+3?{A}<think>"),
    ("developer mid, chat", [Q, {"role": "assistant", "content": "4"}, {"role": "developer", "content": "dev"},
                             {"role": "user", "content": "And 3+3?"}], None, CHAT,
     f"{B}{U}What is 2+2?{A}</think>4{E}{U}dev{U}And 3+3?{A}</think>"),
    ("developer then tool results", [{"role": "developer", "content": "dev"},
                                     {"role": "assistant", "content": "", "reasoning_content": "r",
                                      "tool_calls": CALLS[:1]},
                                     {"role": "tool", "tool_call_id": "c1", "content": "sun"}], None, ChatOptions(),
     f'{B}\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
     f'</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}{U}<tool_result>sun</tool_result>{A}<think>'),
]


@pytest.mark.parametrize("name,messages,tools,options,want", CASES, ids=[c[0] for c in CASES])
def test_encoding_table(name, messages, tools, options, want):
    assert encode_chat(messages, tools, options) == want


def test_request_switches():
    """Thinking on by default (ours); [V]: reasoning_effort none -> chat; max / xhigh -> max; others -> high (the
    encoder's level that adds nothing); drop_thinking passed on."""
    assert resolve_options(None, None) == ChatOptions(thinking=True)
    assert resolve_options(False, None) == ChatOptions(thinking=False)
    assert resolve_options(True, "none").thinking is False
    for level in ("minimal", "low", "medium", "high"):
        assert resolve_options(None, level).effort == "high"  # the "v4" table's default level (nothing added)
    assert resolve_options(None, "max").effort == "max"
    assert resolve_options(None, "xhigh").effort == "max"
    assert resolve_options(None, None, drop_thinking=False) == ChatOptions(drop_thinking=False)
    assert resolve_options(None, "max", drop_thinking=False).drop_thinking is False
    assert resolve_options(None, None, drop_thinking=None).drop_thinking is True
    assert resolve_options(None, "medium", "v4-tiered").effort == "low"
    with pytest.raises(ChatError, match="reasoning_effort"):
        resolve_options(None, "extreme")


@pytest.mark.parametrize("messages,match", [
    ([], "at least one message"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([Q, {"role": "assistant", "content": "4"}], "last message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ([Q, {"role": "latest_reminder", "content": "R"}], "last message"),
    ([Q, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, Q,
      {"role": "tool", "tool_call_id": "x", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text parts"),
    ([Q, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, Q], "JSON object"),
])
def test_refused(messages, match):
    with pytest.raises(ChatError, match=match):
        encode_chat(messages)


def test_request_field_drop_thinking():
    """chat_template_kwargs.drop_thinking reaches the options (as vLLM's deepseek_v4 mode reads it)."""
    from dsv4_model.serve.protocol import ChatRequest
    req = ChatRequest(messages=[Q], chat_template_kwargs={"drop_thinking": False, "enable_thinking": True})
    assert (req.thinking, req.drop_thinking) == (True, False)
    assert ChatRequest(messages=[Q]).drop_thinking is None

"""DeepSeek-V4's chat encoding (dsv4_model.serve.chat_encoding): a table of conversations, each against the exact
string the checkpoint's encoder gives. The expected strings are written out here by hand from the published rules
and examples:
  [R] the checkpoint's encoding/README.md example, quoted in SGLang PR #23623 and vLLM's deepseek_v4 docs:
      "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"
  [E] encoding/encoding_dsv4.py as vLLM vendors it (vllm/tokenizers/deepseek_v4_encoding.py): render_message
      (system text raw, `<｜User｜>` + text, assistant `{reasoning}</think>{content}{tool_calls}<｜end▁of▁sentence｜>`,
      the `<｜Assistant｜>` + `<think>` / `</think>` header after a user turn followed by an assistant turn or the
      end), merge_tool_messages + sort_tool_results_by_call_order (tool results -> `<tool_result>` blocks of one
      user turn, joined by a blank line, in call order), _drop_thinking_messages (reasoning before the last user
      turn dropped unless any message has tools), TOOLS_TEMPLATE, encode_arguments_to_dsml, REASONING_EFFORT_MAX.
  [V] vllm/tokenizers/deepseek_v4.py: thinking on unless `thinking` / `enable_thinking` say otherwise;
      reasoning_effort "none" -> chat mode; request tools on a system message inserted at index 0.
  [T] the tiered effort table (low default / high / max) of later encoder copies (e.g. encoding/encoding_dsv4.py in
      sfxnz/DeepSeek-V4-Flash-Vision-Exp-vLLM-2x-DGX-Spark)."""
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

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
# [E] TOOLS_TEMPLATE with the one schema as json.dumps(ensure_ascii=False) of the function object
TOOLS = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f"writing a \"<{D}tool_calls>\" block like the following:\n\n<{D}tool_calls>\n<{D}invoke name=\"$TOOL_NAME\">\n"
    f"<{D}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{D}parameter>\n...\n"
    f"</{D}invoke>\n<{D}invoke name=\"$TOOL_NAME2\">\n...\n</{D}invoke>\n</{D}tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, "
    "arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}}}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")

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
    # [R] the README example: system, one user turn, thinking (the default [V])
    ("readme", [SYS, Q], None, ChatOptions(),
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}<think>"),
    # [E] chat mode: the header closes thinking at once
    ("chat mode", [SYS, Q], None, CHAT,
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}</think>"),
    ("no system", [Q], None, ChatOptions(), f"{B}{U}What is 2+2?{A}<think>"),
    # [E] multi-turn, thinking: the earlier turn's reasoning is dropped (no </think>), its header closes thinking
    ("multi-turn thinking", [SYS, Q, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},
                             {"role": "user", "content": "And 3+3?"}], None, ChatOptions(),
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}</think>4{E}{U}And 3+3?{A}<think>"),
    # [E] multi-turn, chat mode
    ("multi-turn chat", [Q, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}], None,
     CHAT, f"{B}{U}What is 2+2?{A}</think>4{E}{U}And 3+3?{A}</think>"),
    # [E] reasoning_effort max: the effort text before message 0 (thinking mode only)
    ("effort max", [SYS, Q], None, ChatOptions(effort="max"),
     f"{B}{ABS_MAX}You are a helpful assistant.{U}What is 2+2?{A}<think>"),
    ("effort max, chat mode", [SYS, Q], None, ChatOptions(thinking=False, effort="max"),
     f"{B}You are a helpful assistant.{U}What is 2+2?{A}</think>"),
    # [T] the tiered table: high is the "Absolute maximum" text, low (default) adds nothing
    ("tiered high", [Q], None, ChatOptions(effort="high", table="v4-tiered"), f"{B}{ABS_MAX}{U}What is 2+2?{A}<think>"),
    ("tiered default", [Q], None, ChatOptions(table="v4-tiered"), f"{B}{U}What is 2+2?{A}<think>"),
    # [V] request tools attach to a system message; [E] TOOLS_TEMPLATE after "\n\n"
    ("tools with system", [SYS, {"role": "user", "content": "Weather in Paris?"}], [WEATHER], ChatOptions(),
     f"{B}You are a helpful assistant.\n\n{TOOLS}{U}Weather in Paris?{A}<think>"),
    ("tools without system", [{"role": "user", "content": "Weather in Paris?"}], [WEATHER], CHAT,
     f"{B}\n\n{TOOLS}{U}Weather in Paris?{A}</think>"),
    # [E] tool calls in DSML, results folded into one user turn in call order (c2's result sent first); with
    # tools, reasoning is kept and every user turn's header opens thinking
    ("tool round trip", [SYS, {"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": "", "reasoning_content": "need tools", "tool_calls": CALLS},
                         {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                         {"role": "tool", "tool_call_id": "c1", "content": "sun"}], [WEATHER], ChatOptions(),
     f"{B}You are a helpful assistant.\n\n{TOOLS}{U}Weather?{A}<think>need tools</think>{DSML_CALLS}{E}"
     f"{U}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}<think>"),
    # [E] a user message after tool results joins the same user turn
    ("tool result then user text", [{"role": "user", "content": "Weather?"},
                                    {"role": "assistant", "content": "Checking.", "tool_calls": CALLS[:1]},
                                    {"role": "tool", "tool_call_id": "c1", "content": "sun"},
                                    {"role": "user", "content": "Thanks"}], None, CHAT,
     f"{B}{U}Weather?{A}</think>Checking.\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
     f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}"
     f"{U}<tool_result>sun</tool_result>\n\nThanks{A}</think>"),
    # [E] without tools, an assistant turn after the last user turn is impossible here; reasoning of two earlier
    # turns dropped, text parts joined
    ("earlier reasoning dropped", [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]},
                                   {"role": "assistant", "content": "1", "reasoning": "r1"},
                                   {"role": "user", "content": "c"},
                                   {"role": "assistant", "content": "2", "reasoning_content": "r2"},
                                   {"role": "user", "content": "d"}], None, ChatOptions(),
     f"{B}{U}ab{A}</think>1{E}{U}c{A}</think>2{E}{U}d{A}<think>"),
    # [E] developer: `<｜User｜>` + text; developer turns before the last user turn are dropped in thinking mode
    ("developer", [{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "hi"}], None,
     ChatOptions(), f"{B}{U}hi{A}<think>"),
    ("developer last", [SYS, {"role": "developer", "content": "dev rules"}], None, ChatOptions(),
     f"{B}You are a helpful assistant.{U}dev rules{A}<think>"),
]


@pytest.mark.parametrize("name,messages,tools,options,want", CASES, ids=[c[0] for c in CASES])
def test_encoding_table(name, messages, tools, options, want):
    assert encode_chat(messages, tools, options) == want


def test_request_switches():
    """[V]: thinking on by default; reasoning_effort none -> chat; low/medium -> the default level; max kept."""
    assert resolve_options(None, None) == ChatOptions(thinking=True)
    assert resolve_options(False, None) == ChatOptions(thinking=False)
    assert resolve_options(True, "none").thinking is False
    assert resolve_options(None, "low").effort == "high"  # the "v4" table's default level (nothing added)
    assert resolve_options(None, "max").effort == "max"
    assert resolve_options(None, "medium", "v4-tiered").effort == "low"
    with pytest.raises(ChatError, match="reasoning_effort"):
        resolve_options(None, "extreme")


@pytest.mark.parametrize("messages,match", [
    ([], "at least one message"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([Q, {"role": "assistant", "content": "4"}], "last message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ([Q, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, Q], "not JSON"),
    ([Q, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, Q], "JSON object"),
])
def test_refused(messages, match):
    with pytest.raises(ChatError, match=match):
        encode_chat(messages)

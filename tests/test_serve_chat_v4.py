"""The DeepSeek-V4 chat path through the server: the built-in tokenizer with V4's chat tokens added (`<think>` /
`</think>` special, so decoding drops them and the server must put them back for the parser) and a stub
scheduler that "generates" a scripted V4 answer. Checks the prompt the scheduler receives (the exact encoding),
reasoning_content / content / tool_calls, streaming == non-streaming, and n > 1 under concurrency."""
import json
import threading
import time

import openai
import pytest
from tokenizers import AddedToken

from dsv4_model.checkpoint.builtin import DEFAULT_MODEL_DIR
from dsv4_model.checkpoint.tokenizer import HFTokenizer
from dsv4_model.serve.app import ServeConfig, create_app
from dsv4_model.serve.chat_encoding import ASSISTANT, BOS, DSML, EOS, THINK, THINK_END, USER
from dsv4_model.serve.stub import StubScheduler
from test_serve_api import ServerThread

D = DSML
ANSWER = (f"The user wants weather.{THINK_END}Checking now.\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
          f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
          f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# asked for by a user message containing "two": two calls whose values need JSON escapes (quotes, backslashes,
# newlines, non-ASCII), to stream over HTTP
NASTY = 'a "q" \\ C:\\dir\\n\nnext\tline é 中文 😀 <b> \\u00e9'
TWO_CALLS = (f"Two lookups.{THINK_END}\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
             f"<{D}parameter name=\"city\" string=\"true\">{NASTY}</{D}parameter>\n"
             f"<{D}parameter name=\"days\" string=\"false\">[1, {{\"k\": \"v\\\"w\"}}]</{D}parameter>\n</{D}invoke>\n"
             f"<{D}invoke name=\"get_weather\">\n<{D}parameter name=\"city\" string=\"true\">Zürich</{D}parameter>\n"
             f"</{D}invoke>\n</{D}tool_calls>")
TWO_ARGS = [{"city": NASTY, "days": [1, {"k": 'v"w'}]}, {"city": "Zürich"}]


class PacedStub(StubScheduler):
    """A step every millisecond, as a model's decode is paced: the events of a step reach the client in chunks
    of their own instead of the whole answer in one (a stub that runs ahead fills the queue before the event loop
    reads it)."""

    def step(self) -> None:
        time.sleep(0.001)
        super().step()


@pytest.fixture(scope="module")
def served():
    tok = HFTokenizer(DEFAULT_MODEL_DIR / "tokenizer.json", bos_id=0, eos_id=1)
    tok._tok.add_tokens([AddedToken(DSML, special=False)])
    tok._tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, USER, ASSISTANT, THINK, THINK_END)])
    tok.eos_id = tok._tok.token_to_id(EOS)
    tok.bos_id = tok._tok.token_to_id(BOS)
    answer = tok.encode(ANSWER, add_bos=False) + [tok.eos_id]
    two = tok.encode(TWO_CALLS, add_bos=False) + [tok.eos_id]
    prompts = []

    def script(req):
        prompts.append(tok._tok.decode(req.prompt, skip_special_tokens=False))
        return two if "two" in prompts[-1] else answer

    srv = ServerThread(create_app(PacedStub(tok, script), ServeConfig(model_name="v4")))
    yield srv, prompts, answer
    srv.stop()


def test_tool_call_answer(served):
    srv, prompts, _ = served
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model="v4", messages=msgs, tools=TOOLS, reasoning_effort="max")
    m = r.choices[0].message
    assert m.reasoning_content == "The user wants weather."
    assert m.content == "Checking now."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls[0].id.startswith("call_")
    assert prompts[-1].startswith(BOS + "Reasoning Effort: Absolute maximum")
    assert "Be brief.\n\n## Tools\n\n" in prompts[-1] and '{"name": "get_weather"' in prompts[-1]
    assert prompts[-1].endswith(f"{USER}Weather in Paris?{ASSISTANT}{THINK}")


def test_streaming_equals_non_streaming_under_concurrency(served):
    srv, _, answer = served
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Weather?"}]
    results = {}

    def streamed(k):
        parts = {"reasoning": "", "content": "", "calls": []}
        for ch in c.chat.completions.create(model="v4", messages=msgs, tools=TOOLS, stream=True, n=2):
            for choice in ch.choices:
                d = choice.delta
                if choice.index == 0:
                    parts["reasoning"] += getattr(d, "reasoning_content", None) or ""
                    parts["content"] += d.content or ""
                    _accumulate(parts["calls"], d.tool_calls)
        parts["calls"] = [(t["name"], t["arguments"]) for t in parts["calls"]]
        results[k] = parts

    threads = [threading.Thread(target=streamed, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    whole = c.chat.completions.create(model="v4", messages=msgs, tools=TOOLS).choices[0].message
    want = {"reasoning": whole.reasoning_content, "content": whole.content,
            "calls": [(t.function.name, t.function.arguments) for t in whole.tool_calls]}
    assert len(results) == 4 and all(r == want for r in results.values())
    assert DSML not in whole.content


def _accumulate(calls: list[dict], pieces) -> None:
    """A streaming client's tool calls: a piece with an id opens call `index` (id, type, name), the pieces after
    it carry the next part of its arguments."""
    for t in pieces or []:
        if t.id is not None:
            assert t.index == len(calls) and t.type == "function" and t.function.name
            calls.append({"id": t.id, "name": t.function.name, "arguments": t.function.arguments or ""})
        else:
            assert t.index == len(calls) - 1 and t.function.name is None and t.type is None
            calls[-1]["arguments"] += t.function.arguments


def test_tool_call_arguments_stream_in_pieces(served):
    """Two calls with escaped values through the official client, streamed: the first piece of each call carries
    id / type / name, the arguments come in pieces (the stub emits a token per step) that join into the
    non-streaming response's exact arguments; the client's own stream helper accumulates the same calls."""
    srv, _, _ = served
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "two cities"}]
    whole = c.chat.completions.create(model="v4", messages=msgs, tools=TOOLS)
    m = whole.choices[0].message
    want = [(t.function.name, t.function.arguments) for t in m.tool_calls]
    assert [json.loads(a) for _, a in want] == TWO_ARGS and whole.choices[0].finish_reason == "tool_calls"
    assert (m.reasoning_content, m.content) == ("Two lookups.", None)

    calls, pieces, reasoning, content, reason = [], 0, "", "", None
    for ch in c.chat.completions.create(model="v4", messages=msgs, tools=TOOLS, stream=True):
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        _accumulate(calls, d.tool_calls)
        pieces += len(d.tool_calls or [])
        reason = ch.choices[0].finish_reason or reason
    assert [(t["name"], t["arguments"]) for t in calls] == want
    assert pieces > 2 and (reasoning, content, reason) == ("Two lookups.", "", "tool_calls")
    assert len({t["id"] for t in calls}) == 2 and DSML not in content

    with c.chat.completions.stream(model="v4", messages=msgs, tools=TOOLS) as s:
        final = s.get_final_completion()
    assert [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls] == want


def test_thinking_off(served):
    srv, prompts, _ = served
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model="v4", messages=[{"role": "user", "content": "hi"}],
                                  extra_body={"chat_template_kwargs": {"thinking": False}})
    assert prompts[-1] == f"{BOS}{USER}hi{ASSISTANT}{THINK_END}"
    # chat mode: no reasoning is parsed, so the scripted "...</think>" text stays content; no tools were given, so
    # the DSML block the model wrote is text too (OpenAI: no tool calls without tools)
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) is None and not m.tool_calls
    assert m.content == ANSWER and r.choices[0].finish_reason == "stop"


def test_no_tool_calls_without_tools_or_with_tool_choice_none(served):
    """tool_choice 'none' (tools listed) or no tools at all: the model's DSML comes back as content, streamed and
    not, and finish_reason is 'stop'; the same output with tools given is a call (test_tool_call_answer)."""
    srv, _, _ = served
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = c.chat.completions.create(model="v4", messages=msgs, **kw)
        m = r.choices[0].message
        assert not m.tool_calls and r.choices[0].finish_reason == "stop"
        assert (m.reasoning_content, m.content) == ("The user wants weather.", ANSWER.split(THINK_END)[1])
        content, reason = "", None
        for ch in c.chat.completions.create(model="v4", messages=msgs, stream=True, **kw):
            assert not ch.choices[0].delta.tool_calls
            content += ch.choices[0].delta.content or ""
            reason = ch.choices[0].finish_reason or reason
        assert (content, reason) == (m.content, "stop")


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    """parallel_tool_calls false: of the two calls the model writes, the answer carries the first (whole), streamed
    and not."""
    srv, _, _ = served
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "two cities"}]
    r = c.chat.completions.create(model="v4", messages=msgs, tools=TOOLS, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert [json.loads(t.function.arguments) for t in calls] == TWO_ARGS[:1]
    assert r.choices[0].finish_reason == "tool_calls"
    streamed = []
    for ch in c.chat.completions.create(model="v4", messages=msgs, tools=TOOLS, parallel_tool_calls=False,
                                        stream=True):
        _accumulate(streamed, ch.choices[0].delta.tool_calls)
    assert [(t["name"], t["arguments"]) for t in streamed] == [(t.function.name, t.function.arguments) for t in calls]

"""The DeepSeek-V4 chat path through the server: the built-in tokenizer with V4's chat tokens added (`<think>` /
`</think>` special, so decoding drops them and the server must put them back for the parser) and a stub
scheduler that "generates" a scripted V4 answer. Checks the prompt the scheduler receives (the exact encoding),
reasoning_content / content / tool_calls, streaming == non-streaming, and n > 1 under concurrency; the stub's
scripted log-probabilities check the logprobs objects (bytes, top_logprobs, entries past a stop string)."""
import json
import threading
import time

import httpx
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
# asked for by "unicode": characters of 2, 3 and 4 UTF-8 bytes, which byte-level tokens split
UNICODE = f"Réflexion: 中文 😀.{THINK_END}Voilà — 日本語, naïve café ✓"
# asked for by "plain": text with a stop string in its reasoning and its content
PLAIN = f"Let me think. STOPHERE maybe.{THINK_END}The answer is 42. STOPHERE end."
# asked for by "eos-in-call": a call the model ends (EOS) inside its invoke
EOS_IN_CALL = ANSWER[:ANSWER.index("Paris") + 3]


class PacedStub(StubScheduler):
    """A step every millisecond, as a model's decode is paced: the events of a step reach the client in chunks
    of their own instead of the whole answer in one (a stub that runs ahead fills the queue before the event loop
    reads it)."""

    def step(self) -> None:
        time.sleep(0.001)
        super().step()


def v4_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(DEFAULT_MODEL_DIR / "tokenizer.json", bos_id=0, eos_id=1)
    tok._tok.add_tokens([AddedToken(DSML, special=False)])
    tok._tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, USER, ASSISTANT, THINK, THINK_END)])
    tok.eos_id = tok._tok.token_to_id(EOS)
    tok.bos_id = tok._tok.token_to_id(BOS)
    return tok


def scripted_logprobs(tok):
    """The stub's log-probabilities: the token itself most likely, then two byte tokens that both decode to U+FFFD
    (the first bytes of "é" and "日"), the more likely first; a byte token's own entry shares their text."""
    pieces = [tok._tok.token_to_id(c) for c in ("Ã", "æ")]  # byte-level BPE's spelling of bytes 0xC3, 0xE6
    return lambda req, t: (-0.25, [(t, -0.25)] + [(a, v) for a, v in zip(pieces, (-1.5, -3.0)) if a != t])


@pytest.fixture(scope="module")
def served():
    tok = v4_tokenizer()
    answer = tok.encode(ANSWER, add_bos=False) + [tok.eos_id]
    scripts = {k: tok.encode(v, add_bos=False) + [tok.eos_id] for k, v in
               (("two", TWO_CALLS), ("unicode", UNICODE), ("plain", PLAIN))}
    scripts["eos-in-call"] = tok.encode(EOS_IN_CALL, add_bos=False) + [tok.eos_id]
    prompts = []

    def script(req):
        prompts.append(tok._tok.decode(req.prompt, skip_special_tokens=False))
        return next((ids for k, ids in scripts.items() if k in prompts[-1]), answer)

    stub = PacedStub(tok, script, logprobs=scripted_logprobs(tok))
    srv = ServerThread(create_app(stub, ServeConfig(model_name="v4")))
    yield srv, prompts, answer, tok
    srv.stop()


def test_tool_call_answer(served):
    srv, prompts, *_ = served
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
    srv, _, answer, _ = served
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


def test_tool_calls_stream_whole(served):
    """Two calls with escaped values through the official client, streamed: each call comes out in one piece
    (id / type / name and its whole arguments) once its invoke is closed, though the stub emits a token per step;
    they equal the non-streaming response's exact arguments; the client's own stream helper accumulates the same
    calls."""
    srv, *_ = served
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
    assert pieces == 2 and (reasoning, content, reason) == ("Two lookups.", "", "tool_calls")
    assert len({t["id"] for t in calls}) == 2 and DSML not in content

    with c.chat.completions.stream(model="v4", messages=msgs, tools=TOOLS) as s:
        final = s.get_final_completion()
    assert [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls] == want


def test_thinking_off(served):
    srv, prompts, *_ = served
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
    srv, *_ = served
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
    srv, *_ = served
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


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _both(c, **kw) -> tuple:
    """One chat request answered whole and streamed: (reasoning, content, calls [(name, arguments)], finish_reason,
    logprobs entries [(token, logprob, bytes, [(token, logprob, bytes)])]), the same either way."""
    def entry(e):
        return e.token, e.logprob, e.bytes, [(t.token, t.logprob, t.bytes) for t in getattr(e, "top_logprobs", [])]

    ch = c.chat.completions.create(model="v4", **kw).choices[0]
    m = ch.message
    whole = (getattr(m, "reasoning_content", None) or "", m.content or "",
             [(t.function.name, t.function.arguments) for t in m.tool_calls or []], ch.finish_reason,
             [entry(e) for e in ch.logprobs.content] if ch.logprobs else [])
    reasoning, content, calls, reason, entries = "", "", [], None, []
    for chunk in c.chat.completions.create(model="v4", stream=True, **kw):
        x = chunk.choices[0]
        reasoning += getattr(x.delta, "reasoning_content", None) or ""
        content += x.delta.content or ""
        _accumulate(calls, x.delta.tool_calls)
        reason = x.finish_reason or reason
        entries += [entry(e) for e in x.logprobs.content] if x.logprobs else []
    assert (reasoning, content, [(t["name"], t["arguments"]) for t in calls], reason, entries) == whole
    return whole


def _tokens_to(tok, ids: list[int], text: str) -> int:
    """How many of `ids` the model writes before `text` is out (special tokens' text included)."""
    return next(n for n in range(len(ids) + 1) if tok._tok.decode(ids[:n], skip_special_tokens=False).startswith(text))


def test_a_call_cut_off_is_no_call(served):
    """A tool call comes out only once its invoke is complete: cut off by max_tokens, a stop string or EOS inside
    it, it is neither a call nor content (no DSML either), and finish_reason is the reason of the cut; calls written
    whole before the cut still come out. Streamed as not."""
    srv, _, answer, tok = served
    c = _client(srv)
    weather = [{"role": "user", "content": "Weather?"}]
    block = ANSWER.index(f"<{D}tool_calls>")
    call = ("get_weather", {"city": "Paris", "days": 2})
    two = tok.encode(TWO_CALLS, add_bos=False)
    for kw, calls, reason in (
            (dict(max_tokens=_tokens_to(tok, answer, EOS_IN_CALL)), [], "length"),  # in a parameter's value
            (dict(stop=["Paris"]), [], "stop"),
            (dict(max_tokens=_tokens_to(tok, answer, ANSWER[:block + 2])), [], "length"),  # in the block's tag
            (dict(max_tokens=_tokens_to(tok, answer, ANSWER[:ANSWER.index(f"</{D}invoke>") + 9])), [], "length"),
            (dict(max_tokens=_tokens_to(tok, answer, ANSWER[:ANSWER.index(f"</{D}tool_calls>")])), [call],
             "length"),  # the invoke closed, the block not: a whole call, cut short
            (dict(messages=[{"role": "user", "content": "eos-in-call"}]), [], "stop")):
        r, content, got, why, _ = _both(c, **{"messages": weather, "tools": TOOLS, **kw})
        assert (r, content, why) == ("The user wants weather.", "Checking now.", reason), kw
        assert [(n, json.loads(a)) for n, a in got] == calls, kw
    # the second of two calls cut off: the first alone, finish_reason length
    cut = _tokens_to(tok, two, TWO_CALLS[:TWO_CALLS.index("Zür") + 2])
    _, content, got, why, _ = _both(c, messages=[{"role": "user", "content": "two cities"}], tools=TOOLS,
                                    max_tokens=cut)
    assert [json.loads(a) for _, a in got] == TWO_ARGS[:1] and (content, why) == ("", "length")


def test_developer_is_the_system_prompt(served):
    """OpenAI's developer role (the SDK's system prompt) is encoded as a system message, in thinking mode (where
    the encoder's own developer turn before the user's is dropped) and in chat mode; a conversation must not end on
    one (as on a system message)."""
    srv, prompts, *_ = served
    c = _client(srv)
    for extra in ({}, {"chat_template_kwargs": {"thinking": False}}):
        got = []
        for role in ("developer", "system"):
            msgs = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "hi"}]
            c.chat.completions.create(model="v4", messages=msgs, max_tokens=2, extra_body=extra)
            got.append(prompts[-1])
            got.append(httpx.post(srv.url + "/tokenize", json={"messages": msgs, **extra}).json()["tokens"])
        assert got[0] == got[2] and got[1] == got[3] and "Answer in French." in got[0], extra
    with pytest.raises(openai.BadRequestError, match="the last message must be from the user or a tool") as e:
        c.chat.completions.create(model="v4", messages=[{"role": "user", "content": "hi"},
                                                         {"role": "developer", "content": "Be brief."}])
    assert e.value.body["param"] == "messages"


def test_chat_logprobs_bytes_are_each_tokens_own(served):
    """Characters of 2 to 4 bytes split over byte-level tokens: each token's `bytes` are its own (a first byte's
    token reads U+FFFD but its bytes are not U+FFFD's), so the entries' bytes joined are the answer's text (the
    special `</think>` has none); top_logprobs likewise. Streamed as not."""
    srv, *_ = served
    reasoning, content, _, _, entries = _both(_client(srv), messages=[{"role": "user", "content": "unicode"}],
                                              logprobs=True, top_logprobs=3)
    assert bytes(b for e in entries for b in e[2]).decode("utf-8") == reasoning + content == \
        UNICODE.replace(THINK_END, "")
    fffd = list("\ufffd".encode())
    pieces = [e for e in entries if e[0] == "\ufffd"]
    alts = [a for e in entries for a in e[3] if a[0] == "\ufffd"]
    assert pieces and alts and all(x[2] != fffd and len(x[2]) < 4 for x in pieces + alts)
    assert {bytes(a[2]) for e in entries for a in e[3][1:]} == {b"\xc3", b"\xe6"}


def test_completion_top_logprobs_keep_the_most_likely(served):
    """Completions' top_logprobs are keyed by text: two byte tokens that both read U+FFFD share a key, which keeps
    the more likely's value, so a chosen token that is the most likely has its own log-probability there."""
    srv, *_ = served
    c = _client(srv)
    r = c.completions.create(model="v4", prompt="unicode", max_tokens=64, logprobs=3)
    lp = r.choices[0].logprobs
    assert "\ufffd" in lp.tokens and r.choices[0].finish_reason == "stop"
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[t] == v == max(top.values()) == -0.25, (t, top)
        assert top["\ufffd"] == (-0.25 if t == "\ufffd" else -1.5), (t, top)
    streamed = [c.choices[0].logprobs for c in c.completions.create(model="v4", prompt="unicode", max_tokens=64,
                                                                     logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [x for s in streamed for x in s.top_logprobs] == lp.top_logprobs


def test_logprobs_end_where_a_stop_string_cuts_the_text(served):
    """A stop string ends the text before it: the logprob entries are those of the tokens whose text starts in
    the returned text (none of the stop string's), their offsets inside it; streamed as not."""
    srv, _, _, tok = served
    c = _client(srv)
    ids = tok.encode(PLAIN, add_bos=False)
    starts = [len(tok.decode(ids[:j])) for j in range(len(ids))]  # where each token's text starts
    chat = _both(c, messages=[{"role": "user", "content": "plain"}], stop=["STOPHERE"], logprobs=True,
                 extra_body={"chat_template_kwargs": {"thinking": False}})
    text = "Let me think. "
    assert chat[1] == text and chat[3] == "stop"
    assert len(chat[4]) == sum(a < len(text) for a in starts) < len(ids)
    assert "".join(e[0] for e in chat[4]).startswith(text)
    kw = dict(model="v4", prompt="plain", stop=["42"], max_tokens=64, logprobs=1)
    r = c.completions.create(**kw).choices[0]
    lp = r.logprobs
    assert r.text == "Let me think. STOPHERE maybe.The answer is " and r.finish_reason == "stop"
    assert len(lp.tokens) == sum(a < len(r.text) for a in starts) and max(lp.text_offset) < len(r.text)
    streamed = [x.choices[0].logprobs for x in c.completions.create(stream=True, **kw) if x.choices and
                x.choices[0].logprobs]
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [t for s in streamed for t in s.tokens] == lp.tokens


def test_a_special_tokens_text_as_stop(served):
    """`</think>` is a special token here: decoding leaves it out of the text stop strings are matched against.
    Given alone it ends the completion as a stop id (as lm-evaluation-harness's EOS stop, as vLLM honours it):
    the completion is the text before it, finish_reason stop; inside a longer stop string it could never match:
    a 400 naming stop, for chat and completions."""
    srv, *_ = served
    c = _client(srv)
    for call in (lambda: c.chat.completions.create(model="v4", messages=[{"role": "user", "content": "hi"}],
                                                    stop=["x", f"done{THINK_END}"]),
                 lambda: c.completions.create(model="v4", prompt="hi", stop=f"{THINK_END}x")):
        with pytest.raises(openai.BadRequestError, match="could never match") as e:
            call()
        assert e.value.body["param"] == "stop"
    r = c.completions.create(model="v4", prompt="plain", stop=[THINK_END, EOS], max_tokens=64, temperature=0)
    assert r.choices[0].text == PLAIN[:PLAIN.index(THINK_END)] and r.choices[0].finish_reason == "stop"
    m = c.chat.completions.create(model="v4", messages=[{"role": "user", "content": "plain"}], stop=THINK_END,
                                  max_tokens=64, temperature=0)
    assert m.choices[0].message.reasoning_content == PLAIN[:PLAIN.index(THINK_END)]
    assert not m.choices[0].message.content and m.choices[0].finish_reason == "stop"


def _rejected(url: str, status: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'dsv4:rejected_requests_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_lone_surrogates_are_400s(served):
    """A lone surrogate in JSON ("\\ud800") is no text: a 400 naming the field, before any tokenization (counted a
    400 in /metrics, not a 500)."""
    srv, *_ = served
    bad = '"a\\ud800b"'
    cases = [("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}', "messages",
              "messages[0].content"),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function",'
              ' "function": {"name": %s}}]}', "tools", "tools[0].function.name"),
             ("/v1/completions", '{"prompt": %s}', "prompt", "prompt"),
             ("/v1/completions", '{"prompt": ["ok", %s]}', "prompt", "prompt[1]"),
             ("/tokenize", '{"prompt": %s}', "prompt", "prompt"),
             ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}', "messages", "messages[0].content")]
    n400, n500 = _rejected(srv.url, "400"), _rejected(srv.url, "500")
    for path, body, param, where in cases:
        r = httpx.post(srv.url + path, content=body % bad, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(f"{where}: a lone UTF-16 surrogate"), r.text
    assert (_rejected(srv.url, "400"), _rejected(srv.url, "500")) == (n400 + len(cases), n500)


def test_legacy_functions_and_stream_options_are_refused(served):
    """OpenAI's deprecated functions / function_call would be ignored (the model answering without them): 400s
    that name them and their replacements; stream_options without stream: true is a 400 (as OpenAI and vLLM)."""
    srv, *_ = served
    c = _client(srv)
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param, use in (({"functions": [{"name": "f", "parameters": {}}]}, "functions", "use tools"),
                              ({"function_call": "auto"}, "function_call", "use tool_choice")):
        with pytest.raises(openai.BadRequestError, match=use) as e:
            c.chat.completions.create(model="v4", messages=msgs, extra_body=extra)
        assert e.value.body["param"] == param
    for call in (lambda: c.chat.completions.create(model="v4", messages=msgs, stream_options={"include_usage": True}),
                 lambda: c.completions.create(model="v4", prompt="hi", stream_options={"include_usage": True})):
        with pytest.raises(openai.BadRequestError, match="only with stream: true") as e:
            call()
        assert e.value.body["param"] == "stream_options"


def test_models_retrieve(served):
    """GET /v1/models/{id} (the client's models.retrieve): the served model, or an OpenAI-style 404."""
    srv, *_ = served
    c = _client(srv)
    m = c.models.retrieve("v4")
    assert (m.id, m.object, m.owned_by) == ("v4", "model", "dsv4")
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4")
    assert e.value.body["type"] == "not_found_error" and e.value.body["param"] == "model"


def test_chat_prompts_mark_the_prefixes_the_next_ones_repeat():
    """ChatFormat's snapshot positions, checked against the prompts that follow: the system part's end is where
    another conversation with the same system prompt diverges (tokens equal before it); in thinking mode the
    position before the final `<think>` is where the next turn (earlier reasoning dropped, its header rewritten
    `</think>`) diverges from this prompt; with tools (reasoning kept) or thinking off no such position, since the
    next turn extends the whole sequence. The server hands them to the scheduler (Request.snapshot_at), and with
    n > 1 the position before each prompt's last token (its samples share one prefill)."""
    from dsv4_model.serve.chat_format import ChatFormat
    from dsv4_model.serve.protocol import ChatRequest

    tok = v4_tokenizer()
    fmt = ChatFormat("deepseek_v4", tok)
    system = {"role": "system", "content": "You are a careful assistant. " * 8}

    def prompt(msgs, **kw):
        return fmt.prompt(ChatRequest(model="v4", messages=msgs, **kw))

    def diverge(a, b):
        return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)

    turn1 = [system, {"role": "user", "content": "Name a prime."}]
    p1 = prompt(turn1)
    turn2 = turn1 + [{"role": "assistant", "reasoning_content": "Two is prime.", "content": "2"},
                     {"role": "user", "content": "Another?"}]
    p2 = prompt(turn2)
    other = prompt([system, {"role": "user", "content": "Which colour?"}])
    sys_end = diverge(p1.ids, other.ids) - 1  # both continue with <｜User｜>
    assert p1.ids[sys_end] == tok._tok.token_to_id(USER)
    assert p1.snapshot_at == (sys_end, len(p1.ids) - 1) and diverge(p1.ids, p2.ids) == len(p1.ids) - 1
    assert p2.snapshot_at == (sys_end, len(p2.ids) - 1) and p2.ids[:sys_end] == p1.ids[:sys_end]
    off = prompt(turn1, chat_template_kwargs={"thinking": False})
    off_other = prompt([system, {"role": "user", "content": "Which colour?"}], chat_template_kwargs={"thinking": False})
    assert off.snapshot_at == (diverge(off.ids, off_other.ids) - 1,)
    with_tools = prompt(turn1, tools=TOOLS)
    other_tools = prompt([system, {"role": "user", "content": "Which colour?"}], tools=TOOLS)
    assert with_tools.snapshot_at == (diverge(with_tools.ids, other_tools.ids) - 1,)
    assert prompt(turn1[1:]).snapshot_at[-1] == len(prompt(turn1[1:]).ids) - 1

    seen = []
    stub = StubScheduler(tok, lambda req: seen.append(req.snapshot_at) or [tok.eos_id])
    srv = ServerThread(create_app(stub, ServeConfig(model_name="v4")))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        c.chat.completions.create(model="v4", messages=turn2)
        c.completions.create(model="v4", prompt="Name a prime.")
        c.completions.create(model="v4", prompt="Name a prime.", n=2)  # the samples share one prefill
    finally:
        srv.stop()
    last = len(tok.encode("Name a prime.", add_bos=True)) - 1
    assert seen == [p2.snapshot_at, (), (last,), (last,)]

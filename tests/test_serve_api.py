"""The OpenAI-compatible server (dsv4_model.serve) through the official `openai` client over loopback: a real
uvicorn on 127.0.0.1 (a free port) in a thread of this process, serving the built-in model on the CPU. Greedy texts
are checked against generate() on the same engine before the server took it."""
import json
import logging
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

import dsv4_ops  # noqa: F401
from dsv4_model.checkpoint.builtin import DEFAULT_MODEL_DIR
from dsv4_model.runtime.engine import Engine
from dsv4_model.runtime.generate import generate
from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.scheduler import Scheduler
from dsv4_model.serve.app import ServeConfig, create_app

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "x = 1", "for i in range(10):", "def f(x):"]
N = 14  # tokens per completion: short, the CPU machine is shared
KEY = "sk-test"


class ServerThread:
    """uvicorn on 127.0.0.1:0 in a thread; .url once it listens; stop() shuts it down (the app drains)."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30 and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def _engine(batch: int) -> Engine:
    return Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.bfloat16, max_batch_size=batch,
                                  max_seq_len=256, quant="none", progress=False)


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    engine = _engine(4)
    tok = engine.get_tokenizer()
    ref = {p: generate(engine, [tok.encode(p)], max_new_tokens=N).texts[0] for p in PROMPTS}
    srv = ServerThread(create_app(Scheduler(engine, max_prefill_tokens=32),
                                  ServeConfig(model_name="tiny", max_waiting=32, chat_format="plain")))
    yield srv, ref, tok
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def small():
    """One row, one waiting slot, an API key, chat format auto (the built-in model has none)."""
    srv = ServerThread(create_app(Scheduler(_engine(1)), ServeConfig(model_name="tiny", max_waiting=1, api_key=KEY)))
    yield srv
    srv.stop()


def _metric(url: str, name: str, labels: str = "") -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + (labels and "{" + labels + "}") + " "):
            return float(line.split()[-1])
    return 0.0


def test_models_health_version(served, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(served[0].url + "/health").json() == {"status": "ok"}
    assert httpx.get(served[0].url + "/version").json()["version"]


def test_completion_is_the_greedy_text(served, client):
    _, ref, tok = served
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0)
    assert r.choices[0].text == ref[PROMPTS[0]]
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0])) and r.usage.completion_tokens == N
    assert r.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming(served, client):
    _, ref, _ = served
    for p in PROMPTS[1:3]:
        chunks = list(client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref[p]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == N and not chunks[-1].choices
        # chat in the plain format: the prompt is the message + "\n", so it equals a completion of that
        msgs = [{"role": "user", "content": p}]
        whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N, temperature=0)
        parts = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in parts)
        assert text == whole.choices[0].message.content
        plain = client.completions.create(model="tiny", prompt=p + "\n", max_tokens=N, temperature=0)
        assert text == plain.choices[0].text
        # OpenAI text parts (what many clients send) are the same message
        cut = len(p) // 2
        split = [{"role": "user", "content": [{"type": "text", "text": p[:cut]}, {"type": "text", "text": p[cut:]}]}]
        joined = client.chat.completions.create(model="tiny", messages=split, max_tokens=N, temperature=0)
        want = client.completions.create(model="tiny", prompt=p[:cut] + "\n" + p[cut:] + "\n", max_tokens=N,
                                         temperature=0)
        assert joined.choices[0].message.content == want.choices[0].text


def test_concurrent_requests_each_get_their_solo_text(served, client):
    """More requests than rows (6 into 4), streaming and not, at once: each text is its prompt's greedy text."""
    _, ref, _ = served
    out = {}

    def one(i, p):
        if i % 2:
            s = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, stream=True)
            out[p] = "".join(c.choices[0].text for c in s)
        else:
            out[p] = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0).choices[0].text

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == ref


def test_n_and_seed_and_stop(served, client):
    _, ref, _ = served
    kw = dict(model="tiny", prompt=PROMPTS[4], max_tokens=N, temperature=0.9, top_p=0.95)
    both = client.completions.create(n=2, seed=7, **kw)
    apart = [client.completions.create(seed=s, **kw).choices[0].text for s in (7, 8)]
    assert [c.text for c in both.choices] == apart  # choice i draws from seed + i
    # usage counts each prompt once, whatever n (as OpenAI): two prompts, one of them given twice, n = 2
    _, _, tok = served
    ids = [tok.encode(p) for p in (PROMPTS[4], PROMPTS[1], PROMPTS[4])]
    r = client.completions.create(model="tiny", prompt=[PROMPTS[4], PROMPTS[1], PROMPTS[4]], max_tokens=2, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 12
    word = ref[PROMPTS[0]][5:8]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, stop=[word])
    assert cut.choices[0].text == ref[PROMPTS[0]][: ref[PROMPTS[0]].index(word)]
    assert cut.choices[0].finish_reason == "stop"


def test_tokenize_and_detokenize(served, client):
    """/tokenize (vLLM's route) gives the ids a request prefills: a prompt with BOS (or without), chat messages as
    the chat format encodes them (plain here: text + newline after BOS); /detokenize the text back; 4xx bodies."""
    srv, _, tok = served
    url = srv.url
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": PROMPTS[0]}).json()
    assert r["tokens"] == tok.encode(PROMPTS[0]) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    bare = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(PROMPTS[0], add_bos=False)
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": PROMPTS[1]}]}).json()
    assert chat["tokens"] == tok.encode(PROMPTS[1] + "\n")
    back = httpx.post(url + "/detokenize", json={"tokens": bare["tokens"]}).json()
    assert back == {"prompt": PROMPTS[0]}
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens"), ("/tokenize", {"model": "no",
                                                                                                "prompt": "x"}, "model")):
        e = httpx.post(url + path, json=body)
        assert e.status_code in (400, 404) and e.json()["error"]["param"] == param, e.text


@pytest.mark.parametrize("kw,param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(n=100), "n"), (dict(stop=[""]), "stop"), (dict(logprobs=21), "logprobs"), (dict(seed="x"), "seed"),
    (dict(prompt="word " * 300), "prompt"), (dict(prompt=[5, 99999]), "prompt"), (dict(prompt=[]), "prompt"),
    (dict(prompt=[5, -1]), "prompt"), (dict(prompt=[5, 2**40], echo=True), "prompt"),  # before any decode
    (dict(model="other"), "model"), (dict(stop=["s"] * 17), "stop"),
    (dict(extra_body={"top_k": 10**20}), "top_k"),  # past int64 (the sampler's tensor): once, it stopped the loop
    (dict(prompt="word " * 100, max_tokens=250), "max_tokens"),  # prompt + max_tokens past the context of 256
    # fields clients send that this sampler does not do: refused, not answered without them
    (dict(extra_body={"logit_bias": {"5": -100}}), "logit_bias"),
    (dict(extra_body={"repetition_penalty": 1.1}), "repetition_penalty"), (dict(extra_body={"min_p": 0.1}), "min_p"),
    (dict(extra_body={"min_tokens": 2}), "min_tokens"), (dict(extra_body={"guided_choice": ["a"]}), "guided_choice"),
    (dict(extra_body={"stop_token_ids": [5]}), "stop_token_ids"),
    (dict(extra_body={"response_format": {"type": "json_object"}}), "response_format"),
])
def test_invalid_fields_are_4xx(client, kw, param):
    args = dict(model="tiny", prompt="x", max_tokens=4) | kw
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == (404 if param == "model" else 400)
    assert e.value.body["param"] == param and e.value.body["message"]
    assert "Value error" not in e.value.body["message"]  # pydantic's own prefix


def test_null_is_the_default_and_types_are_strict(served, client):
    """null for a field with a default is that default (OpenAI types them "number or null"; client libraries send
    unset fields as null): the same seeded completion as without them. A bool is not a token id, "yes" not true, and
    a prompt of another type is refused naming what the field takes."""
    url = served[0].url
    base = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "seed": 7}
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "n", "stream", "echo", "ignore_eos",
                               "presence_penalty", "frequency_penalty", "stop", "logprobs", "stream_options")}
    a = httpx.post(url + "/v1/completions", json=base, timeout=60)
    b = httpx.post(url + "/v1/completions", json=base | nulls, timeout=60)
    assert a.status_code == b.status_code == 200
    assert b.json()["choices"][0]["text"] == a.json()["choices"][0]["text"] and len(b.json()["choices"]) == 1
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=chat | {"temperature": None, "n": None, "top_p": None,
                                                              "max_completion_tokens": None}, timeout=60)
    assert r.status_code == 200, r.text
    for body, param, says in [
            ({"prompt": [True, False]}, "prompt", "a list of token ids"), ({"prompt": 123}, "prompt", "a string"),
            ({"prompt": [1.5]}, "prompt", "a list of token ids"), ({"prompt": "x", "stream": "yes"}, "stream", ""),
            ({"prompt": "x", "echo": 1}, "echo", ""), ({"prompt": None}, "prompt", "a string")]:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "max_tokens": 2} | body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert says in r.json()["error"]["message"] and ".str:" not in r.json()["error"]["message"]
    for msgs in ([{"role": "user"}], [{"role": "system", "content": None}, {"role": "user", "content": "x"}]):
        r = httpx.post(url + "/v1/chat/completions", json=chat | {"messages": msgs}, timeout=60)
        assert r.status_code == 400 and "needs content" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/chat/completions",
                   json=chat | {"chat_template_kwargs": {"thinking": "yes"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_neutral_values_of_refused_fields_are_accepted(client):
    """The neutral value of each refused field (what vLLM clients send by default) changes nothing: answered."""
    neutral = {"logit_bias": {}, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "stop_token_ids": [],
               "skip_special_tokens": True, "include_stop_str_in_output": False}
    r = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=neutral)
    assert r.usage.completion_tokens >= 1


def test_chat_4xx(served, client):
    with pytest.raises(openai.BadRequestError, match="tools need --chat-format deepseek_v4"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    r = httpx.post(served[0].url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(served[0].url + "/v1/chat/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None  # not the parser's character offset
    assert r.json()["error"]["message"].startswith("invalid JSON body: JSON decode error")
    r = httpx.post(served[0].url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 99999]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt: token id 99999 at position 2")
    r = httpx.post(served[0].url + "/v1/chat/completions", json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="the context is 256 tokens") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=256)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="reasoning_effort must be one of") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       reasoning_effort="banana")
    assert e.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError, match="only text parts are supported"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_client_disconnect_cancels(served, client, caplog):
    caplog.set_level(logging.INFO, logger="dsv4.serve")
    url = served[0].url
    before = _metric(url, "dsv4:request_success_total", 'finished_reason="abort"')
    s = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), s):
        pass
    s.close()
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up while it runs
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True},
                   timeout=httpx.Timeout(0.5, connect=5))
    t0 = time.monotonic()
    while _metric(url, "dsv4:request_success_total", 'finished_reason="abort"') < before + 2:
        assert time.monotonic() - t0 < 10, "a disconnected request was not cancelled"
        time.sleep(0.05)
    assert _metric(url, "dsv4:num_requests_running") == 0

    def gone():  # the log line of each (written on the event loop, just after the cancellation)
        return [r.getMessage() for r in caplog.records if "the client went away" in r.getMessage()]

    while len(gone()) < 2:
        assert time.monotonic() - t0 < 10, gone()
        time.sleep(0.05)
    assert len(gone()) == 2 and all(m.startswith("cmpl-") for m in gone()), gone()


def test_metrics(served, client):
    srv, _, tok = served
    url = srv.url
    gen0, ttft0 = _metric(url, "dsv4:generation_tokens_total"), _metric(url, "dsv4:time_to_first_token_seconds_count")
    prompt0 = _metric(url, "dsv4:prompt_tokens_total")
    client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=5, temperature=0, n=2)
    assert _metric(url, "dsv4:generation_tokens_total") == gen0 + 10
    assert _metric(url, "dsv4:prompt_tokens_total") == prompt0 + len(tok.encode(PROMPTS[5]))  # once, as usage
    assert _metric(url, "dsv4:time_to_first_token_seconds_count") == ttft0 + 2
    text = httpx.get(url + "/metrics").text
    for name in ("dsv4:num_requests_waiting", "dsv4:inter_token_latency_seconds_bucket",
                 "dsv4:e2e_request_latency_seconds_bucket", "dsv4:prompt_tokens_total", "dsv4:prefix_cache_hits"):
        assert name in text


def test_api_key_and_no_chat_format(small):
    bad = openai.OpenAI(base_url=small.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.response.headers["www-authenticate"] == "Bearer"  # RFC 6750
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
        assert httpx.get(small.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(small.url + "/health").status_code == 200  # outside /v1: open
    # without the key nothing about the body or the route is told: 401 before the JSON is read, on any /v1 path
    for path, body in (("/v1/completions", b"{bad"), ("/v1/nowhere", b"{}"), ("/tokenize", b"{}")):
        r = httpx.post(small.url + path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    two = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")]  # ambiguous: refused
    assert httpx.get(small.url + "/v1/models", headers=two).status_code == 401
    r = httpx.post(small.url + "/v1/nowhere", json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    good = openai.OpenAI(base_url=small.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no DeepSeek-V4 chat tokens"):
        good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])


def test_429_when_the_queue_is_full(small):
    """One row, one waiting slot: a third request while one runs and one waits gets 429."""
    c = openai.OpenAI(base_url=small.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    long = dict(model="tiny", prompt="def f(x):", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    running = c.completions.create(stream=True, **long)
    next(iter(running))
    waiting = []
    t = threading.Thread(target=lambda: waiting.append(c.completions.create(**{**long, "max_tokens": 3})))
    t.start()
    t0 = time.monotonic()
    while _metric(small.url, "dsv4:num_requests_waiting") < 1:
        assert time.monotonic() - t0 < 10
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(**long)
    assert e.value.response.headers["retry-after"] == "1"
    # more completions than the queue ever holds: a 400 naming n (a retry would never succeed), not a 429
    with pytest.raises(openai.BadRequestError, match="more than the server queues at once") as e:
        c.completions.create(**{**long, "n": 2})
    assert e.value.body["param"] == "n"
    running.close()  # frees the row: the waiting one runs
    t.join(60)
    assert waiting and waiting[0].usage.completion_tokens == 3
    assert json.loads(httpx.get(small.url + "/health").text) == {"status": "ok"}


def test_a_chunk_carries_each_choice_once():
    """The events of one scheduler step reach the SSE writer together: a choice's last text and its finish (and a
    tool call and its finish) go out as one choice entry, never two entries of one index in a chunk."""
    from dsv4_model.serve.app import _merge

    done = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert _merge([{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None},
                   {"index": 0, "text": "c", "logprobs": None, "finish_reason": None}, done,
                   {"index": 1, "text": "x", "logprobs": None, "finish_reason": None}]) == [
        {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "x", "logprobs": None, "finish_reason": None}]
    two = _merge([{"index": i, "text": x, "logprobs": None, "finish_reason": None}
                  for i, x in ((0, "a"), (1, "b"), (0, "c"), (1, "d"))] + [done])
    assert two == [{"index": 0, "text": "ac", "logprobs": None, "finish_reason": "length"},
                   {"index": 1, "text": "bd", "logprobs": None, "finish_reason": None}]  # n = 2, two steps queued
    call = {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                            "function": {"name": "f", "arguments": "{}"}}]}
    got = _merge([{"index": 0, "delta": call, "logprobs": None, "finish_reason": None},
                  {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}])
    assert got == [{"index": 0, "delta": call, "logprobs": None, "finish_reason": "tool_calls"}]
    lp = [{"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]},
          {"content": [{"token": "b", "logprob": -1.5, "bytes": [98], "top_logprobs": []}]}]
    text = _merge([{"index": 0, "delta": {"content": "a"}, "logprobs": lp[0], "finish_reason": None},
                   {"index": 0, "delta": {"content": "b"}, "logprobs": lp[1], "finish_reason": None},
                   {"index": 0, "delta": {"reasoning_content": "r"}, "logprobs": None, "finish_reason": None}])
    assert text == [{"index": 0, "delta": {"content": "ab", "reasoning_content": "r"},
                     "logprobs": {"content": lp[0]["content"] + lp[1]["content"]}, "finish_reason": None}]


def test_logprobs(served, client):
    """logprobs through the openai client, streamed and not: the scheduler's per-token log-probabilities (the
    greedy token is the most likely one), the same either way; completions' text offsets add up to the text."""
    _, ref, tok = served
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref[PROMPTS[0]] and len(lp.tokens) == N and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N)]
    for tok_s, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) >= 1 and abs(max(top.values()) - v) < 1e-6  # greedy: the most likely
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                            logprobs=3, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                       max_tokens=N, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == N and all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
                                     for e in content)
    s = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                            max_tokens=N, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    assert [e.logprob for ch in s if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content] \
        == [e.logprob for e in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)


def test_echo_scores_the_prompt(served, client):
    """echo with logprobs (how lm-evaluation-harness's local-completions scores a continuation): the prompt comes
    back before the completion with its tokens' log-probabilities (the first null, as OpenAI gives it), equal to a
    whole-prompt prefill's logits; max_tokens=0 scores without generating; streamed as not; max_tokens=0 without
    echo and logprobs is a 400."""
    _, ref, tok = served
    ids = tok.encode(PROMPTS[0])
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPTS[0] and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and len(lp.tokens) == len(ids) == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    engine = _engine(1)
    want = torch.log_softmax(engine.prefill(torch.tensor([ids]), all_logits=True)[0].float(), -1)
    for t in range(1, len(ids)):
        assert abs(lp.token_logprobs[t] - float(want[t - 1, ids[t]])) < 0.05, t  # bf16, chunked vs whole prefill
        top = lp.top_logprobs[t]  # the 2 most likely and the prompt's own token (OpenAI: up to k + 1)
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(want[t - 1].topk(2).values.tolist(), abs=0.05), t
        assert len(top) <= 3 and top[lp.tokens[t]] == lp.token_logprobs[t], t
    g = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, echo=True, logprobs=1)
    glp = g.choices[0].logprobs
    assert g.choices[0].text == PROMPTS[0] + ref[PROMPTS[0]] and len(glp.tokens) == len(ids) + N
    assert glp.token_logprobs[:len(ids)] == lp.token_logprobs
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == g.choices[0].text
    assert [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] \
        == glp.token_logprobs
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == PROMPTS[0] + ref[PROMPTS[0]][:len(plain.choices[0].text) - len(PROMPTS[0])]
    assert plain.choices[0].logprobs is None
    url = served[0].url
    done0, prompt0 = _metric(url, "dsv4:request_success_total", 'finished_reason="length"'), \
        _metric(url, "dsv4:prompt_tokens_total")
    bare = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=0, echo=True)  # nothing runs
    assert [c.text for c in bare.choices] == [PROMPTS[0], tok.decode(ids[:3])]
    assert {c.finish_reason for c in bare.choices} == {"length"} and bare.usage.prompt_tokens == len(ids) + 3
    # still counted in /metrics, as requests the scheduler answers are
    assert _metric(url, "dsv4:request_success_total", 'finished_reason="length"') == done0 + 2
    assert _metric(url, "dsv4:prompt_tokens_total") == prompt0 + len(ids) + 3
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[0]
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_echo_offsets_index_the_returned_text(served, client):
    """text_offset for a prompt whose characters span several tokens (or share one): offsets rise with the
    returned text, each token's at most the text's length, the completion's first at the prompt's end; streamed
    as not."""
    _, _, tok = served
    prompt = "naïve café — 日本語のテキスト ✓"
    ids = tok.encode(prompt)
    assert len(ids) != len(prompt)  # the case: tokens and characters do not line up one to one
    kw = dict(model="tiny", prompt=prompt, max_tokens=N, temperature=0, echo=True, logprobs=1)
    r = client.completions.create(**kw)
    text, off = r.choices[0].text, r.choices[0].logprobs.text_offset
    assert text.startswith(prompt) and len(off) == len(ids) + N
    assert off == sorted(off) and off[0] == 0 and off[-1] <= len(text)
    assert max(off[:len(ids)]) <= len(prompt) and off[len(ids)] == len(prompt)
    streamed = [o for c in client.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for o in c.choices[0].logprobs.text_offset]
    assert streamed == off


def test_echo_scoring_keeps_a_stop_tokens_logprob(served):
    """lm-evaluation-harness scores a continuation with max_tokens=1, echo and logprobs=1 and drops the last entry
    (the generated token's): when that token is EOS (here: the greedy token, made the scheduler's EOS) its entry
    still comes last, streamed and not, though the text leaves it out."""
    _, ref, tok = served
    ids = tok.encode(PROMPTS[0])
    sched = Scheduler(_engine(1))
    first = sched.submit(Request(ids, max_tokens=1, logprobs=1, ignore_eos=True))
    sched.run_until_idle()
    sched.eos = frozenset({first.token_ids[0]})
    srv = ServerThread(create_app(sched, ServeConfig(model_name="tiny", max_waiting=4, chat_format="plain")))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0, echo=True, logprobs=1)
        r = client.completions.create(**kw)
        lp = r.choices[0].logprobs
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == PROMPTS[0]
        assert len(lp.token_logprobs) == len(ids) + 1
        assert abs(lp.token_logprobs[-1] - first.token_logprobs[0][0]) < 1e-6
        chunks = list(client.completions.create(stream=True, **kw))
        streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    finally:
        srv.stop()


def test_an_in_process_generate_on_the_served_engine_leaves_the_server_working():
    """generate() on the engine a server schedules, while the server is idle, takes the engine's rows for its call;
    the server's next request takes them back (its kept rows forgotten) and gets the same text."""
    engine = _engine(1)
    srv = ServerThread(create_app(Scheduler(engine), ServeConfig(model_name="tiny", max_waiting=4,
                                                                  chat_format="plain")))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0)
        first = client.completions.create(**kw).choices[0].text
        tok = engine.get_tokenizer()
        assert generate(engine, [tok.encode(PROMPTS[0])], max_new_tokens=N).texts[0] == first
        assert client.completions.create(**kw).choices[0].text == first
    finally:
        srv.stop()


def test_the_context_holds_prompt_and_completion(served, client):
    """--max-seq-len (256 here) holds prompt and completion: a prompt of 256 tokens leaves no room for one
    generated token, a 400 with or without max_tokens (naming the numbers); 255 get one token. The 400s name the
    field at fault: prompt / messages, and max_tokens / max_completion_tokens for a completion past the context."""
    srv, _, tok = served
    full = [tok.bos_id] + [5] * 255
    for kw in ({}, {"max_tokens": 1}):
        with pytest.raises(openai.BadRequestError, match="prompt: 256 tokens, and the context holds 256 in all "
                                                         r"\(prompt and completion\): at most 255") as e:
            client.completions.create(model="tiny", prompt=full, temperature=0, **kw)
        assert e.value.body["param"] == "prompt"
    for kw in ({}, {"max_tokens": 1}):
        r = client.completions.create(model="tiny", prompt=full[:255], temperature=0, **kw)
        assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    m = next(m for m in range(240, 260) if httpx.post(srv.url + "/tokenize", json={"messages": [
        {"role": "user", "content": " a" * m}]}).json()["count"] == 256)
    msgs = [{"role": "user", "content": " a" * m}]
    with pytest.raises(openai.BadRequestError, match="messages: 256 tokens") as e:
        client.chat.completions.create(model="tiny", messages=msgs)
    assert e.value.body["param"] == "messages"
    short = [{"role": "user", "content": " a" * (m - 10)}]
    with pytest.raises(openai.BadRequestError, match="the context is 256 tokens") as e:
        client.chat.completions.create(model="tiny", messages=short, max_completion_tokens=20)
    assert e.value.body["param"] == "max_completion_tokens"


@pytest.mark.parametrize("messages,match", [
    ([{"role": "wizard", "content": "x"}], "role: must be system, developer, user"),
    ([{"content": "x"}], "role: must be"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "the last message must be"),
    ([{"role": "user", "content": "x"}, {"role": "developer", "content": "y"}], "the last message must be"),
    ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
])
def test_plain_chat_checks_messages_as_v4_does(client, messages, match):
    """The plain format refuses what the V4 format refuses (roles, order, content), though it writes no roles."""
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert e.value.body["param"] == "messages"


def test_plain_chat_developer_and_special_stop(served, client):
    """developer is OpenAI's system prompt: in the plain format, text as a system message's; a stop string holding
    the tokenizer's special `<eos>` (left out of the text stops are matched against) is a 400 naming stop."""
    url = served[0].url
    ids = [httpx.post(url + "/tokenize", json={"messages": [{"role": role, "content": "Be brief."},
                                                            {"role": "user", "content": "x"}]}).json()["tokens"]
           for role in ("developer", "system")]
    assert ids[0] == ids[1]
    with pytest.raises(openai.BadRequestError, match="could never match") as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stop=["a<eos>"])
    assert e.value.body["param"] == "stop"
    # alone, the EOS text (lm-evaluation-harness adds it to every request's stops) is a stop id: no change
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0)
    assert client.completions.create(**kw, stop=["<eos>"]).choices[0].text == client.completions.create(**kw).choices[0].text


def test_n_samples_share_one_prefill_over_http():
    """n = 2 over HTTP: the prompt is marked before its last token, the second sample waits for the first's
    snapshot and continues from a copy (/metrics counts it), and each choice's text is that of its seed alone
    (fp32: the chunking differs from a cold run's)."""
    engine = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", dtype=torch.float32, max_batch_size=4,
                                    max_seq_len=256, quant="none", progress=False)
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
    srv = ServerThread(create_app(Scheduler(engine, max_prefill_tokens=16, snapshot_min_tokens=8),
                                  ServeConfig(model_name="tiny", max_waiting=8)))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt=prompt, max_tokens=N, temperature=0.9, extra_body={"ignore_eos": True})
        both = c.completions.create(n=2, seed=7, **kw)
        assert _metric(srv.url, "dsv4:prefix_snapshots") == 1 and _metric(srv.url, "dsv4:prefix_snapshot_hits") == 1
    finally:
        srv.stop()
    cold = ServerThread(create_app(Scheduler(engine, max_prefill_tokens=16, reuse=False),
                                   ServeConfig(model_name="tiny", max_waiting=8)))
    try:
        c = openai.OpenAI(base_url=cold.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        apart = [c.completions.create(seed=s, **kw).choices[0].text for s in (7, 8)]
    finally:
        cold.stop()
    assert [ch.text for ch in both.choices] == apart and apart[0] != apart[1]

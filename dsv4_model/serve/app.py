"""The FastAPI app: OpenAI routes on a scheduler running on its own thread (bridge.SchedulerThread).

Request path: the body is checked (pydantic + protocol checks: 400 naming the field), the prompt tokenized (chat:
chat_format), one scheduler Request per choice submitted (429 past max_waiting), then tokens come back as events
on an asyncio.Queue and go out as SSE chunks (fastapi.sse framing) or one JSON body. A client that goes away
cancels its requests: streaming through the generator's close, non-streaming through a disconnect watch."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.sse import format_sse_event
from pydantic import ValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from dsv4_model.runtime.requests import Request
from dsv4_model.runtime.scheduler import Scheduler
from dsv4_model.serve.bridge import Event, SchedulerThread, Stream
from dsv4_model.serve.chat_format import ChatFormat, dropped_specials, skipped_specials
from dsv4_model.serve.logprobs import Entries, TokenBytes, chat_logprobs, completion_logprobs, prompt_logprobs
from dsv4_model.serve.metrics import Metrics
from dsv4_model.serve.output_parser import Delta, OutputParser, WholeCalls
from dsv4_model.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                      check_text, finish_reason)

log = logging.getLogger("dsv4.serve")


@dataclass(frozen=True)
class ServeConfig:
    """model_name: the id /v1/models lists and requests may name. max_waiting: queued requests before 429.
    drain_timeout_s: on shutdown, how long running requests may finish before they are cancelled."""

    model_name: str = "dsv4"
    max_waiting: int = 256
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    chat_format: str = "auto"
    version: str = "0"


class _State:
    def __init__(self, scheduler: Scheduler, cfg: ServeConfig):
        self.cfg = cfg
        self.scheduler = scheduler
        self.tokenizer = scheduler.tokenizer
        self.max_seq_len = scheduler.max_seq_len
        self.vocab_size = scheduler.vocab_size
        self.chat = ChatFormat(cfg.chat_format, self.tokenizer)
        self.specials = skipped_specials(self.tokenizer) if self.chat.name == "deepseek_v4" else {}
        self.dropped = dropped_specials(self.tokenizer)  # texts a stop string can never match
        self.token_bytes = TokenBytes(self.tokenizer)
        self.thread = SchedulerThread(scheduler, cfg.max_waiting)
        self.metrics = Metrics(self.thread.counts, scheduler.stats, getattr(scheduler, "speculation", None))
        self.thread._on_finish = self.metrics.on_finish
        self.created = int(time.time())


def create_app(scheduler: Scheduler, cfg: ServeConfig = ServeConfig()) -> FastAPI:
    st = _State(scheduler, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        st.thread.start()
        yield
        n = await asyncio.to_thread(st.thread.drain, cfg.drain_timeout_s)
        log.info("scheduler stopped (%d request(s) cancelled at shutdown)", n)

    app = FastAPI(title="dsv4", lifespan=lifespan)
    app.state.serve = st

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        st.metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return await _api_error(request, APIError(400, f"invalid JSON body: {err.get('msg')}"))
        return await _api_error(request, _invalid_field(err))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):  # no such route (404) or method (405)
        return await _api_error(request, APIError(e.status_code, str(e.detail), kind="not_found_error"
                                                  if e.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):  # a bug: still an OpenAI body, and the traceback in the log
        log.exception("internal error on %s", request.url.path)
        st.metrics.rejected.labels("500").inc()
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", kind="internal_error").body(),
                            status_code=500)

    def key_refused(got: bytes) -> Response | None:
        """got: the Authorization header's value (b"": none, or several). The scheme is case-insensitive (RFC 9110);
        a 401 names it in WWW-Authenticate (RFC 6750)."""
        scheme, _, key = got.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(key.strip(), cfg.api_key.encode()):
            return None
        st.metrics.rejected.labels("401").inc()
        e = APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", kind="authentication_error")
        return JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})

    if cfg.api_key is not None:
        app.add_middleware(_KeyCheck, refused=key_refused)

    def check_model(name: str | None) -> None:
        if name is not None and name != cfg.model_name:
            raise APIError(404, f"model {name!r} is not served here (only {cfg.model_name!r})", "model",
                           kind="not_found_error")

    @app.get("/health")
    async def health():
        if st.thread.draining or not st.thread.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": cfg.version}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": st.created, "owned_by": "dsv4",
                "max_model_len": st.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # a Hugging Face name holds a slash
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """The ids a request would prefill, as vLLM's /tokenize gives them (count, max_model_len, tokens)."""
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            try:
                chat = ChatRequest.model_validate(body.model_dump(exclude={"prompt", "add_special_tokens"}))
            except ValidationError as e:
                raise _invalid_field(e.errors()[0]) from None
            chat.check_unsupported()
            ids = st.chat.prompt(chat).ids
        else:
            check_text(body.prompt, "prompt")
            ids = st.tokenizer.encode(body.prompt, add_bos=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": st.max_seq_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        bad = [(j, t) for j, t in enumerate(body.tokens) if not 0 <= t < st.vocab_size]
        if bad:
            raise APIError(400, f"tokens: id {bad[0][1]} at position {bad[0][0]} outside [0, {st.vocab_size})",
                           "tokens")
        return {"prompt": st.tokenizer.decode(body.tokens)}

    def request_id(request: HTTPRequest, prefix: str) -> str:
        given = request.headers.get("x-request-id", "")
        return given if given.isprintable() and 0 < len(given) <= 128 else f"{prefix}-{secrets.token_hex(12)}"

    def check_prompt(ids: list[int], where: str, param: str, max_tokens: int | None = None,
                     limit: str = "max_tokens") -> int:
        """The tokens the completion may have: what the context leaves (`--max-seq-len` holds prompt and completion,
        as vLLM's max_model_len; the engine could sample one more, never written to its caches, and does not).
        max_tokens: the request's own, from field `limit` (None: not given, the default fits what is left; 0: a
        scored prompt, nothing generated). As vLLM and SGLang, a prompt + max_tokens past the context is a 400
        rather than a completion cut short; so is a prompt that leaves no room for one token."""
        if not ids:
            raise APIError(400, f"{where}: empty", param)
        room = st.max_seq_len - len(ids)
        if room < (0 if max_tokens == 0 else 1):
            raise APIError(400, f"{where}: {len(ids)} tokens, and the context holds {st.max_seq_len} in all (prompt "
                                f"and completion): at most {st.max_seq_len - 1} leave room for a completion", param)
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"the context is {st.max_seq_len} tokens and this request asks for "
                                f"{len(ids) + max_tokens} ({len(ids)} in {where}, {max_tokens} in the completion): "
                                f"shorten the {param} or {limit}", limit)
        return room

    def split_stops(stops: list[str] | None) -> tuple[tuple[str, ...], frozenset[int]]:
        """The stop strings, and the ids of the special tokens given as stop strings. Decoding leaves special
        tokens out of the text stop strings are matched against, so one given whole (lm-evaluation-harness adds
        the EOS text to every request's stops; "</think>") ends the completion as a stop id, as vLLM and SGLang
        honour it; special text inside a longer stop string could never match: a 400."""
        strings, ids = [], set()
        for s in stops or ():
            if s in st.dropped:
                ids.add(st.dropped[s])
                continue
            bad = next((t for t in st.dropped if t in s), None)
            if bad is not None:
                raise APIError(400, f"stop: {s!r} holds {bad!r}, a special token's text, inside a longer string: "
                                    "decoding leaves special tokens out of the text stop strings are matched "
                                    "against, so it could never match (give the token alone)", "stop")
            strings.append(s)
        return tuple(strings), frozenset(ids)

    def submit(ids_per_prompt: list[list[int]], body, max_tokens: list[int], stream: Stream, stops,
               prompt_logprobs: int | None = None, prompt_param: str = "prompt", snapshot_at: tuple = ()) -> None:
        """max_tokens: per prompt. stops: split_stops'. prompt_param: the field that holds the prompt (a 400 about
        it names it). snapshot_at: prefix positions worth a snapshot (Request.snapshot_at; one prompt). With n > 1 the
        position before a prompt's last token is one too: its samples continue from one prefill of the rest."""
        if len(ids_per_prompt) * body.n > cfg.max_waiting:  # could never be queued: a retry would get the same
            raise APIError(400, f"this request asks for {len(ids_per_prompt) * body.n} completions (prompts x n), "
                                f"more than the server queues at once (--max-waiting {cfg.max_waiting})",
                           "n" if body.n > 1 else prompt_param)
        reqs = []
        for p, ids in enumerate(ids_per_prompt):
            marks = tuple(sorted({*snapshot_at, len(ids) - 1})) if body.n > 1 and len(ids) > 1 else snapshot_at
            for k in range(body.n):
                r = Request(ids, params=body.sampling(k), max_tokens=max_tokens[p], stop=stops[0], stop_ids=stops[1],
                            ignore_eos=body.ignore_eos, logprobs=body.logprob_k(), prompt_logprobs=prompt_logprobs,
                            snapshot_at=marks)
                reqs.append(stream.bind(r, p * body.n + k, prompt=p))
        try:
            st.thread.submit_all(reqs, frozenset(j for j in range(len(reqs)) if j % body.n))
        except APIError as e:  # the scheduler's refusal of a prompt
            e.param = prompt_param if e.param == "prompt" else e.param
            raise

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        body.check_unsupported()
        check_model(body.model)
        stops = split_stops(body.stop)
        rid = request_id(request, "cmpl")
        ids, prompt_texts, rooms = [], [], []
        flat = isinstance(body.prompt, list) and bool(body.prompt) and isinstance(body.prompt[0], int)
        for i, p in enumerate(body.prompts()):
            where = "prompt" if flat else f"prompt[{i}]"
            if isinstance(p, str):
                prompt_texts.append(p)
                p = st.tokenizer.encode(p)
            elif not isinstance(p, list) or not all(isinstance(t, int) for t in p):
                raise APIError(400, f"prompt[{i}]: must be a string or a list of token ids", "prompt")
            else:
                bad = [(j, t) for j, t in enumerate(p) if not 0 <= t < st.vocab_size]
                if bad:  # before any decode: a tokenizer may raise on such an id
                    raise APIError(400, f"{where}: token id {bad[0][1]} at position {bad[0][0]} outside "
                                        f"[0, {st.vocab_size})", "prompt")
                prompt_texts.append(st.tokenizer.decode(p) if body.echo else "")
            rooms.append(check_prompt(p, where, "prompt", body.max_tokens))
            ids.append(p)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": cfg.model_name}
        if body.max_tokens == 0 and body.logprob_k() is None:  # echo alone: the prompts back, nothing to run
            choices = [{"index": i, "text": prompt_texts[i // body.n], "logprobs": None, "finish_reason": "length"}
                       for i in range(len(ids) * body.n)]
            p = sum(len(x) for x in ids)
            st.metrics.finished.labels("length").inc(len(choices))  # counted as the scheduler counts its requests
            st.metrics.prompt_tokens.inc(p)  # each prompt once, whatever n (as usage)
            return _answer_now(base, choices, {"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p},
                               body.stream, body.include_usage, rid)
        stream = Stream(asyncio.get_running_loop(), {}, st.thread.sink)
        limits = [min(16, room) if body.max_tokens is None else body.max_tokens for room in rooms]
        submit(ids, body, limits, stream, stops, body.logprob_k() if body.echo else None)
        texts = [""] * len(stream.requests)
        echoed = [not body.echo] * len(stream.requests)
        starts = [len(prompt_texts[i // body.n]) if body.echo else 0 for i in range(len(stream.requests))]
        entries = None if body.logprob_k() is None else [Entries(st.tokenizer, a) for a in starts]
        lps: list[dict | None] = [None] * len(stream.requests)  # the whole response's, piece by piece

        def echo(i: int) -> list[dict]:
            """echo: choice i's prompt (and its tokens' logprobs) before its first token or its end (the prompt's
            scores are read before its first token)."""
            if echoed[i]:
                return []
            echoed[i] = True
            r, text = stream.requests[i], prompt_texts[i // body.n]
            texts[i] += text
            lp = None if r.prompt_logprobs is None else \
                prompt_logprobs(st.tokenizer, r.prompt, r.prompt_token_logprobs, len(text))
            return [{"index": i, "text": text, "logprobs": lp, "finish_reason": None}]

        def released(ev: Event) -> dict | None:
            """The logprob entries out with ev: those of the tokens whose text is returned by now (at the end, a
            stop string's tokens stay out; an EOS / stop id's entry comes last, its text not in the completion)."""
            if entries is None:
                return None
            i, e = ev.choice, entries[ev.choice]
            if ev.logprob is not None:
                e.push(ev.token_id, ev.logprob)
            if not ev.done:
                return _or_none(completion_logprobs(st.tokenizer, *e.take(len(texts[i]))))
            r = stream.requests[i]
            got = e.finish(len(texts[i]), r.stop_string_hit)
            if r.stop_token is not None:
                got = (got[0] + [r.stop_token], got[1] + r.token_logprobs[-1:], got[2] + [len(texts[i])])
            return _or_none(completion_logprobs(st.tokenizer, *got))

        def on_event(ev: Event):
            i = ev.choice
            out = echo(i)
            texts[i] += ev.text
            lp = released(ev)
            if ev.done:
                r = stream.requests[i]
                out.append({"index": i, "text": "", "logprobs": lp, "finish_reason": finish_reason(r.finish_reason)})
            elif ev.text or lp:
                out.append({"index": i, "text": ev.text, "logprobs": lp, "finish_reason": None})
            if not body.stream:  # the whole response's (a stream sends them piece by piece)
                for c in out:
                    lps[i] = _extend_logprobs(lps[i], c["logprobs"])
            return out

        if body.stream:
            return _sse(stream, base, on_event, body.include_usage, rid, [])
        if not await _collect(stream, request, on_event):
            _log_gone(rid, stream)
            return Response(status_code=499)
        empty = None if entries is None else completion_logprobs(st.tokenizer, [], [], [])
        choices = [{"index": i, "text": t, "finish_reason": finish_reason(r.finish_reason), "logprobs": lps[i] or empty}
                   for i, (t, r) in enumerate(zip(texts, stream.requests))]
        _log_done(rid, stream)
        return JSONResponse({**base, "choices": choices, "usage": _usage(stream)}, headers={"X-Request-Id": rid})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: HTTPRequest):
        body.check_unsupported()
        check_model(body.model)
        stops = split_stops(body.stop)
        rid = request_id(request, "chatcmpl")
        prompt = st.chat.prompt(body)
        room = check_prompt(prompt.ids, "messages", "messages", body.token_limit, body.token_limit_field)
        stream = Stream(asyncio.get_running_loop(), st.specials, st.thread.sink)
        submit([prompt.ids], body, [body.token_limit or room], stream, stops, prompt_param="messages",
               snapshot_at=prompt.snapshot_at)
        thinking = prompt.parser is not None and prompt.parser.state == "reasoning"
        # calls come out whole (WholeCalls): one the output cuts off is no call
        parsers = [WholeCalls(OutputParser(thinking, tools=body.tools_on)) if prompt.parser is not None else None
                   for _ in stream.requests]
        one_call = body.parallel_tool_calls is False
        n = len(stream.requests)
        totals = [Delta() for _ in range(n)]
        entries = None if body.logprob_k() is None else [Entries(st.tokenizer) for _ in range(n)]
        lps: list[dict | None] = [None] * n  # the whole response's, piece by piece
        shown = [0] * n  # characters of the completion's text returned (the special tokens' put back not counted)
        cut = [False] * n  # a stop string ended it
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": cfg.model_name}
        call_ids: dict[tuple[int, int], str] = {}

        def delta_json(i: int, d: Delta) -> dict:
            out = {}
            if d.reasoning:
                out["reasoning_content"] = d.reasoning
            if d.content:
                out["content"] = d.content
            if d.tool_calls:
                out["tool_calls"] = [call_json(i, c) for c in d.tool_calls]
            return out

        def call_json(i: int, c) -> dict:
            """A call's first piece opens it (id, type, name), as OpenAI streams; the rest carry arguments."""
            if c.name is None:
                return {"index": c.index, "function": {"arguments": c.arguments}}
            cid = call_ids.setdefault((i, c.index), f"call_{secrets.token_hex(12)}")
            return {"index": c.index, "id": cid, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}}

        def reason_of(i: int) -> str:
            """tool_calls: the model ended its answer (EOS) after whole calls; cut short (max_tokens, the context, a
            stop string), the reason it was cut, whatever calls came before."""
            r = finish_reason(stream.requests[i].finish_reason)
            return "tool_calls" if r == "stop" and not cut[i] and totals[i].tool_calls else r

        def released(ev: Event) -> dict | None:
            """The logprob entries out with ev: those of the tokens whose text is returned by now (at the end, a
            stop string's tokens stay out)."""
            if entries is None:
                return None
            i, e = ev.choice, entries[ev.choice]
            if ev.logprob is not None:
                e.push(ev.token_id, ev.logprob)
            ids, got, _ = e.finish(shown[i], cut[i]) if ev.done else e.take(shown[i])
            return chat_logprobs(st.tokenizer, st.token_bytes, ids, got) if ids else None

        def on_event(ev: Event):
            i, p = ev.choice, parsers[ev.choice]
            shown[i] += len(ev.text) - len(st.specials.get(ev.token_id, ""))
            if ev.done:
                cut[i] = stream.requests[i].stop_string_hit
            d = Delta(content=ev.text) if p is None else (p.finish() if ev.done else p.feed(ev.text))
            if one_call:  # parallel_tool_calls false: the first call only
                d.tool_calls = [c for c in d.tool_calls if c.index == 0]
            totals[i].add(d)
            lp = released(ev)
            if not body.stream:
                lps[i] = _extend_logprobs(lps[i], lp)
            out = [{"index": i, "delta": delta_json(i, d), "logprobs": lp, "finish_reason": None}] if d or lp else []
            if ev.done:
                out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason_of(i)})
            return out

        if body.stream:
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(n)]
            return _sse(stream, base, on_event, body.include_usage, rid, first)
        if not await _collect(stream, request, on_event):
            _log_gone(rid, stream)
            return Response(status_code=499)
        choices = []
        for i, t in enumerate(totals):
            msg = {"role": "assistant", "content": t.content if t.content or not t.tool_calls else None}
            if t.reasoning:
                msg["reasoning_content"] = t.reasoning
            if t.tool_calls:
                msg["tool_calls"] = delta_json(i, Delta(tool_calls=t.tool_calls))["tool_calls"]
            lp = lps[i] or (None if entries is None else {"content": []})
            choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": reason_of(i)})
        _log_done(rid, stream)
        return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": _usage(stream)},
                            headers={"X-Request-Id": rid})

    return app


# What a field of several accepted types takes: pydantic reports a mismatch against one of the types by its name
# ("prompt.str: Input should be a valid string"), which tells a client neither what went wrong nor what else works.
UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids (ints) or a list of such lists",
                "stop": "a string or a list of strings", "tool_choice": "a string or an object"}


def _invalid_field(err: dict) -> APIError:
    """A pydantic error (the first of a body's) as a 400 naming its field."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if len(loc) > 1 and loc[0] in UNION_FIELDS and not loc[1].isdigit():  # loc[1]: the union member's name
        return APIError(400, f"{loc[0]}: must be {UNION_FIELDS[loc[0]]}", loc[0])
    msg = str(err.get("msg")).removeprefix("Value error, ")  # pydantic's wrapper of our validators' messages
    return APIError(400, f"{'.'.join(loc) or 'body'}: {msg}", loc[0] if loc else None)


KEYED_ROOT_PATHS = ("/tokenize", "/detokenize")


class _KeyCheck:
    """--api-key: every /v1/ path (a route or not) and /tokenize, /detokenize answer 401 without the key (one
    Authorization header), before the body is read (a malformed body must not tell a caller without the key
    anything). Plain ASGI: Starlette's BaseHTTPMiddleware would hide a streaming client's disconnect from the
    response (its requests would run on)."""

    def __init__(self, app, refused):
        self.app, self.refused = app, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in KEYED_ROOT_PATHS):
            keys = [v for k, v in scope["headers"] if k == b"authorization"]
            answer = self.refused(keys[0] if len(keys) == 1 else b"")  # two Authorization headers: refused
            if answer is not None:
                return await answer(scope, receive, send)
        await self.app(scope, receive, send)


def _usage(stream: Stream) -> dict:
    p, c = sum(stream.prompt_tokens.values()), sum(len(r.token_ids) for r in stream.requests)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _log_gone(rid: str, stream: Stream) -> None:
    log.info("%s: the client went away; cancelled after %s", rid,
             ", ".join(f"{len(r.token_ids)} tokens" for r in stream.requests))


def _log_done(rid: str, stream: Stream) -> None:
    log.info("%s: %s", rid, ", ".join(f"{len(r.token_ids)} tokens ({r.finish_reason})" for r in stream.requests))


async def _events(stream: Stream):
    left = len(stream.requests)
    while left:
        ev = await stream.queue.get()
        left -= ev.done
        yield ev


async def _collect(stream: Stream, request: HTTPRequest, on_event) -> bool:
    """Consume every event (True); the client going away first cancels the requests (False: nobody to answer,
    499 in the access log)."""
    async def consume():
        async for ev in _events(stream):
            on_event(ev)

    async def disconnected():
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    work, watch = asyncio.create_task(consume()), asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work not in done:
        stream.cancel()
        await work  # every request ends (cancelled) within a step
        return False
    work.result()
    return True


def _merge_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two pieces' logprobs as one (lists concatenated key by key: completions' tokens / token_logprobs /
    top_logprobs / text_offset, chat's content)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a[k] + b[k] for k in a}


def _extend_logprobs(acc: dict | None, piece: dict | None) -> dict | None:
    """acc with piece's lists appended in place (a completion's logprobs grow token by token: no copy per token)."""
    if piece is None:
        return acc
    if acc is None:
        return {k: list(v) for k, v in piece.items()}
    for k, v in piece.items():
        acc[k].extend(v)
    return acc


def _or_none(lp: dict) -> dict | None:
    return lp if lp["tokens"] else None


def _merge(choices: list[dict]) -> list[dict]:
    """The pieces of each choice joined (a chunk carries each choice once, whatever order the steps' events of
    several choices came in): their text (completions) or their deltas' fields (chat: texts and tool-call lists
    concatenated field by field, a call's argument pieces joined); a finishing piece adds its finish_reason."""
    out: list[dict] = []
    at: dict[int, int] = {}  # choice index -> its entry in out
    for c in choices:
        j = at.get(c["index"])
        last = out[j] if j is not None else None
        if last is not None and last["finish_reason"] is None:
            lp = _merge_logprobs(last.get("logprobs"), c.get("logprobs"))
            if "text" in c:
                out[j] = {**last, **c, "text": last["text"] + c["text"], "logprobs": lp}
                continue
            a, b = last["delta"], c["delta"]
            if all(type(a[k]) is type(b[k]) and isinstance(a[k], (str, list)) for k in a.keys() & b.keys()):
                # each field keeps its own order (reasoning, content and tool calls are read field by field)
                joined = {k: _join_calls(a[k], b[k]) if k == "tool_calls" else a[k] + b[k] for k in a.keys() & b.keys()}
                out[j] = {**last, **c, "delta": {**a, **b, **joined}, "logprobs": lp}
                continue
        at[c["index"]] = len(out)
        out.append(c)
    return out


def _join_calls(a: list[dict], b: list[dict]) -> list[dict]:
    """Two chunks' tool-call pieces as one list: a piece continuing the call `a` ends with joins it (one entry
    per call and chunk, its arguments concatenated)."""
    if a and b and a[-1]["index"] == b[0]["index"] and "id" not in b[0]:
        f = a[-1]["function"]
        last = {**a[-1], "function": {**f, "arguments": f["arguments"] + b[0]["function"]["arguments"]}}
        return a[:-1] + [last] + b[1:]
    return a + b


def _sse(stream: Stream, base: dict, on_event, include_usage: bool, rid: str, first: list[dict]):
    def chunk(choices, **extra) -> bytes:
        return format_sse_event(data_str=json.dumps({**base, "choices": choices, **extra}, ensure_ascii=False))

    async def body():
        try:
            if first:
                yield chunk(first)
            left = len(stream.requests)
            while left:
                # every event already queued goes out in one chunk: one JSON + one write per batch, not per token
                evs = [await stream.queue.get()]
                while not stream.queue.empty():
                    evs.append(stream.queue.get_nowait())
                left -= sum(ev.done for ev in evs)
                choices = _merge([c for ev in evs for c in on_event(ev)])
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage=_usage(stream))
            yield format_sse_event(data_str="[DONE]")
            _log_done(rid, stream)
        finally:
            if not all(r.done for r in stream.requests):
                _log_gone(rid, stream)
            stream.cancel()  # the client went away (or nothing: every request has ended)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"X-Request-Id": rid})


def _answer_now(base: dict, choices: list[dict], usage: dict, stream: bool, include_usage: bool, rid: str):
    """A reply that needs no model step (echo with max_tokens 0): one JSON body, or one SSE chunk and [DONE]."""
    headers = {"X-Request-Id": rid}
    if not stream:
        return JSONResponse({**base, "choices": choices, "usage": usage}, headers=headers)

    async def body():
        yield format_sse_event(data_str=json.dumps({**base, "choices": choices}, ensure_ascii=False))
        if include_usage:
            yield format_sse_event(data_str=json.dumps({**base, "choices": [], "usage": usage}, ensure_ascii=False))
        yield format_sse_event(data_str="[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

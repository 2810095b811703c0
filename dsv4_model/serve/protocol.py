"""OpenAI request bodies (/v1/completions, /v1/chat/completions) as pydantic models, their checks, and the error
body. A field the server cannot honour is a 400 naming it, never ignored silently and never a 500; fields this
server does not know are ignored (clients send many)."""
from __future__ import annotations

import json
import secrets
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from dsv4_model.runtime.sampling import INT64_MAX, SEED_MAX, SEED_MIN, SamplingParams

MAX_N = 16
MAX_STOPS = 16
MAX_LOGPROBS = 20


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers  # of the response (429: Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        """null for a field that has a default means the default: OpenAI types these "number or null" and client
        libraries send unset fields as null (a required field's null stays, and is refused)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX)  # 0 or -1: off (vLLM's spelling is -1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False  # (strict: "yes" or 1 is a 400, not true)
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Known to clients (OpenAI's logit_bias; vLLM's sampling and guided-decoding extras) and not done by this
    # sampler: a request that sets one to anything but its neutral value is refused rather than answered without it.
    logit_bias: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    truncate_prompt_tokens: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("an empty string stops nothing")
        return stops

    def check_unsupported(self) -> None:
        self.logprob_k()  # its 400s
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM: options of a stream
            raise APIError(400, "stream_options: only with stream: true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (only 0)", name)
        for name, neutral in self.REFUSED.items():
            v = getattr(self, name)
            if v is not None and not any(v == n and type(v) is type(n) for n in neutral):
                allowed = " or ".join(json.dumps(n) for n in neutral) or "unset"
                raise APIError(400, f"{name} is not supported by this server (only {allowed})", name)

    # The refused fields and the values that change nothing (none: only unset).
    REFUSED: ClassVar[dict[str, tuple]] = {
        "logit_bias": ({},), "repetition_penalty": (1, 1.0), "min_p": (0, 0.0), "min_tokens": (0,),
        "allowed_token_ids": (), "bad_words": ([],), "guided_json": (), "guided_regex": (), "guided_choice": (),
        "guided_grammar": (), "structured_outputs": (), "stop_token_ids": ([],), "include_stop_str_in_output": (False,),
        "skip_special_tokens": (True,), "truncate_prompt_tokens": ()}

    def sampling(self, choice: int) -> SamplingParams:
        """Choice i's parameters: a seeded request's choices draw from seed + i; unseeded ones from a fresh key."""
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        seed = (seed + choice - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        return SamplingParams(temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p, seed=seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # (strict: true is not token id 1)
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt back (with logprobs: scored)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    def logprob_k(self) -> int | None:
        """logprobs: an int k (0..20): each token's log-probability and the k most likely; None / false: off."""
        k = self.logprobs
        if k is None or k is False:
            return None
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs: an int in [0, {MAX_LOGPROBS}], got {k!r}", "logprobs")
        return k

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 only with echo (the prompt back; with logprobs: scored)", "max_tokens")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of must equal n", "best_of")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format: only {'type': 'text'} is supported", "response_format")
        check_text(self.prompt, "prompt")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt: empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(extra="ignore")

    thinking: StrictBool | None = None
    enable_thinking: StrictBool | None = None
    drop_thinking: StrictBool | None = None  # the encoder's drop_thinking (earlier turns' reasoning left out)


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer (the first the model writes)
    # OpenAI's deprecated spellings of tools / tool_choice: refused (ignored, the model would answer without them)
    functions: Any = None
    function_call: Any = None
    # vLLM's chat-template switches: the V4 encoder is fixed
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    REFUSED: ClassVar[dict[str, tuple]] = {**_Sampling.REFUSED, "add_generation_prompt": (True,),
                                           "continue_final_message": (False,), "chat_template": ()}

    def logprob_k(self) -> int | None:
        """logprobs: true gives each token's log-probability, top_logprobs (0..20) the most likely alternatives."""
        if self.logprobs not in (None, True, False):
            raise APIError(400, f"logprobs: true or false, got {self.logprobs!r}", "logprobs")
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs: an int in [0, {MAX_LOGPROBS}], got {top!r}", "top_logprobs")
        if not self.logprobs:
            if top:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return top or 0

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, old) is not None:
                raise APIError(400, f"{old} is OpenAI's deprecated form of {new} and is not supported: use {new}", old)
        if self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice: only 'auto' and 'none' are supported", "tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format: only {'type': 'text'} is supported", "response_format")
        check_text(self.messages, "messages")
        check_text(self.tools, "tools")

    @property
    def thinking(self) -> bool | None:
        k = self.chat_template_kwargs
        if k is None:
            return None
        return k.thinking if k.thinking is not None else k.enable_thinking

    @property
    def drop_thinking(self) -> bool | None:
        return None if self.chat_template_kwargs is None else self.chat_template_kwargs.drop_thinking

    @property
    def tools_on(self) -> bool:
        """Whether the output is read for tool calls: tools given and tool_choice not 'none' (else DSML the
        model writes stays text, as OpenAI promises no calls then)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def token_limit_field(self) -> str:
        """The field token_limit comes from (the one a 400 about it names)."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's route): `prompt` (text; BOS first unless add_special_tokens is false) or `messages`
    (with the chat fields of /v1/chat/completions: the ids a chat request would prefill)."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]


def check_text(value: Any, where: str) -> None:
    """A 400 naming the string (its path in `where`) that holds a lone UTF-16 surrogate: JSON's "\\ud800" parses
    to a str that is not Unicode text, which the tokenizer (and any UTF-8 encoder) refuses."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{where}: a lone UTF-16 surrogate ({value[e.start]!r} at character {e.start}) is "
                                "not text: send valid Unicode", where.split(".")[0].split("[")[0]) from None
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_text(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where)
            check_text(v, f"{where}.{k}")


def finish_reason(reason: str | None) -> str:
    """The scheduler's reasons in OpenAI's words ("abort": cancelled by a shutdown)."""
    return {"stop": "stop", "length": "length", "max_seq_len": "length"}.get(reason or "", "abort")


"""Which chat format a served model gets, and what the tokenizer must provide for it.

"deepseek_v4": chat_encoding's prompt + output_parser (needs V4's special tokens in the tokenizer).
"plain": for models without them (the built-in code model): BOS, then each message's text followed by a newline,
roles unmarked; the completion is all content (no reasoning, no tool calls; `tools` refused).
"auto": deepseek_v4 when the tokenizer has V4's tokens, else chat requests are refused with a 400 that says so."""
from __future__ import annotations

from dataclasses import dataclass

from dsv4_model.serve.chat_encoding import (ASSISTANT, BOS, DSML, THINK, THINK_END, USER, ChatError, _fold, _text,
                                            encode_chat, resolve_options)
from dsv4_model.serve.output_parser import OutputParser
from dsv4_model.serve.protocol import APIError, ChatRequest

FORMATS = ("auto", "deepseek_v4", "plain")


def token_id(tokenizer, text: str) -> int | None:
    """The id of a whole-token `text` in a tokenizer.json tokenizer (None: not one token / no such tokenizer)."""
    tok = getattr(tokenizer, "_tok", None)  # HFTokenizer's tokenizers.Tokenizer
    return None if tok is None else tok.token_to_id(text)


def has_v4_tokens(tokenizer) -> bool:
    return all(token_id(tokenizer, t) is not None for t in (BOS, USER, ASSISTANT, THINK, THINK_END))


def skipped_specials(tokenizer) -> dict[int, str]:
    """Ids of `<think>`, `</think>`, `｜DSML｜` that decoding drops (special tokens): their text is put back into the
    stream, because the output parser reads them."""
    out = {}
    for text in (THINK, THINK_END, DSML):
        i = token_id(tokenizer, text)
        if i is not None and tokenizer.decode([i]) == "":
            out[i] = text
    return out


def dropped_specials(tokenizer) -> dict[str, int]:
    """{text: id} of the tokens that decoding drops (special tokens): the text stop strings are matched against
    never holds them."""
    tok = getattr(tokenizer, "_tok", None)
    if tok is None:
        return {}
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items()
            if t.content and tokenizer.decode([i]) == ""}


def api_messages(messages) -> list:
    """OpenAI's messages as the encoder reads them. `developer` is OpenAI's name for the system prompt (the
    instructions the model follows; the SDK and agent frameworks send it in place of `system`): it becomes `system`.
    The encoder's own `developer` role is a user turn that thinking mode drops before the last user turn, so the
    instructions would vanish. The conversation must end on the user or a tool (the generation header's place)."""
    if not isinstance(messages, list):
        return messages
    out = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") in ("system", "developer", "assistant", "latest_reminder"):
        raise ChatError(f"messages: the last message must be from the user or a tool, got {last['role']!r}",
                        "messages")
    return out


@dataclass
class ChatPrompt:
    ids: list[int]
    parser: OutputParser | None  # None: plain text, all content
    snapshot_at: tuple[int, ...] = ()  # prefixes later prompts are likely to share (Request.snapshot_at)


class ChatFormat:
    def __init__(self, name: str, tokenizer):
        if name not in FORMATS:
            raise ValueError(f"chat format must be one of {FORMATS}, got {name!r}")
        self.tokenizer = tokenizer
        v4 = has_v4_tokens(tokenizer)
        if name == "deepseek_v4" and not v4:
            raise ValueError("--chat-format deepseek_v4: the tokenizer has no DeepSeek-V4 chat tokens "
                             f"({USER}, {ASSISTANT}, {THINK}, ...)")
        self.name = ("deepseek_v4" if v4 else "none") if name == "auto" else name
        self._think, self._user = token_id(tokenizer, THINK), token_id(tokenizer, USER)

    def prompt(self, req: ChatRequest) -> ChatPrompt:
        if self.name == "none":
            raise APIError(400, "this model's tokenizer has no DeepSeek-V4 chat tokens, so it has no chat format: "
                           "use /v1/completions, or start the server with --chat-format plain", "messages")
        try:
            messages = api_messages(req.messages)
            if self.name == "plain":
                return ChatPrompt(self._plain(req, messages), None)
            opts = resolve_options(req.thinking, req.reasoning_effort, drop_thinking=req.drop_thinking)
            tools = None if req.tool_choice == "none" else req.tools
            text = encode_chat(messages, tools, opts)
        except ChatError as e:
            raise APIError(400, str(e), e.param) from None
        ids = self.tokenizer.encode(text, add_bos=False)
        return ChatPrompt(ids, OutputParser(opts.thinking), self._shared_prefixes(ids, opts, bool(tools)))

    def _shared_prefixes(self, ids: list[int], opts, tools: bool) -> tuple[int, ...]:
        """Where later prompts will likely repeat this one: the system part's end (BOS, the effort text, system
        messages and tools: other conversations with the same system prompt), and in thinking mode with earlier
        reasoning dropped, the position before the final `<think>` (the next turn rewrites that header as
        `</think>`, so it extends this prompt but not what the row holds after it). The system part ends at the
        first `<｜User｜>`, a special token: the tokenizer splits the text there, so no re-tokenizing is needed."""
        out = []
        if self._user in ids and ids.index(self._user) > 0:  # (a mark must lie inside the prompt)
            out.append(ids.index(self._user))
        if opts.thinking and opts.drop_thinking and not tools and len(ids) > 1 and ids[-1] == self._think:
            out.append(len(ids) - 1)
        return tuple(sorted(set(out)))

    def _plain(self, req: ChatRequest, messages: list) -> list[int]:
        if req.tools:
            raise ChatError("tools need --chat-format deepseek_v4 (this model has no tool format)", "tools")
        # no thinking mode here: the switches are checked as the V4 format checks them, then have nothing to turn
        resolve_options(req.thinking, req.reasoning_effort, drop_thinking=req.drop_thinking)
        _fold(messages)  # the messages checked as the V4 format checks them (roles, content, order)
        # text parts joined as vLLM joins them
        text = "".join(_text(m.get("content"), f"messages[{i}]", sep="\n") + "\n" for i, m in enumerate(messages))
        return self.tokenizer.encode(text, add_bos=True)

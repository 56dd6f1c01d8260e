"""OpenAI response bodies and SSE chunks, built as plain dicts (cheap enough for every token).

Chat streams follow OpenAI's chunk sequence: a first chunk with `{"role": "assistant",
"content": ""}`, content (or `tool_calls`) chunks, a chunk with an empty delta and the
`finish_reason`, then (with
`stream_options.include_usage`) a chunk with no choices and the usage; every other chunk then
carries `"usage": null`. Completion streams have the same shape with `text` instead of `delta`.
With `n` choices, each chunk carries one choice, its `index` telling which, and every choice
has its own first and last chunks; the usage counts the prompt once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache

from engine.sequence import TokenLogprobs
from engine.tokenizer import Tokenizer
from wire.errors import error_body
from wire.resume import PROMPT_TOKEN_IDS, TOKEN_IDS

JSON = dict[str, object]
DONE = b"data: [DONE]\n\n"


def sse(payload: JSON) -> bytes:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE spells each byte with a printable character; this maps them back."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TokenTexts:
    """Each token's text and UTF-8 bytes, as logprobs report them (cached per token id)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._lookup(token_id)
            self._cache[token_id] = hit
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        spelled = self._tokenizer.id_to_token(token_id) or ""
        decoder = _byte_decoder()
        if spelled and all(ch in decoder for ch in spelled):
            data = bytes(decoder[ch] for ch in spelled)
            return data.decode("utf-8", errors="replace"), list(data)
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode())


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_json(self) -> JSON:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprobs], num_top: int) -> JSON:
    content = []
    for lp in logprobs:
        token, data = texts.get(lp.token_id)
        top = []
        for token_id, value in lp.top[:num_top]:
            top_token, top_data = texts.get(token_id)
            top.append({"token": top_token, "logprob": value, "bytes": top_data})
        content.append({"token": token, "logprob": lp.logprob, "bytes": data, "top_logprobs": top})
    return {"content": content}


@dataclass(slots=True)
class CompletionLogprobs:
    """Legacy completions logprobs; `text_offset` counts characters of the generated text."""

    texts: TokenTexts
    num_top: int
    offset: int = 0

    def next(self, logprobs: list[TokenLogprobs]) -> JSON:
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for lp in logprobs:
            token, _ = self.texts.get(lp.token_id)
            tokens.append(token)
            values.append(lp.logprob)
            top = {self.texts.get(t)[0]: v for t, v in lp.top[: self.num_top]}
            tops.append(top or {token: lp.logprob})
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


@dataclass(frozen=True, slots=True)
class ResponseKind:
    """One endpoint's responses: their id prefix and `object` names, whole and streamed."""

    id_prefix: str
    body_object: str
    chunk_object: str


CHAT = ResponseKind("chatcmpl", "chat.completion", "chat.completion.chunk")
COMPLETION = ResponseKind("cmpl", "text_completion", "text_completion")


@dataclass(slots=True)
class ResponseHeader:
    """What every body and chunk of one response repeats.

    A choice's own fields (`content`) are `{"message": ...}` (chat) or `{"text": ...}`
    (completions) in a whole body, `{"delta": ...}` or `{"text": ...}` in a chunk."""

    response_id: str
    created: int
    model: str
    kind: ResponseKind
    include_usage: bool = False
    return_token_ids: bool = False  # each choice carries its output's ids (wire/resume.py)
    # With ids asked for: what the engine prefills (the prompt, then any resumed output), sent
    # in the first chunk (wire/resume.py) and in a whole body.
    prompt_token_ids: list[int] | None = None
    _chunk_base: JSON = field(init=False)
    _has_sent_prompt_ids: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._chunk_base = {
            "id": self.response_id,
            "created": self.created,
            "model": self.model,
            "object": self.kind.chunk_object,
        }

    def choice(
        self,
        index: int,
        content: JSON,
        finish_reason: str | None,
        logprobs: JSON | None,
        token_ids: list[int],
    ) -> JSON:
        """One choice of a whole body; its `finish_reason` and ids come last, as in OpenAI's."""
        choice: JSON = {"index": index, **content, "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        self._add_token_ids(choice, token_ids)
        return choice

    def body(self, choices: list[JSON], usage: Usage) -> JSON:
        """A whole (not streamed) response."""
        return {
            "id": self.response_id,
            "object": self.kind.body_object,
            "created": self.created,
            "model": self.model,
            **self._prompt_ids(),
            "choices": choices,
            "usage": usage.to_json(),
        }

    def chunk(
        self,
        content: JSON,
        finish_reason: str | None = None,
        logprobs: JSON | None = None,
        token_ids: list[int] | None = None,
        index: int = 0,
    ) -> bytes:
        choice: JSON = {"index": index, **content, "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        if token_ids is not None:
            self._add_token_ids(choice, token_ids)
        payload: JSON = {**self._chunk_base}
        if not self._has_sent_prompt_ids:
            self._has_sent_prompt_ids = True
            payload |= self._prompt_ids()
        payload["choices"] = [choice]
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse({**self._chunk_base, "choices": [], "usage": usage.to_json()})

    def _add_token_ids(self, choice: JSON, token_ids: list[int]) -> None:
        if self.return_token_ids:
            choice[TOKEN_IDS] = token_ids

    def _prompt_ids(self) -> JSON:
        if not self.return_token_ids or self.prompt_token_ids is None:
            return {}
        return {PROMPT_TOKEN_IDS: self.prompt_token_ids}


def error_event(status: int, message: str, code: str | None) -> bytes:
    """An error after a stream has started: one event in OpenAI's error shape."""
    return sse(error_body(status, message, code))

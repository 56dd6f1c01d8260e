"""What the gateway needs from an OpenAI request body, checked before anything goes upstream.

The gateway is a passthrough: it checks only what it relies on (the JSON shape, `model`,
`messages`/`prompt`, `max_tokens`, `stream`, `stream_options`) and leaves the rest for the node
to judge. Hand-written checks rather than pydantic: this runs on every request and must stay
cheap. A malformed body is a 400 here, so it never costs an upstream round trip.

Prompt tokens are estimated from characters (about 4 per token for English with BPE tokenizers,
plus a few per message for the chat template); the estimate only sizes the reservation, and the
usage the node reports settles it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from gateway.errors import InvalidRequestError

Endpoint = Literal["chat", "completions"]
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
MAX_INT_FIELD = 2**31
# OpenAI's default `max_tokens` for /v1/completions (chat has none: the gateway caps it).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str
    is_stream: bool
    wants_usage: bool  # the client asked for the usage chunk itself
    prompt_tokens: int  # estimated
    max_tokens: int  # the client's, or the gateway's default cap
    affinity_key: str | None  # hash of the system prompt, for prefix-cache affinity
    upstream_body: bytes  # what goes to the node (usage requested, max_tokens capped)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


def _invalid(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, "invalid_request", param=param)


def _int_field(body: dict[str, object], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < MAX_INT_FIELD:
        raise _invalid(f"{name} must be a positive integer", name)
    return value


def _message_chars(messages: object) -> tuple[int, str | None]:
    """Characters of all message contents, and the system prompt (first system message)."""
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty array", "messages")
    num_chars = 0
    system: str | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _invalid(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            text = "".join(t for t in parts if isinstance(t, str))
        elif content is None:
            text = ""
        else:
            raise _invalid(f"messages[{i}].content must be a string or an array", "messages")
        num_chars += len(text) + TOKENS_PER_MESSAGE * CHARS_PER_TOKEN
        if system is None and message["role"] in ("system", "developer"):
            system = text
    return num_chars, system


def _prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN + 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return sum(_prompt_tokens(p) for p in prompt)
    raise _invalid("prompt must be a string, an array of strings or of token ids", "prompt")


def _load(raw: bytes) -> dict[str, object]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError("request body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise _invalid("request body must be a JSON object")
    return body


def parse_request(raw: bytes, endpoint: Endpoint, default_max_tokens: int) -> ParsedRequest:
    body = _load(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model must be a non-empty string", "model")
    is_stream = body.get("stream", False)
    if not isinstance(is_stream, bool):
        raise _invalid("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not is_stream):
        raise _invalid("stream_options must be an object, and only with stream", "stream_options")
    wants_usage = bool(options and options.get("include_usage") is True)

    affinity_key: str | None = None
    if endpoint == "chat":
        num_chars, system = _message_chars(body.get("messages"))
        prompt_tokens = num_chars // CHARS_PER_TOKEN + 1
        if system:
            affinity_key = hashlib.blake2b(system.encode(), digest_size=8).hexdigest()
        given = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens")
    else:
        prompt_tokens = _prompt_tokens(body.get("prompt"))
        given = _int_field(body, "max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS

    is_changed = False
    if given is None:
        body["max_tokens"] = default_max_tokens
        is_changed = True
    if is_stream and not wants_usage:
        body["stream_options"] = {**(options or {}), "include_usage": True}
        is_changed = True
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        is_stream=is_stream,
        wants_usage=wants_usage,
        prompt_tokens=prompt_tokens,
        max_tokens=given or default_max_tokens,
        affinity_key=affinity_key,
        upstream_body=json.dumps(body).encode() if is_changed else raw,
    )

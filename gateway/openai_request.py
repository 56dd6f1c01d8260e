"""What the gateway needs from an OpenAI request body, checked before anything goes upstream.

The gateway is a passthrough: it checks only what it relies on (the JSON shape, `model`,
`messages`/`prompt`, `max_tokens`, `stream`, `stream_options`) and leaves the rest for the node
to judge. Hand-written checks rather than pydantic: this runs on every request and must stay
cheap. A malformed body is a 400 here, so it never costs an upstream round trip.

The upstream body is always re-serialized from what was parsed (gateway/upstream_request.py),
never the client's bytes: the
node must see exactly the `max_tokens` the gateway reserved (a `null`, or a duplicate key that
another JSON parser would read differently, would let it generate past the reservation), and
re-encoding is also what finds lone surrogates, which are valid JSON escapes but not text.
Every request goes to the node as a stream (a non-stream's answer is assembled from it by
gateway/whole.py) that asks for usage and for its output token ids (`return_token_ids`), which a
resume continues from; the relay removes them unless the client asked too.

Prompt tokens are estimated twice (gateway/prompt_estimate.py): an upper bound from the UTF-8
bytes sizes the rate-limit reservation (the prompt once, then `max_tokens` for each of the `n`
choices), which the usage the node reports settles; a likely figure from the characters routes
the request. Both count what a chat template renders of tools: the tools section, an assistant's
tool calls, a tool result's call id and function name.

`resume_token_ids` is the gateway's own field for its continuations (wire/resume.py): from a
client it is refused (even `null`), as it would prefill tokens that no estimate counts and start
the answer from an assistant prefix of the client's choosing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Literal, TypeGuard

from gateway.errors import InvalidRequestError
from gateway.prompt_estimate import (
    CHARS_PER_TOKEN,
    ChatTurn,
    PromptEstimate,
    of_chat,
    of_texts,
    of_token_ids,
)
from gateway.upstream_request import UpstreamBody
from wire.output_limit import (
    MAX_TOKENS,
    chat_output_limit,
    completions_output_limit,
    set_output_limit,
)
from wire.prefix_key import prefix_key_of
from wire.resume import RESUME_TOKEN_IDS, RETURN_TOKEN_IDS

Endpoint = Literal["chat", "completions"]
MAX_INT_FIELD = 2**31
JSON_FORMATS = ("json_object", "json_schema")
# Tools in the prompt (engine/tool_prompt.py's generic section; a model's own is no longer):
# 460 bytes of instructions, and a forced call's start with its function's name.
MAX_TOOL_SECTION_BYTES = 640
# `<tool_response>{"tool_call_id": ..., "name": ...}</tool_response>`, a name at most 64 bytes.
MAX_TOOL_RESULT_OVERHEAD_BYTES = 144


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str
    is_stream: bool
    wants_usage: bool  # the client asked for the usage chunk itself
    wants_token_ids: bool  # the client asked for `token_ids` itself (wire/resume.py)
    prompt_tokens: int  # likely, for routing
    max_prompt_tokens: int  # an upper bound, for the reservation
    max_tokens: int  # the client's, or the gateway's default cap
    num_choices: int  # `n`: each choice may generate max_tokens
    affinity_key: str | None  # hash of the system prompt, for prefix-cache affinity
    prefix_tokens: int  # likely, of the prompt up to the system prompt's end (0: none)
    is_constrained: bool  # a grammar shapes the output: its TTFT includes compiling it
    upstream_body: UpstreamBody  # to the node: a stream, usage and ids, the reserved max_tokens

    @property
    def reserved_tokens(self) -> int:
        return self.max_prompt_tokens + self.max_tokens * self.num_choices


def _invalid(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, "invalid_request", param=param)


def _int_field(body: dict[str, object], name: str) -> int | None:
    value = body.get(name)
    if value is None:  # null means absent, as in OpenAI's API
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < MAX_INT_FIELD:
        raise _invalid(f"{name} must be a positive integer", name)
    return value


def _chat_turns(messages: object) -> list[ChatTurn]:
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty array", "messages")
    turns: list[ChatTurn] = []
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
        name = message.get("name")
        turns.append(ChatTurn(message["role"], name if isinstance(name, str) else None, text))
    return turns


def _tools_bytes(tools: object, messages: object) -> int:
    """At least the bytes a chat template renders of tools beyond the messages' text: the tools
    section (their JSON one a line, the instructions, a required or named call's start), an
    assistant's calls (their JSON is longer than their rendering), a tool result's element
    around its text with the call's id and function name."""
    num_bytes = 0
    if isinstance(tools, list) and tools:
        lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        num_bytes += _utf8_len(lines) + MAX_TOOL_SECTION_BYTES
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        if message.get("tool_calls"):
            num_bytes += _utf8_len(json.dumps(message["tool_calls"], ensure_ascii=False))
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str):
            num_bytes += _utf8_len(call_id) + MAX_TOOL_RESULT_OVERHEAD_BYTES
    return num_bytes


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _system_prompt(turns: list[ChatTurn]) -> tuple[str, int] | None:
    """The first system message's text, and the likely tokens of the prompt up to its end (what
    a node's prefix cache holds of it); None without one, or when its text is empty."""
    for i, turn in enumerate(turns):
        if turn.role in ("system", "developer"):
            return (turn.text, of_chat(turns[: i + 1]).likely_tokens) if turn.text else None
    return None


def _is_token_ids(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def _prompt_estimate(prompt: object) -> PromptEstimate:
    """OpenAI's four prompt shapes: a string, token ids, or a non-empty array of either."""
    if isinstance(prompt, str):
        return of_texts([prompt])
    if _is_token_ids(prompt):
        return of_token_ids([prompt])
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return of_texts(prompt)
        if all(_is_token_ids(p) for p in prompt):
            return of_token_ids(prompt)
    raise _invalid(
        "prompt must be a string, token ids, or an array of strings or of token id arrays",
        "prompt",
    )


def _asks_grammar(body: dict[str, object]) -> bool:
    """Whether the node constrains the output with a grammar: a JSON response_format,
    guided_regex or guided_choice, or (chat) a required or named tool_choice."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in JSON_FORMATS:
        return True
    if body.get("guided_regex") is not None or body.get("guided_choice") is not None:
        return True
    tool_choice = body.get("tool_choice")
    return tool_choice == "required" or isinstance(tool_choice, dict)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _load(raw: bytes) -> dict[str, object]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:  # UnicodeDecodeError included
        raise InvalidRequestError("request body is not valid JSON", "invalid_json") from None
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply", "invalid_json") from None
    if not isinstance(body, dict):
        raise _invalid("request body must be a JSON object")
    return body


def parse_request(
    raw: bytes, endpoint: Endpoint, default_max_tokens: int, cache_salt: str | None = None
) -> ParsedRequest:
    """The request as the gateway routes and forwards it; `cache_salt` (the tenant's, None
    where prefix caches are shared) keys its affinity key as the nodes' caches are keyed."""
    body = _load(raw)
    if RESUME_TOKEN_IDS in body:
        raise _invalid(
            f"{RESUME_TOKEN_IDS} is not accepted: the gateway sets it for its own continuations",
            RESUME_TOKEN_IDS,
        )
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
    prefix_tokens = 0
    if endpoint == "chat":
        turns = _chat_turns(body.get("messages"))
        estimate = of_chat(turns)
        try:
            num_tool_bytes = _tools_bytes(body.get("tools"), body["messages"])
        except RecursionError:  # within json.loads's limit, deeper in the stack here
            raise InvalidRequestError("request body is nested too deeply", "invalid_json") from None
        if num_tool_bytes:  # a byte is at most a token; JSON is mostly ASCII
            estimate = PromptEstimate(
                estimate.likely_tokens + num_tool_bytes // CHARS_PER_TOKEN,
                estimate.max_tokens + num_tool_bytes,
            )
        system = _system_prompt(turns)
        if system is not None:
            text, prefix_tokens = system
            affinity_key = prefix_key_of(text, cache_salt)
        max_tokens = chat_output_limit(partial(_int_field, body)) or default_max_tokens
        set_output_limit(body, max_tokens)
    else:
        estimate = _prompt_estimate(body.get("prompt"))
        max_tokens = completions_output_limit(_int_field(body, MAX_TOKENS))
        body[MAX_TOKENS] = max_tokens  # the newer name is chat's alone: left as it came
    # The gateway alone decides whose prefix cache a request may share (see `cache_salt.py`).
    body.pop("cache_salt", None)
    # A non-stream goes upstream as a stream too, so that it can resume (gateway/whole.py).
    body["stream"] = True
    if not wants_usage:
        body["stream_options"] = {**(options or {}), "include_usage": True}
    wants_token_ids = body.get(RETURN_TOKEN_IDS) is True
    body[RETURN_TOKEN_IDS] = True  # what a resume continues from
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        is_stream=is_stream,
        wants_usage=wants_usage,
        wants_token_ids=wants_token_ids,
        prompt_tokens=estimate.likely_tokens,
        max_prompt_tokens=estimate.max_tokens,
        max_tokens=max_tokens,
        num_choices=_int_field(body, "n") or 1,
        affinity_key=affinity_key,
        prefix_tokens=prefix_tokens,
        is_constrained=_asks_grammar(body),
        upstream_body=UpstreamBody.of(body, max_tokens),
    )

"""A non-streamed answer assembled from the stream the gateway asked the node for instead.

A non-streamed request goes upstream as a stream (with usage and token ids, see
gateway/openai_request.py), so that when its region fails mid-generation it resumes in the next
region exactly as a stream does (gateway/relay.py, gateway/resume.py). Nothing reaches the
client until that stream is done; its events, as the relay passes them on (one `id`, usage summed
over the attempts, the finish marked with the number of resumes), are then folded into the one
body the node answers for a non-stream: the first chunk's top-level fields, then every choice by
its `index` (`n` > 1 streams interleave them), each with its text (chat: a `message`, with the
`tool_calls` its deltas built: a call's id, type and name from its first item, its `arguments`
joined from every item of the same tool call index, and `content` null when a reply that made
calls wrote none, as the node answers), its `logprobs` lists joined (a resumed completion's
`text_offset` is counted on from the first attempt's start by gateway/sse.py already), its own
`finish_reason`, and `token_ids` if the client asked for them; then `usage` once, and
`meridian_resumes` when it was resumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway.sse import DATA_PREFIX, DONE_EVENT, EVENT_END
from wire.resume import RESUMES_FIELD, TOKEN_IDS

JSON = dict[str, object]
_CHUNK_SUFFIX = ".chunk"  # chat.completion.chunk -> chat.completion
_HEAD_ORDER = ("id", "object", "created", "model")


class BodySink:
    """Where the relay writes a non-stream's events (the relay's sink)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self._parts.append(data)

    async def write_eof(self) -> None:
        return None

    @property
    def events(self) -> bytes:
        return b"".join(self._parts)


def _payloads(events: bytes) -> list[JSON]:
    payloads: list[JSON] = []
    for event in events.split(EVENT_END):
        event = event.strip()
        if not event.startswith(DATA_PREFIX) or event == DONE_EVENT:
            continue
        payload = json.loads(event[len(DATA_PREFIX) :])
        if isinstance(payload, dict):
            payloads.append(payload)
    return payloads


def _join_logprobs(into: JSON, logprobs: object) -> None:
    """Chat's `{"content": [...]}` and completions' lists of tokens, values and offsets."""
    if isinstance(logprobs, dict):
        for name, values in logprobs.items():
            if isinstance(values, list):
                joined = into.setdefault(name, [])
                assert isinstance(joined, list)
                joined.extend(values)


@dataclass(slots=True)
class _ToolCall:
    """One `message.tool_calls` item, from the deltas of its tool call index."""

    call_id: object = None
    kind: object = "function"
    name: object = None
    arguments: list[str] = field(default_factory=list)

    def add(self, item: JSON) -> None:
        self.call_id = item.get("id", self.call_id)
        self.kind = item.get("type", self.kind)
        function = item.get("function")
        if isinstance(function, dict):
            self.name = function.get("name", self.name)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                self.arguments.append(arguments)

    def to_json(self) -> JSON:
        function = {"name": self.name, "arguments": "".join(self.arguments)}
        return {"id": self.call_id, "type": self.kind, "function": function}


@dataclass(slots=True)
class _Choice:
    """One choice's chunks, folded."""

    index: int
    keys: set[str] = field(default_factory=set)
    is_chat: bool = False
    role: object = "assistant"
    texts: list[str] = field(default_factory=list)
    tool_calls: dict[int, _ToolCall] = field(default_factory=dict)
    logprobs: JSON = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: object = None

    def add(self, chunk: JSON) -> None:
        self.keys.update(chunk)
        delta = chunk.get("delta")
        if isinstance(delta, dict):
            self.is_chat = True
            self.role = delta.get("role") or self.role
            content = delta.get("content")
            self.texts.append(content if isinstance(content, str) else "")
            for item in delta.get("tool_calls") or ():
                if not isinstance(item, dict) or not isinstance(item.get("index"), int):
                    raise ValueError("a tool call delta has no index")
                self.tool_calls.setdefault(item["index"], _ToolCall()).add(item)
        else:
            text = chunk.get("text")
            self.texts.append(text if isinstance(text, str) else "")
        _join_logprobs(self.logprobs, chunk.get("logprobs"))
        ids = chunk.get(TOKEN_IDS) or []
        if isinstance(ids, list):
            self.token_ids.extend(ids)
        if chunk.get("finish_reason") is not None:
            self.finish_reason = chunk["finish_reason"]

    def to_json(self) -> JSON:
        text = "".join(self.texts)
        out: JSON = {"index": self.index}
        if self.is_chat:
            message: JSON = {"role": self.role, "content": text}
            if self.tool_calls:
                message["content"] = text or None
                calls = sorted(self.tool_calls.items())
                message["tool_calls"] = [call.to_json() for _, call in calls]
            out["message"] = message
        else:
            out["text"] = text
        if "logprobs" in self.keys:
            out["logprobs"] = self.logprobs or None
        out["finish_reason"] = self.finish_reason
        if TOKEN_IDS in self.keys:
            out[TOKEN_IDS] = self.token_ids
        return out


def whole_body(events: bytes) -> bytes:
    """The non-stream body for a completed stream's relayed events (ValueError if malformed)."""
    payloads = _payloads(events)
    if not payloads:
        raise ValueError("the stream held no chunk")
    first = payloads[0]
    # The node's order for a whole body: id, object, created, model, then the rest.
    head = [k for k in _HEAD_ORDER if k in first] + [k for k in first if k not in _HEAD_ORDER]
    body: JSON = {k: first[k] for k in head if k not in ("choices", "usage")}
    kind = body.get("object")
    if isinstance(kind, str):
        body["object"] = kind.removesuffix(_CHUNK_SUFFIX)
    choices: dict[int, _Choice] = {}
    usage: object = None
    num_resumes: object = None
    for payload in payloads:
        if isinstance(payload.get("usage"), dict):
            usage = payload["usage"]
        if RESUMES_FIELD in payload:
            num_resumes = payload[RESUMES_FIELD]
        chunks = payload.get("choices") or []
        if not isinstance(chunks, list):
            raise ValueError("choices is not an array")
        for chunk in chunks:
            if not isinstance(chunk, dict):
                raise ValueError("a choice is not an object")
            index = chunk.get("index", 0)
            if not isinstance(index, int):
                raise ValueError("a choice's index is not an integer")
            choices.setdefault(index, _Choice(index)).add(chunk)
    body["choices"] = [choices[i].to_json() for i in sorted(choices)] or [_Choice(0).to_json()]
    if usage is not None:
        body["usage"] = usage
    if num_resumes is not None:
        body[RESUMES_FIELD] = num_resumes
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

"""A non-streamed answer assembled from the stream the gateway asked the node for instead.

A non-streamed request goes upstream as a stream (with usage and token ids, see
gateway/openai_request.py), so that when its region fails mid-generation it resumes in the next
region exactly as a stream does (gateway/relay.py, gateway/resume.py). Nothing reaches the
client until that stream is done; its events, as the relay passes them on (one `id`, usage summed
over the attempts, the finish marked with the number of resumes), are then folded into the one
body the node answers for a non-stream: the first chunk's top-level fields, one choice with the
text (chat: a `message`), the choice's `logprobs` lists joined (a resumed completion's
`text_offset` is counted on from the first attempt's start by gateway/sse.py already),
`finish_reason`, `token_ids` if the client asked for them, `usage`, and `meridian_resumes` when
it was resumed.
"""

from __future__ import annotations

import json

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
    is_chat = False
    role, texts = "assistant", []
    choice_keys: set[str] = set()
    logprobs: JSON = {}
    token_ids: list[int] = []
    finish_reason: object = None
    usage: object = None
    num_resumes: object = None
    for payload in payloads:
        if isinstance(payload.get("usage"), dict):
            usage = payload["usage"]
        if RESUMES_FIELD in payload:
            num_resumes = payload[RESUMES_FIELD]
        choices = payload.get("choices") or []
        if not isinstance(choices, list):
            raise ValueError("choices is not an array")
        for choice in choices:
            if not isinstance(choice, dict):
                raise ValueError("a choice is not an object")
            choice_keys.update(choice)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                is_chat = True
                role = delta.get("role") or role
                texts.append(delta.get("content") or "")
            else:
                texts.append(choice.get("text") or "")
            _join_logprobs(logprobs, choice.get("logprobs"))
            ids = choice.get(TOKEN_IDS) or []
            if isinstance(ids, list):
                token_ids.extend(ids)
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
    text = "".join(texts)
    choice_out: JSON = {"index": 0}
    if is_chat:
        choice_out["message"] = {"role": role, "content": text}
    else:
        choice_out["text"] = text
    if "logprobs" in choice_keys:
        choice_out["logprobs"] = logprobs or None
    choice_out["finish_reason"] = finish_reason
    if TOKEN_IDS in choice_keys:
        choice_out[TOKEN_IDS] = token_ids
    body["choices"] = [choice_out]
    if usage is not None:
        body["usage"] = usage
    if num_resumes is not None:
        body[RESUMES_FIELD] = num_resumes
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

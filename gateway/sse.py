"""Reading an upstream SSE stream as it passes through: usage, first token, end; and hiding the
usage the gateway asked for on the client's behalf.

The gateway always asks the node for usage (`stream_options.include_usage`) so it can settle the
token reservation. The node then sends `"usage":null` in every chunk and one last chunk with the
usage and no choices. If the client did not ask for usage, both are removed on the way out.

It also keeps what a resume needs (wire/resume.py): the output token ids relayed so far (the
gateway always asks for them, and removes them if the client did not), whether the choice has
finished, and an upstream error event, which it holds back so that the stream can continue
elsewhere instead. After `begin_continuation`, the next attempt's events are made to look like
the first attempt's: its opening role chunk is dropped, its `id` and `created` become the first
attempt's, its usage is summed with the earlier attempts' and its `finish_reason` chunk is marked
with the number of resumes.

Bytes are forwarded as soon as an event is complete (only a partial event waits for its end);
events are parsed as JSON only when they carry a usage object or a marked finish, so most chunks
cost a few byte searches and regular expressions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from wire.resume import RESUMES_FIELD

EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]"
DATA_PREFIX = b"data: "
# Upstream events are never this long; past it, partial bytes are flushed rather than held.
MAX_PENDING_BYTES = 1 << 20
_NULL_USAGES = (b',"usage":null', b', "usage": null')
ERROR_PREFIX = b'data: {"error"'
# Keys only: inside JSON string values a quote is escaped, so these never match content.
_TOKEN_IDS = re.compile(rb',\s*"token_ids":\s*\[([0-9,\s]*)\]')
_ID = re.compile(rb'"id":\s*"[^"]*"')
_CREATED = re.compile(rb'"created":\s*[0-9]+')
_FINISHED = (b'"finish_reason":"', b'"finish_reason": "')


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


def usage_of(payload: object) -> Usage | None:
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


def _has_finish(events: bytes) -> bool:
    return _FINISHED[0] in events or _FINISHED[1] in events


def summed_usage(last: Usage, starts: list[int]) -> Usage:
    """The usage of a request resumed over several attempts, from the last attempt's own.

    `starts[j]` is how many output tokens had been relayed when attempt j began (0 for the
    first). A continuation's node counts the ids it resumed after as prompt, so the original
    prompt is the last attempt's less its start; each attempt prefilled that plus its start."""
    prompt = last.prompt_tokens - starts[-1]
    return Usage(sum(prompt + start for start in starts), last.completion_tokens + starts[-1])


def is_first_token(event: bytes) -> bool:
    """An event that carries generated output (chat streams open with a role-only chunk)."""
    return event.startswith(DATA_PREFIX) and b'"role"' not in event and DONE_EVENT not in event


class StreamReader:
    """Feed upstream bytes in order; get back the bytes to send to the client."""

    def __init__(self, strip_usage: bool, strip_token_ids: bool = True) -> None:
        self._strip_usage = strip_usage
        self._strip_token_ids = strip_token_ids
        self._pending = b""
        self.usage: Usage | None = None
        self.has_first_token = False
        self.is_done = False
        self.is_finished = False  # a chunk with a finish_reason has passed
        self.num_events = 0
        self.token_ids: list[int] = []  # every output id relayed, over all attempts
        self.starts: list[int] = [0]  # len(token_ids) when each attempt began
        self.upstream_error: bytes | None = None  # a held-back error event (and what followed)
        self._id_field: bytes | None = None  # the first attempt's `"id":"..."`
        self._created_field: bytes | None = None
        self._is_continuation = False

    @property
    def num_resumes(self) -> int:
        return len(self.starts) - 1

    def begin_continuation(self) -> None:
        """The attempt being read broke; what is fed from now on comes from its continuation."""
        self._pending = b""  # a partial event of the broken attempt: never sent, never counted
        self.upstream_error = None
        self.starts.append(len(self.token_ids))
        self._is_continuation = True

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(EVENT_END)
        if cut < 0:
            if len(data) > MAX_PENDING_BYTES:
                self._pending = b""
                return data
            self._pending = data
            return b""
        cut += len(EVENT_END)
        complete, self._pending = data[:cut], data[cut:]
        return self._complete(complete)

    def _complete(self, events: bytes) -> bytes:
        if self.upstream_error is not None:
            return b""  # after an error event, only its `[DONE]` can follow
        if ERROR_PREFIX in events:
            events = self._hold_error(events)
        if self._id_field is None:
            self._learn_id(events)
        if self._is_continuation:
            events = self._as_first_attempt(events)
        if b'"token_ids"' in events:
            events = self._take_token_ids(events)
        if _has_finish(events):
            self.is_finished = True
            if self.num_resumes:
                events = self._mark_finish(events)
        self.num_events += events.count(EVENT_END)
        if not self.has_first_token:
            self.has_first_token = any(is_first_token(e) for e in events.split(EVENT_END))
        if not self.is_done and DONE_EVENT in events:
            self.is_done = True
        if b'"usage":{' in events or b'"usage": {' in events:
            events = self._take_usage(events)
        if self._strip_usage:
            for null_usage in _NULL_USAGES:
                if null_usage in events:
                    events = events.replace(null_usage, b"")
        return events

    def _hold_error(self, events: bytes) -> bytes:
        at = events.find(ERROR_PREFIX)
        if at > 0 and events[at - len(EVENT_END) : at] != EVENT_END:
            return events  # not at an event's start: text that merely looks like it
        self.upstream_error = events[at:]
        return events[:at]

    def _learn_id(self, events: bytes) -> None:
        found = _ID.search(events)
        if found is not None:
            self._id_field = found.group()
            created = _CREATED.search(events)
            self._created_field = created.group() if created else None

    def _as_first_attempt(self, events: bytes) -> bytes:
        if b'"role"' in events:  # the continuation's opening chunk: the client has had one
            kept = [e for e in events.split(EVENT_END)[:-1] if b'"role"' not in e]
            events = b"".join(e + EVENT_END for e in kept)
        if self._id_field is not None:
            events = _ID.sub(self._id_field, events)
        if self._created_field is not None:
            events = _CREATED.sub(self._created_field, events)
        return events

    def _take_token_ids(self, events: bytes) -> bytes:
        kept: list[bytes] = []
        at = 0
        for found in _TOKEN_IDS.finditer(events):
            ids = found.group(1)
            if ids.strip():
                self.token_ids.extend(map(int, ids.split(b",")))
            kept.append(events[at : found.start()])
            at = found.end()
        if not self._strip_token_ids or not kept:
            return events
        kept.append(events[at:])
        return b"".join(kept)

    def _mark_finish(self, events: bytes) -> bytes:
        kept: list[bytes] = []
        for event in events.split(EVENT_END)[:-1]:
            if _has_finish(event) and event.startswith(DATA_PREFIX):
                try:
                    payload = json.loads(event[len(DATA_PREFIX) :])
                except ValueError:
                    payload = None
                if isinstance(payload, dict):
                    payload[RESUMES_FIELD] = self.num_resumes
                    event = DATA_PREFIX + json.dumps(payload, separators=(",", ":")).encode()
            kept.append(event + EVENT_END)
        return b"".join(kept)

    def _take_usage(self, events: bytes) -> bytes:
        kept: list[bytes] = []
        for event in events.split(EVENT_END)[:-1]:
            if b'"usage"' in event and event.startswith(DATA_PREFIX):
                try:
                    payload = json.loads(event[len(DATA_PREFIX) :])
                except ValueError:
                    payload = None
                usage = usage_of(payload)
                if usage is not None and isinstance(payload, dict):
                    self.usage = usage
                    if self.num_resumes:
                        self.usage = summed_usage(usage, self.starts)
                        payload["usage"] = {**payload["usage"], **self.usage.to_json()}
                        event = DATA_PREFIX + json.dumps(payload, separators=(",", ":")).encode()
                    if self._strip_usage:
                        if not payload.get("choices"):
                            continue  # the usage-only chunk: drop it
                        del payload["usage"]
                        event = DATA_PREFIX + json.dumps(payload, separators=(",", ":")).encode()
            kept.append(event + EVENT_END)
        return b"".join(kept)

    def flush(self) -> bytes:
        """Whatever partial event is left when the upstream ends."""
        pending, self._pending = self._pending, b""
        return pending

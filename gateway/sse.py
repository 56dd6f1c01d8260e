"""Reading an upstream SSE stream as it passes through: usage, first token, end; and hiding the
usage the gateway asked for on the client's behalf.

The gateway always asks the node for usage (`stream_options.include_usage`) so it can settle the
token reservation. The node then sends `"usage":null` in every chunk and one last chunk with the
usage and no choices. If the client did not ask for usage, both are removed on the way out.

It also keeps what a resume needs (wire/resume.py): the output token ids relayed so far (the
gateway always asks for them, and removes them if the client did not), whether every choice
(`n`) has finished, and an upstream error event, which it holds back so that the stream can
continue elsewhere instead. After `begin_continuation`, the next attempt's events are made to
look like the first attempt's: its opening role chunk is dropped, its `id` and `created` become
the first attempt's, its usage is summed with the earlier attempts' and its `finish_reason`
chunk is marked with the number of resumes.

Bytes are forwarded as soon as an event is complete (only a partial event waits for its end);
events are parsed as JSON only when they carry a usage object or a marked finish, so most chunks
cost a few byte searches and regular expressions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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
_PROMPT_IDS = re.compile(rb',\s*"prompt_token_ids":\s*\[([0-9,\s]*)\]')
_ID = re.compile(rb'"id":\s*"[^"]*"')
_CREATED = re.compile(rb'"created":\s*[0-9]+')
_FINISHED = (b'"finish_reason":"', b'"finish_reason": "')
_USAGE_OBJECTS = (b'"usage":{', b'"usage": {')  # not the `"usage":null` of every other chunk


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens the node found in its prefix cache (`prompt_tokens_details.cached_tokens`):
    # the last attempt's. Not summed: an attempt that broke sent no usage.
    cached_tokens: int = 0

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
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached if isinstance(cached, int) else 0)


def _has_finish(events: bytes) -> bool:
    return _FINISHED[0] in events or _FINISHED[1] in events


def _encode(payload: dict[str, object]) -> bytes:
    return DATA_PREFIX + json.dumps(payload, separators=(",", ":")).encode()


def _rewrite(
    events: bytes,
    needle: bytes | tuple[bytes, ...],
    change: Callable[[dict[str, object]], bool | None],
) -> bytes:
    """`events` with each event that holds `needle` (or one of them) parsed and handed to
    `change`, which edits the payload in place and says what to send: True the edited payload,
    False the event as it was, None nothing (the event is dropped). Events that are not JSON
    objects pass as they are.
    """
    kept: list[bytes] = []
    for event in events.split(EVENT_END)[:-1]:
        holds = needle in event if isinstance(needle, bytes) else any(n in event for n in needle)
        if holds and event.startswith(DATA_PREFIX):
            try:
                payload = json.loads(event[len(DATA_PREFIX) :])
            except ValueError:
                payload = None
            if isinstance(payload, dict):
                verdict = change(payload)
                if verdict is None:
                    continue
                if verdict:
                    event = _encode(payload)
        kept.append(event + EVENT_END)
    return b"".join(kept)


def summed_usage(last: Usage, starts: list[int]) -> Usage:
    """The usage of a request resumed over several attempts, from the last attempt's own.

    `starts[j]` is how many output tokens had been relayed when attempt j began (0 for the
    first). A continuation's node counts the ids it resumed after as prompt, so the original
    prompt is the last attempt's less its start; each attempt prefilled that plus its start."""
    prompt = last.prompt_tokens - starts[-1]
    return Usage(
        sum(prompt + start for start in starts),
        last.completion_tokens + starts[-1],
        last.cached_tokens,
    )


def is_first_token(event: bytes) -> bool:
    """An event that carries generated output (chat streams open with a role-only chunk)."""
    return event.startswith(DATA_PREFIX) and b'"role"' not in event and DONE_EVENT not in event


def first_output(data: bytes) -> bytes | None:
    """The first complete event of `data` (a stream's bytes) past the opening role chunk: a
    token, a finish, usage or an error event; None while there is none. The node sends the
    role chunk before its engine has done anything, so that chunk proves nothing of the
    engine."""
    return next((e for e in data.split(EVENT_END)[:-1] if is_first_token(e)), None)


class StreamReader:
    """Feed upstream bytes in order; get back the bytes to send to the client."""

    def __init__(self, strip_usage: bool, strip_token_ids: bool = True, num_choices: int = 1):
        self._strip_usage = strip_usage
        self._strip_token_ids = strip_token_ids
        self._num_choices = num_choices  # `n`: each choice ends with a finish_reason chunk
        self._num_finished = 0
        self._pending = b""
        self.usage: Usage | None = None
        self.has_first_token = False
        self.is_done = False
        self.is_finished = False  # a chunk with a finish_reason has passed for every choice
        self.num_events = 0
        self.token_ids: list[int] = []  # every output id relayed, over all attempts
        self.starts: list[int] = [0]  # len(token_ids) when each attempt began
        self.upstream_error: bytes | None = None  # a held-back error event (and what followed)
        self._id_field: bytes | None = None  # the first attempt's `"id":"..."`
        self._created_field: bytes | None = None
        self._is_continuation = False
        self._num_prompt_tokens: int | None = None  # the attempt's, from its first chunk
        self._finish_event: bytes | None = None  # the chunk with the finish_reason, as sent
        # Legacy completions' logprobs: `text_offset` counts the output's characters from
        # each attempt's own start; the client's count from the first attempt's.
        self._text_end = 0  # characters of output the offsets have covered so far
        self._text_base = 0  # what to add to the current attempt's offsets

    @property
    def num_resumes(self) -> int:
        return len(self.starts) - 1

    def begin_continuation(self) -> None:
        """The attempt being read broke; what is fed from now on comes from its continuation."""
        self._pending = b""  # a partial event of the broken attempt: never sent, never counted
        self.upstream_error = None
        self.starts.append(len(self.token_ids))
        self._is_continuation = True
        self._num_prompt_tokens = None
        self._text_base = self._text_end

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
        if self._num_prompt_tokens is None and b'"prompt_token_ids"' in events:
            events = self._take_prompt_ids(events)
        if self._id_field is None:
            self._learn_id(events)
        if self._is_continuation:
            events = self._as_first_attempt(events)
        if b'"token_ids"' in events:
            events = self._take_token_ids(events)
        if b'"text_offset"' in events:
            events = _rewrite(events, b'"text_offset"', self._count_on_offsets)
        if _has_finish(events):
            self._num_finished += sum(map(events.count, _FINISHED))
            self.is_finished = self._num_finished >= self._num_choices
            if self.num_resumes:
                events = _rewrite(events, b'"finish_reason"', self._mark_finish)
            self._finish_event = next((e for e in events.split(EVENT_END) if _has_finish(e)), None)
        self.num_events += events.count(EVENT_END)
        if not self.has_first_token:
            self.has_first_token = first_output(events) is not None
        if not self.is_done and DONE_EVENT in events:
            self.is_done = True
        if _USAGE_OBJECTS[0] in events or _USAGE_OBJECTS[1] in events:
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

    def _take_prompt_ids(self, events: bytes) -> bytes:
        found = _PROMPT_IDS.search(events)
        if found is None:
            return events
        ids = found.group(1).strip()
        self._num_prompt_tokens = ids.count(b",") + 1 if ids else 0
        if not self._strip_token_ids and not self._is_continuation:
            return events  # the client asked for ids: it gets its prompt's, once
        return events[: found.start()] + events[found.end() :]

    def _count_on_offsets(self, payload: dict[str, object]) -> bool:
        choices = payload.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
            offsets = logprobs.get("text_offset") if isinstance(logprobs, dict) else None
            tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
            if not isinstance(offsets, list) or not isinstance(tokens, list) or not offsets:
                continue
            offsets[:] = [o + self._text_base if isinstance(o, int) else o for o in offsets]
            last_offset, last_token = offsets[-1], tokens[-1]
            if isinstance(last_offset, int) and isinstance(last_token, str):
                self._text_end = last_offset + len(last_token)
        return self._text_base > 0

    def _mark_finish(self, payload: dict[str, object]) -> bool:
        payload[RESUMES_FIELD] = self.num_resumes
        return True

    def _take_usage(self, events: bytes) -> bytes:
        # Only the events with a usage object are parsed (measured: parsing every chunk's
        # `"usage":null` too cost about 4% of a non-streamed request's CPU).
        return _rewrite(events, _USAGE_OBJECTS, self._settle_usage)

    def _settle_usage(self, payload: dict[str, object]) -> bool | None:
        usage = usage_of(payload)
        if usage is None:
            return False
        self.usage = summed_usage(usage, self.starts)
        is_changed = False
        if self.num_resumes:
            payload["usage"] = {**payload["usage"], **self.usage.to_json()}  # type: ignore[dict-item]
            is_changed = True
        if self._strip_usage:
            if not payload.get("choices"):
                return None  # the usage-only chunk: drop it
            del payload["usage"]
            is_changed = True
        return is_changed

    def end_without_usage(self) -> bytes:
        """The upstream ended after the finish chunk but before its usage chunk: the usage
        from what this reader learnt (the prompt's size from the attempt's first chunk, the
        ids relayed), and the usage chunk for a client that asked for one (else b"")."""
        if self.usage is not None or self._num_prompt_tokens is None:
            return b""
        num_completion = len(self.token_ids) - self.starts[-1]
        self.usage = summed_usage(Usage(self._num_prompt_tokens, num_completion), self.starts)
        if self._strip_usage or self._finish_event is None:
            return b""
        try:
            payload = json.loads(self._finish_event[len(DATA_PREFIX) :])
        except ValueError:
            return b""
        payload.pop(RESUMES_FIELD, None)
        payload["choices"], payload["usage"] = [], self.usage.to_json()
        return _encode(payload) + EVENT_END

    def flush(self) -> bytes:
        """Whatever partial event is left when the upstream ends."""
        pending, self._pending = self._pending, b""
        return pending

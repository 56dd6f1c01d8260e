"""Reading an upstream SSE stream as it passes through: usage, first token, end; and hiding the
usage the gateway asked for on the client's behalf.

The gateway always asks the node for usage (`stream_options.include_usage`) so it can settle the
token reservation. The node then sends `"usage":null` in every chunk and one last chunk with the
usage and no choices. If the client did not ask for usage, both are removed on the way out.

Bytes are forwarded as soon as an event is complete (only a partial event waits for its end);
events are parsed as JSON only when they carry a usage object, so most chunks cost a few byte
searches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]"
DATA_PREFIX = b"data: "
# Upstream events are never this long; past it, partial bytes are flushed rather than held.
MAX_PENDING_BYTES = 1 << 20
_NULL_USAGES = (b',"usage":null', b', "usage": null')


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


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


def is_first_token(event: bytes) -> bool:
    """An event that carries generated output (chat streams open with a role-only chunk)."""
    return event.startswith(DATA_PREFIX) and b'"role"' not in event and DONE_EVENT not in event


class StreamReader:
    """Feed upstream bytes in order; get back the bytes to send to the client."""

    def __init__(self, strip_usage: bool) -> None:
        self._strip_usage = strip_usage
        self._pending = b""
        self.usage: Usage | None = None
        self.has_first_token = False
        self.is_done = False
        self.num_events = 0

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

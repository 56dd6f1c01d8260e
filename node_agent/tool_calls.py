"""Tool calls out of a model's output, as it streams: the syntax engine/tool_prompt.py teaches,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Text outside the tags is the message's content. Inside, once `{"name": "...", "arguments": `
has arrived the call starts (its id and name go out at once), and the arguments' JSON follows in
fragments as it comes, up to where the value ends (strings and nesting followed, so a brace inside
a string does not end it); what follows it up to `</tool_call>` is dropped. A body written another
way (the keys the other way round, say) is parsed whole at `</tool_call>`; one that is not a call
at all is content, tags included. At the end of the output an open call is finished as it stands
(cut off by `max_tokens`, or by the stop at `</tool_call>` when only one call is allowed).
Trailing white space of the content is held back until more content follows, so a reply that is
only calls has no content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_OPENERS = {"{": "}", "[": "]"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    index: int
    call_id: str
    name: str
    arguments: str = ""

    def to_json(self) -> dict[str, object]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.call_id, "type": "function", "function": function}


@dataclass(slots=True)
class Delta:
    """What one piece of output adds: content text, and OpenAI's `delta.tool_calls` items in
    the order they happened (a call's id and name first, then its arguments' fragments)."""

    content: str = ""
    tool_calls: list[dict[str, object]] = field(default_factory=list)

    def start(self, call: ToolCall) -> None:
        function = {"name": call.name, "arguments": ""}
        self.tool_calls.append(
            {"index": call.index, "id": call.call_id, "type": "function", "function": function}
        )

    def add_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last["index"] == index and "id" not in last:
            function = last["function"]
            assert isinstance(function, dict)
            function["arguments"] += text
        else:
            self.tool_calls.append({"index": index, "function": {"arguments": text}})


@dataclass(slots=True)
class _ValueScanner:
    """Where a JSON value that arrives char by char ends (it is not checked, only followed)."""

    depth: int = 0
    has_started: bool = False
    is_in_string: bool = False
    is_escaped: bool = False
    is_done: bool = False

    def take(self, char: str) -> bool:
        """Whether `char` belongs to the value; once one does not, the value has ended."""
        if self.is_done:
            return False
        if not self.has_started:  # the caller skips the white space before the value
            self.has_started = True
            if char == '"':
                self.is_in_string = True
            elif char in _OPENERS:
                self.depth = 1
            return True
        if self.is_in_string:
            if self.is_escaped:
                self.is_escaped = False
            elif char == "\\":
                self.is_escaped = True
            elif char == '"':
                self.is_in_string = False
                self.is_done = self.depth == 0
            return True
        if self.depth == 0:  # a number or a literal: it ends at a delimiter
            if char in ",}] \t\r\n":
                self.is_done = True
                return False
            return True
        if char == '"':
            self.is_in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.is_done = self.depth == 0
        return True


@dataclass(slots=True)
class ToolCallParser:
    """Feed the output's text as it comes; each call returns what it added."""

    max_calls: int | None = None  # None: any number (parallel tool calls)
    make_id: Callable[[], str] = new_call_id
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _pending: str = ""  # text not yet judged
    _held_space: str = ""  # content white space held back
    _body: str | None = None  # inside a tag: the body so far; None outside
    _call: ToolCall | None = None  # the call whose arguments are streaming
    _value: _ValueScanner | None = None

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self._pending += text
        while self._pending:
            if self._body is None and not self._scan_text(delta):
                break
            if self._body is not None and not self._scan_body(delta):
                break
        return delta

    def finish(self) -> Delta:
        """The end of the output: whatever is held back is judged now."""
        delta = Delta()
        if self._body is not None:
            body, self._body, self._pending = self._body + self._pending, None, ""
            if self._call is None:
                self._whole_body(body, delta, closed=False)
            self._call = self._value = None
        else:
            self._add_content(self._pending, delta)
            self._pending = ""
        if not self.calls:  # a plain reply keeps its trailing white space
            delta.content += self._held_space
            self.content += self._held_space
        return delta

    def _scan_text(self, delta: Delta) -> bool:
        at = self._pending.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._add_content(self._pending[:at], delta)
            self._pending = self._pending[at + len(TOOL_CALL_OPEN) :]
            self._body = ""
            return True
        keep = _partial_tag_len(self._pending, TOOL_CALL_OPEN)
        self._add_content(self._pending[: len(self._pending) - keep], delta)
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    def _scan_body(self, delta: Delta) -> bool:
        assert self._body is not None
        if self._call is None:
            self._body += self._pending
            self._pending = ""
            head = _HEAD.match(self._body)
            if head is not None and self._has_room():
                name = json.loads(f'"{head.group(1)}"')
                self._call = self._start(name, delta)
                self._value = _ValueScanner()
                self._pending, self._body = self._body[head.end() :], ""
            else:
                at = self._body.find(TOOL_CALL_CLOSE)
                if at < 0:
                    return False
                body, self._pending = self._body[:at], self._body[at + len(TOOL_CALL_CLOSE) :]
                self._body = None
                self._whole_body(body, delta, closed=True)
                return True
        return self._scan_arguments(delta)

    def _scan_arguments(self, delta: Delta) -> bool:
        assert self._call is not None and self._value is not None
        if not self._value.has_started:
            self._pending = self._pending.lstrip()
        taken = 0
        while taken < len(self._pending) and self._value.take(self._pending[taken]):
            taken += 1
        value_text = self._pending[:taken]
        self._call.arguments += value_text
        delta.add_arguments(self._call.index, value_text)
        rest = self._pending[taken:]
        if not self._value.is_done:
            self._pending = ""
            return False
        at = rest.find(TOOL_CALL_CLOSE)
        if at < 0:  # the call's closing brace and tag still to come: keep the tail
            self._pending = rest[-(len(TOOL_CALL_CLOSE) - 1) :] if rest else ""
            return False
        self._pending = rest[at + len(TOOL_CALL_CLOSE) :]
        self._body = self._call = self._value = None
        return True

    def _whole_body(self, body: str, delta: Delta, closed: bool) -> None:
        """A body not in the streaming form: a call if it parses as one (dropped past the
        number of calls allowed), else content."""
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(value, dict) or not isinstance(name, str):
            tail = TOOL_CALL_CLOSE if closed else ""
            self._add_content(TOOL_CALL_OPEN + body + tail, delta)
        elif self._has_room():
            arguments = value.get("arguments", {})
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            call = self._start(name, delta)
            call.arguments = text
            delta.add_arguments(call.index, text)

    def _has_room(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    def _start(self, name: str, delta: Delta) -> ToolCall:
        call = ToolCall(len(self.calls), self.make_id(), name)
        self.calls.append(call)
        delta.start(call)
        return call

    def _add_content(self, text: str, delta: Delta) -> None:
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = text[len(stripped) :]
        delta.content += stripped
        self.content += stripped


def _partial_tag_len(text: str, tag: str) -> int:
    """How many of `text`'s last chars could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0

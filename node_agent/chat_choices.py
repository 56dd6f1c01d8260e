"""One choice of a chat response as its output arrives: its text, or its content and tool calls.

With tools in play (`ToolParsing`), the output goes through node_agent/tool_calls.py: a reply
that made calls ends with `finish_reason: tool_calls` (unless it was cut off: `length`), and
its message carries `tool_calls`, its content null when it wrote none. A prompt that ends with
the start of a call (`tool_choice` required or a named function) is continued by the output:
that start is parsed as if the model had written it, though it is not sent as content.

A resumed request (wire/resume.py) continues an output an earlier attempt streamed: its text
(`ToolParsing.resumed_text`) is parsed first and nothing of it is sent again, so the parser is
where the broken stream's was and the continuation's deltas go on from there (a call's argument
fragments under its index, without its id again). A whole answer's message holds the calls whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import TokenLogprobs
from node_agent.responses import JSON
from node_agent.tool_calls import Delta, ToolCallParser


@dataclass(frozen=True, slots=True)
class ToolParsing:
    max_calls: int | None  # None: parallel tool calls
    forced_prefix: str = ""  # what the prompt ends with, of the first call
    # What an earlier attempt of this output streamed (a resume; None: none): parsed, not sent.
    resumed_text: str | None = None


@dataclass(slots=True)
class ChatChoice:
    index: int
    tools: ToolParsing | None
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    engine_finish_reason: str | None = None
    _parser: ToolCallParser | None = field(init=False, default=None)
    _prefix: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.tools is not None:
            self._parser = ToolCallParser(self.tools.max_calls)
            self._prefix = self.tools.forced_prefix
            if self.tools.resumed_text is not None:  # the prefix went with the first attempt
                self._parser.feed(self._prefix + self.tools.resumed_text)
                self._prefix = ""

    def feed(self, text: str) -> JSON:
        """The chunk delta for this much more output (empty: nothing to send yet)."""
        self.parts.append(text)
        if self._parser is None:
            return {"content": text} if text else {}
        text, self._prefix = self._prefix + text, ""
        return _delta_json(self._parser.feed(text))

    def finish(self, reason: str | None) -> JSON:
        """The delta of whatever was held back, once the output has ended with `reason`."""
        self.engine_finish_reason = reason
        if self._parser is None:
            return {}
        return _delta_json(self._parser.finish())

    @property
    def finish_reason(self) -> str | None:
        reason = self.engine_finish_reason
        if self._parser is not None and self._parser.calls and reason == "stop":
            return "tool_calls"
        return reason

    def message(self) -> JSON:
        """The whole response's `message`."""
        if self._parser is None:
            return {"role": "assistant", "content": "".join(self.parts)}
        calls = [call.to_json() for call in self._parser.calls]
        content = self._parser.content or None if calls else self._parser.content
        message: JSON = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message


def _delta_json(delta: Delta) -> JSON:
    out: JSON = {}
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = delta.tool_calls
    return out

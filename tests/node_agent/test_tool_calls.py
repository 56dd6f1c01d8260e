"""The tool-call parser on known outputs, whole and split across chunks at every place."""

from __future__ import annotations

import itertools
import json

import pytest

from node_agent.tool_calls import ToolCallParser

TWO_CALLS = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Pa}r\\"is", "days": [1, {"a": 2}]}}'
    "\n</tool_call>\n"
    '<tool_call>{"arguments": {"x": 1}, "name": "f2"}</tool_call>\n'
)


def parse(chunks: list[str], max_calls: int | None = None) -> tuple[ToolCallParser, list[dict]]:
    """The parser after `chunks` and the end; and every `delta.tool_calls` item, in order."""
    ids = (f"call_{i}" for i in itertools.count())
    parser = ToolCallParser(max_calls, make_id=lambda: next(ids))
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    return parser, [item for delta in deltas for item in delta.tool_calls]


def split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_content_and_two_calls_are_told_apart() -> None:
    parser, _ = parse([TWO_CALLS])
    assert parser.content == "Let me check."
    assert [call.to_json() for call in parser.calls] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": '{"city": "Pa}r\\"is", "days": [1, {"a": 2}]}',
            },
        },
        # Written the other way round: parsed whole at its end.
        {"id": "call_1", "type": "function", "function": {"name": "f2", "arguments": '{"x": 1}'}},
    ]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 13])
def test_split_anywhere_the_result_is_the_same(size: int) -> None:
    whole, _ = parse([TWO_CALLS])
    parser, items = parse(split(TWO_CALLS, size))
    assert parser.content == whole.content
    assert [c.to_json() for c in parser.calls] == [c.to_json() for c in whole.calls]
    # Streamed as OpenAI streams: each call's id and name first, then its arguments' fragments,
    # which join to the whole arguments.
    for call in whole.calls:
        mine = [item for item in items if item["index"] == call.index]
        assert mine[0] == {
            "index": call.index,
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        assert all("id" not in item for item in mine[1:])
        assert "".join(item["function"]["arguments"] for item in mine[1:]) == call.arguments


def test_arguments_stream_before_the_call_ends() -> None:
    parser = ToolCallParser()
    start = parser.feed('<tool_call>{"name": "f", "arguments": {"q": "long te')
    assert [item["function"] for item in start.tool_calls] == [
        {"name": "f", "arguments": ""},
        {"arguments": '{"q": "long te'},
    ]
    more = parser.feed('xt"}}</tool_call>')
    assert more.tool_calls == [{"index": 0, "function": {"arguments": 'xt"}'}}]


def test_a_body_that_is_no_call_is_content() -> None:
    text = "Use <tool_call>not json</tool_call> like that.  "
    for size in (1, 4, len(text)):
        parser, items = parse(split(text, size))
        assert parser.content == text and not parser.calls and not items


def test_a_partial_tag_at_the_end_is_content() -> None:
    parser, _ = parse(["a <tool_c"])
    assert parser.content == "a <tool_c"


def test_a_call_cut_off_is_kept_as_it_stands() -> None:
    parser, _ = parse(['<tool_call>{"name": "f", "arguments": {"a": 1'])
    assert parser.calls[0].arguments == '{"a": 1' and parser.content == ""
    # Stopped at </tool_call> (one call allowed): the call is whole.
    parser, _ = parse(['<tool_call>{"name": "f", "arguments": {"a": 1}}'], max_calls=1)
    assert json.loads(parser.calls[0].arguments) == {"a": 1}


def test_calls_past_the_allowed_number_are_dropped() -> None:
    parser, _ = parse([TWO_CALLS], max_calls=1)
    assert [call.name for call in parser.calls] == ["get_weather"]
    assert parser.content == "Let me check."


def test_a_reply_without_calls_keeps_its_text_exactly() -> None:
    text = "  Paris is sunny.\n\n"
    for size in (1, 3, len(text)):
        parser, _ = parse(split(text, size))
        assert parser.content == text

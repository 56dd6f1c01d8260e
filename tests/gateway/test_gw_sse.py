"""Reading upstream SSE on the way through: usage, first token, end, and hiding usage."""

from __future__ import annotations

import json

from gateway.sse import StreamReader

ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}],"usage":null}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + TOKEN + TOKEN + USAGE + DONE


def feed_all(reader: StreamReader, chunks: list[bytes]) -> bytes:
    return b"".join(reader.feed(chunk) for chunk in chunks) + reader.flush()


def test_usage_is_read_and_passed_on_when_the_client_asked() -> None:
    reader = StreamReader(strip_usage=False)
    assert feed_all(reader, [STREAM]) == STREAM
    assert reader.usage is not None and reader.usage.total_tokens == 5
    assert reader.is_done and reader.has_first_token
    assert reader.num_events == 5


def test_usage_is_hidden_when_the_client_did_not_ask() -> None:
    reader = StreamReader(strip_usage=True)
    out = feed_all(reader, [STREAM])
    assert b"usage" not in out
    assert (
        out == ROLE.replace(b',"usage":null', b"") + 2 * TOKEN.replace(b',"usage":null', b"") + DONE
    )
    assert reader.usage is not None and reader.usage.completion_tokens == 2


def test_events_split_across_reads_are_sent_whole_and_in_order() -> None:
    reader = StreamReader(strip_usage=True)
    pieces = [STREAM[i : i + 7] for i in range(0, len(STREAM), 7)]
    outputs = [reader.feed(piece) for piece in pieces]
    assert all(out == b"" or out.endswith(b"\n\n") for out in outputs)
    joined = b"".join(outputs) + reader.flush()
    assert joined.count(b"\n\n") == 4 and joined.endswith(DONE)
    assert reader.usage is not None


def test_the_role_chunk_is_not_the_first_token() -> None:
    reader = StreamReader(strip_usage=False)
    reader.feed(ROLE)
    assert not reader.has_first_token
    reader.feed(TOKEN)
    assert reader.has_first_token


def test_usage_inside_a_chunk_with_choices_keeps_the_choices() -> None:
    last = {
        "choices": [{"delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
    }
    event = b"data: " + json.dumps(last).encode() + b"\n\n"
    reader = StreamReader(strip_usage=True)
    out = reader.feed(event)
    assert json.loads(out[len(b"data: ") :]) == {"choices": last["choices"]}
    assert reader.usage is not None


def test_a_stream_cut_before_done_is_not_done() -> None:
    reader = StreamReader(strip_usage=False)
    reader.feed(ROLE + TOKEN[:10])
    assert not reader.is_done
    assert reader.flush() == TOKEN[:10]

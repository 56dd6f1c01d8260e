"""Folding a relayed stream into the one non-stream body (gateway/whole.py)."""

from __future__ import annotations

import json

import pytest

from gateway.whole import whole_body


def sse(*payloads: dict[str, object]) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + (
        b"data: [DONE]\n\n"
    )


HEAD = {"id": "cmpl-7", "object": "text_completion", "created": 3, "model": "m"}
USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def logprobs(tokens: list[str], start: int) -> dict[str, object]:
    offsets, at = [], start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [-0.5] * len(tokens),
        "top_logprobs": [{t: -0.5} for t in tokens],
        "text_offset": offsets,
    }


def test_a_completion_is_folded_with_its_logprobs_joined() -> None:
    events = sse(
        {
            **HEAD,
            "choices": [
                {"index": 0, "text": "ab", "logprobs": logprobs(["ab"], 0), "finish_reason": None}
            ],
            "usage": None,
        },
        {
            **HEAD,
            "choices": [
                {"index": 0, "text": "c", "logprobs": logprobs(["c"], 2), "finish_reason": "length"}
            ],
            "usage": None,
        },
        {**HEAD, "choices": [], "usage": USAGE},
    )
    body = json.loads(whole_body(events))
    assert body == {
        **HEAD,
        "choices": [
            {
                "index": 0,
                "text": "abc",
                "logprobs": logprobs(["ab", "c"], 0),
                "finish_reason": "length",
            }
        ],
        "usage": USAGE,
    }


def test_a_chat_stream_becomes_one_message_with_its_logprobs_content() -> None:
    head = {**HEAD, "object": "chat.completion.chunk"}
    entry = {"token": "hi", "logprob": -0.1, "bytes": [104, 105], "top_logprobs": []}
    events = sse(
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "hi"},
                    "logprobs": {"content": [entry]},
                    "finish_reason": None,
                    "token_ids": [5],
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": "stop",
                    "token_ids": [],
                }
            ],
        },
    )
    body = json.loads(whole_body(events))
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": {"content": [entry]},
            "finish_reason": "stop",
            "token_ids": [5],
        }
    ]


@pytest.mark.parametrize("events", [b"", b"data: [DONE]\n\n", b"data: {nope\n\n"])
def test_a_stream_without_a_readable_chunk_is_refused(events: bytes) -> None:
    with pytest.raises(ValueError):
        whole_body(events)


CHAT_HEAD = {**HEAD, "id": "chatcmpl-7", "object": "chat.completion.chunk"}


def chat_chunk(
    index: int, delta: dict[str, object], finish: str | None = None
) -> dict[str, object]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**CHAT_HEAD, "choices": [choice], "usage": None}


def test_interleaved_choices_are_assembled_by_index_with_their_tool_calls() -> None:
    call = {"index": 0, "id": "call_a", "type": "function"}
    events = sse(
        chat_chunk(0, {"role": "assistant", "content": ""}),
        chat_chunk(1, {"role": "assistant", "content": ""}),
        chat_chunk(1, {"content": "Hel"}),
        chat_chunk(0, {"tool_calls": [{**call, "function": {"name": "f", "arguments": ""}}]}),
        chat_chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]}),
        chat_chunk(1, {"content": "lo"}),
        chat_chunk(
            0,
            {
                "tool_calls": [
                    {"index": 0, "function": {"arguments": "1}"}},
                    {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g"}},
                ]
            },
        ),
        chat_chunk(1, {}, "stop"),
        chat_chunk(0, {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}),
        chat_chunk(0, {}, "tool_calls"),
        {**CHAT_HEAD, "choices": [], "usage": USAGE},
    )
    body = json.loads(whole_body(events))
    assert body["object"] == "chat.completion"
    assert body["usage"] == USAGE
    assert body["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "g", "arguments": "{}"},
                    },
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "Hello"},
            "logprobs": None,
            "finish_reason": "stop",
        },
    ]


def test_completions_choices_keep_their_own_text_ids_and_finish() -> None:
    def chunk(index: int, text: str, ids: list[int], finish: str | None) -> dict[str, object]:
        choice = {"index": index, "text": text, "finish_reason": finish, "token_ids": ids}
        return {**HEAD, "choices": [choice], "usage": None}

    events = sse(
        chunk(1, "b", [2], None),
        chunk(0, "a", [1], None),
        chunk(0, "c", [3], "length"),
        chunk(1, "", [], "stop"),
        {**HEAD, "choices": [], "usage": USAGE},
    )
    body = json.loads(whole_body(events))
    assert body["choices"] == [
        {"index": 0, "text": "ac", "finish_reason": "length", "token_ids": [1, 3]},
        {"index": 1, "text": "b", "finish_reason": "stop", "token_ids": [2]},
    ]


def test_a_tool_call_delta_without_an_index_is_refused() -> None:
    events = sse(chat_chunk(0, {"tool_calls": [{"function": {"arguments": "{}"}}]}))
    with pytest.raises(ValueError):
        whole_body(events)

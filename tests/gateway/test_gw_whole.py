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

"""The continuation request: the first request's body, the ids relayed, max_tokens less them."""

from __future__ import annotations

import json

from gateway.proxy import UpstreamRequest
from gateway.resume import continuation_of


def request(body: dict[str, object], max_tokens: int) -> UpstreamRequest:
    return UpstreamRequest(
        "POST", "/v1/chat/completions", json.dumps(body).encode(), {}, True, max_tokens
    )


def test_the_continuation_resumes_after_the_relayed_ids_with_fewer_tokens_left() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hé"}],
        "seed": 3,
        "max_tokens": 10,
        "max_completion_tokens": 10,
        "resume_token_ids": [1],
    }
    continuation = continuation_of(request(body, 10), [5, 6, 7])
    assert continuation is not None and continuation.max_tokens == 7
    assert continuation.body is not None
    sent = json.loads(continuation.body)
    assert sent == {
        **body,
        "max_tokens": 7,
        "max_completion_tokens": 7,
        "resume_token_ids": [1, 5, 6, 7],
    }


def test_nothing_to_continue_when_every_token_was_relayed() -> None:
    assert continuation_of(request({"model": "m", "max_tokens": 2}, 2), [5, 6]) is None


def test_a_stream_broken_before_any_output_starts_afresh() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    continuation = continuation_of(request(body, 4), [])
    assert continuation is not None and continuation.body is not None
    assert json.loads(continuation.body) == body

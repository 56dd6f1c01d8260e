"""What the gateway reads from request bodies, and what it sends upstream."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequestError
from gateway.openai_request import parse_request


def chat(**fields: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}]} | fields
    return json.dumps(body).encode()


def test_chat_without_max_tokens_is_capped_upstream() -> None:
    parsed = parse_request(chat(), "chat", 256)
    assert parsed.max_tokens == 256
    assert json.loads(parsed.upstream_body)["max_tokens"] == 256
    assert parsed.prompt_tokens == (40 + 16) // 4 + 1
    assert parsed.reserved_tokens == parsed.prompt_tokens + 256


def test_unchanged_bodies_go_upstream_byte_for_byte() -> None:
    raw = chat(max_tokens=5)
    assert parse_request(raw, "chat", 256).upstream_body is raw
    raw = chat(max_completion_tokens=7)
    assert parse_request(raw, "chat", 256).max_tokens == 7


def test_streams_ask_upstream_for_usage_but_remember_the_client_did_not() -> None:
    parsed = parse_request(chat(stream=True, max_tokens=5), "chat", 256)
    assert parsed.is_stream and not parsed.wants_usage
    assert json.loads(parsed.upstream_body)["stream_options"] == {"include_usage": True}
    asked = parse_request(
        chat(stream=True, max_tokens=5, stream_options={"include_usage": True}), "chat", 256
    )
    assert asked.wants_usage


def test_completions_default_to_16_tokens_like_openai() -> None:
    raw = json.dumps({"model": "m", "prompt": "abcdefgh"}).encode()
    parsed = parse_request(raw, "completions", 256)
    assert parsed.max_tokens == 16 and parsed.prompt_tokens == 3
    assert parsed.upstream_body is raw
    ids = json.dumps({"model": "m", "prompt": [1, 2, 3, 4, 5]}).encode()
    assert parse_request(ids, "completions", 256).prompt_tokens == 5


def test_the_system_prompt_is_the_affinity_key() -> None:
    def with_system(text: str) -> bytes:
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
        return json.dumps({"model": "m", "messages": messages}).encode()

    a1 = parse_request(with_system("you are A"), "chat", 8).affinity_key
    a2 = parse_request(with_system("you are A"), "chat", 8).affinity_key
    b = parse_request(with_system("you are B"), "chat", 8).affinity_key
    assert a1 == a2 != b and a1 is not None
    assert parse_request(chat(), "chat", 8).affinity_key is None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff",
        b"null",
        chat(model=""),
        chat(messages=[]),
        chat(messages=[{"content": "no role"}]),
        chat(messages=[{"role": "user", "content": 5}]),
        chat(max_tokens=0),
        chat(max_tokens=True),
        chat(stream_options={"include_usage": True}),
    ],
)
def test_malformed_chat_bodies_are_refused(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        parse_request(raw, "chat", 8)

"""What the gateway reads from request bodies, and what it sends upstream."""

from __future__ import annotations

import json
import sys

import pytest

from gateway.errors import InvalidRequestError
from gateway.openai_request import parse_request


def chat(**fields: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}]} | fields
    return json.dumps(body).encode()


def test_chat_without_max_tokens_is_capped_upstream() -> None:
    parsed = parse_request(chat(), "chat", 256)
    assert parsed.max_tokens == 256
    assert json.loads(parsed.upstream_body.encoded)["max_tokens"] == 256
    assert parsed.prompt_tokens == (40 + 16) // 4 + 1
    # Reserved: the prompt's bytes, its role's, and the template's allowances (prompt_estimate.py).
    assert parsed.max_prompt_tokens == 40 + len("user") + 8 + 32
    assert parsed.reserved_tokens == parsed.max_prompt_tokens + 256


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("resumed", [[504] * 6000, [], None])
def test_a_client_may_not_send_the_gateways_resume_field(
    endpoint: str, resumed: list[int] | None
) -> None:
    body: dict[str, object] = {"model": "m", "max_tokens": 5, "resume_token_ids": resumed}
    body |= (
        {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"}
    )
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(json.dumps(body).encode(), endpoint, 8)  # type: ignore[arg-type]
    assert caught.value.status_code == 400 and caught.value.param == "resume_token_ids"


def test_the_reservation_counts_every_choice_of_n() -> None:
    parsed = parse_request(chat(max_tokens=50, n=4), "chat", 256)
    assert parsed.reserved_tokens == parsed.max_prompt_tokens + 4 * 50
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(chat(n=0), "chat", 256)
    assert caught.value.param == "n"


def test_the_reservation_counts_non_ascii_text_by_its_bytes() -> None:
    emoji = "\U0001f600" * 400
    parsed = parse_request(chat(messages=[{"role": "user", "content": emoji}]), "chat", 5)
    assert parsed.max_prompt_tokens >= len(emoji.encode())
    assert parsed.reserved_tokens == parsed.max_prompt_tokens + 5
    raw = json.dumps({"model": "m", "prompt": emoji, "max_tokens": 5}).encode()
    assert parse_request(raw, "completions", 8).max_prompt_tokens >= len(emoji.encode())


def test_other_fields_go_upstream_as_the_client_sent_them() -> None:
    raw = chat(max_tokens=5, temperature=0.5, user="ü", tools=[{"type": "function"}])
    # What the gateway adds to every request: a stream with usage and ids (gateway/whole.py).
    added = {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    upstream = parse_request(raw, "chat", 256).upstream_body
    assert json.loads(upstream.encoded) == json.loads(raw) | added


def test_a_non_stream_goes_upstream_as_a_stream_but_is_remembered_as_one() -> None:
    parsed = parse_request(chat(max_tokens=5, logprobs=True), "chat", 256)
    assert not parsed.is_stream and not parsed.wants_token_ids
    upstream = json.loads(parsed.upstream_body.encoded)
    assert upstream["stream"] is True and upstream["return_token_ids"] is True


@pytest.mark.parametrize(
    ("endpoint", "fields", "reserved"),
    [
        ("completions", {"max_tokens": None}, 16),
        ("completions", {}, 16),
        ("chat", {"max_tokens": None}, 256),
        ("chat", {"max_completion_tokens": None, "max_tokens": None}, 256),
        ("chat", {"max_completion_tokens": 7}, 7),
        ("chat", {"max_completion_tokens": 7, "max_tokens": 900}, 7),
        ("chat", {"max_completion_tokens": None, "max_tokens": 9}, 9),
    ],
)
def test_the_node_is_sent_the_max_tokens_that_was_reserved(
    endpoint: str, fields: dict[str, object], reserved: int
) -> None:
    body: dict[str, object] = {"model": "m", **fields}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    parsed = parse_request(json.dumps(body).encode(), endpoint, 256)  # type: ignore[arg-type]
    assert parsed.max_tokens == reserved
    upstream = json.loads(parsed.upstream_body.encoded)
    assert upstream["max_tokens"] == reserved
    # The node reads max_completion_tokens first: it must not say more than was reserved.
    assert upstream.get("max_completion_tokens", reserved) == reserved


def test_a_duplicate_max_tokens_reaches_the_node_once() -> None:
    raw = b'{"model": "m", "prompt": "x", "max_tokens": 5, "max_tokens": null}'
    upstream = parse_request(raw, "completions", 256).upstream_body.encoded
    assert upstream.count(b"max_tokens") == 1 and json.loads(upstream)["max_tokens"] == 16


def test_streams_ask_upstream_for_usage_but_remember_the_client_did_not() -> None:
    parsed = parse_request(chat(stream=True, max_tokens=5), "chat", 256)
    assert parsed.is_stream and not parsed.wants_usage
    assert json.loads(parsed.upstream_body.encoded)["stream_options"] == {"include_usage": True}
    asked = parse_request(
        chat(stream=True, max_tokens=5, stream_options={"include_usage": True}), "chat", 256
    )
    assert asked.wants_usage


def test_completions_default_to_16_tokens_like_openai() -> None:
    raw = json.dumps({"model": "m", "prompt": "abcdefgh"}).encode()
    parsed = parse_request(raw, "completions", 256)
    assert parsed.max_tokens == 16 and parsed.prompt_tokens == 3
    assert json.loads(parsed.upstream_body.encoded)["max_tokens"] == 16
    ids = json.dumps({"model": "m", "prompt": [1, 2, 3, 4, 5]}).encode()
    assert parse_request(ids, "completions", 256).prompt_tokens == 5
    batch = json.dumps({"model": "m", "prompt": [[1, 2], [3]]}).encode()
    assert parse_request(batch, "completions", 256).prompt_tokens == 3


def test_the_system_prompt_is_the_affinity_key() -> None:
    def with_system(text: str) -> bytes:
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
        return json.dumps({"model": "m", "messages": messages}).encode()

    a1 = parse_request(with_system("you are A"), "chat", 8).affinity_key
    a2 = parse_request(with_system("you are A"), "chat", 8).affinity_key
    b = parse_request(with_system("you are B"), "chat", 8).affinity_key
    assert a1 == a2 != b and a1 is not None
    assert parse_request(chat(), "chat", 8).affinity_key is None
    # Keyed by the tenant's cache salt: another tenant's same prompt is another key.
    t1 = parse_request(with_system("you are A"), "chat", 8, cache_salt="t1").affinity_key
    t2 = parse_request(with_system("you are A"), "chat", 8, cache_salt="t2").affinity_key
    assert len({a1, t1, t2}) == 3
    assert t1 == parse_request(with_system("you are A"), "chat", 8, cache_salt="t1").affinity_key


def test_the_prefix_tokens_run_to_the_end_of_the_system_prompt() -> None:
    system = {"role": "system", "content": "be brief " * 100}  # 900 characters
    user = {"role": "user", "content": "hi " * 200}
    first = parse_request(
        json.dumps({"model": "m", "messages": [system, user]}).encode(), "chat", 8
    )
    assert first.prefix_tokens == 900 // 4 + 4 + 1  # its text, its turn's allowance, the chat's
    assert first.prompt_tokens > first.prefix_tokens + 600 // 4
    # A turn before it is part of the prefix a node caches with it.
    later = [{"role": "user", "content": "x" * 400}, system, user]
    second = parse_request(json.dumps({"model": "m", "messages": later}).encode(), "chat", 8)
    assert second.prefix_tokens == first.prefix_tokens + 400 // 4 + 4
    assert parse_request(chat(), "chat", 8).prefix_tokens == 0
    completion = json.dumps({"model": "m", "prompt": "be brief " * 100}).encode()
    assert parse_request(completion, "completions", 8).prefix_tokens == 0


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "is_constrained"),
    [
        ({}, False),
        ({"response_format": {"type": "text"}}, False),
        ({"response_format": {"type": "json_object"}}, True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, True),
        ({"guided_regex": "[a-z]+"}, True),
        ({"guided_choice": ["yes", "no"]}, True),
        ({"guided_regex": None}, False),
        ({"tools": [TOOL]}, False),
        ({"tools": [TOOL], "tool_choice": "auto"}, False),
        ({"tools": [TOOL], "tool_choice": "required"}, True),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
    ],
)
def test_a_request_whose_output_a_grammar_shapes_is_known_as_constrained(
    fields: dict[str, object], is_constrained: bool
) -> None:
    assert parse_request(chat(**fields), "chat", 8).is_constrained is is_constrained


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
        chat(max_tokens=None, max_completion_tokens="5"),
        b'{"model": "m", "messages": [{"role": "user", "content": NaN}]}',
    ],
)
def test_malformed_chat_bodies_are_refused(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        parse_request(raw, "chat", 8)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "m", "messages": [{"role": "system", "content": "a\\udfff"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "\\ud800"}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
    ],
)
def test_lone_surrogates_are_refused_as_bad_input(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(raw, "chat", 8)
    assert caught.value.status_code == 400


def nested(depth: int, inner: bytes = b"") -> bytes:
    return b"[" * depth + inner + b"]" * depth


@pytest.mark.parametrize(
    ("endpoint", "raw"),
    [
        ("chat", b'{"model": "m", "messages": [{"role": "user"}], "x": %s}' % nested(100_000)),
        pytest.param(
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": %s}]}' % nested(990),
            marks=pytest.mark.skipif(
                sys.version_info >= (3, 12),
                reason="3.12's json parses and encodes 990 levels in C: nothing recurses after",
            ),
        ),
        ("completions", b'{"model": "m", "prompt": %s}' % nested(900, b"1")),
    ],
)
def test_deeply_nested_bodies_are_refused_as_bad_input(endpoint: str, raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        parse_request(raw, endpoint, 8)  # type: ignore[arg-type]

"""Fuzzing the gateway's public API: whatever a client sends (malformed JSON, wrong types, lone
surrogates, deep nesting, odd headers, unknown routes), the answer is never a 5xx, and every
error is in OpenAI's shape. The real gateway over verified HTTPS, fake regions behind it, one
keep-alive client; hypothesis draws the requests (derandomized, so a CI run is repeatable)."""

from __future__ import annotations

import json
import ssl
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from gw_fleet import Fleet, GatewayThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

T = TypeVar("T")
NUM_CASES = 2000
# Heartbeats still come every 0.5 s, but a node counts as gone only after 3 intervals of this:
# on a busy 2-core machine the harness's loop must not lose a region mid-run (a 503 from the
# harness, not the gateway).
HEARTBEAT_INTERVAL_S = 2.0

# Any code point, lone surrogates included (JSON can carry them as \ud800 escapes).
text = st.text(st.characters(codec=None, categories=None), max_size=24)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
counts = st.sampled_from([None, 0, 1, 5, 16, -1, 2**31, 2**64, 1.5, "5", True])
roles = st.sampled_from(["user", "system", "assistant", "developer", "tool"]) | text
content = (
    text
    | st.none()
    | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3)
    | json_values
)
messages = st.lists(
    st.fixed_dictionaries({"role": roles}, optional={"content": content}) | json_values,
    max_size=4,
)
prompts = (
    text
    | st.lists(text, max_size=3)
    | st.lists(st.integers(-5, 2**40), max_size=8)
    | st.lists(st.lists(st.integers(0, 50_000), max_size=4), max_size=3)
    | json_values
)
common_fields = {
    "model": st.sampled_from(["fake-model", ""]) | json_values,
    "max_tokens": counts,
    "max_completion_tokens": counts,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "cache_salt": text,
    "temperature": json_values,
}
chat_bodies = st.fixed_dictionaries({"model": st.just("fake-model"), "messages": messages}).flatmap(
    lambda base: st.fixed_dictionaries({}, optional=common_fields).map(lambda extra: base | extra)
)
completion_bodies = st.fixed_dictionaries(
    {"model": st.just("fake-model"), "prompt": prompts}
).flatmap(
    lambda base: st.fixed_dictionaries({}, optional=common_fields).map(lambda extra: base | extra)
)


def _encode(value: object) -> bytes:
    # ensure_ascii: lone surrogates travel as \udxxx escapes, as a client's JSON may send them.
    return json.dumps(value).encode()


def _nested(depth: int) -> bytes:
    return b'{"model": "fake-model", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def weighted(*choices: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """One of the strategies, picked in proportion to its weight."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


bodies = weighted(
    (4, chat_bodies.map(_encode)),
    (3, completion_bodies.map(_encode)),
    (1, json_values.map(_encode)),
    (1, st.binary(max_size=64)),
    (1, st.sampled_from([1_000, 5_000, 100_000]).map(_nested)),
    (1, text.map(lambda t: t.encode("utf-8", "surrogatepass"))),
)

header_bytes = st.binary(max_size=40).map(
    lambda b: bytes(c for c in b if c == 0x20 or 0x21 <= c <= 0x7E or c >= 0x80).strip()
)
other_routes = st.sampled_from(
    [
        ("GET", "/health"),
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/completions"),
        ("DELETE", "/v1/models"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/chat/completions/../completions"),
    ]
)
any_route = st.tuples(
    st.sampled_from(["GET", "POST", "HEAD", "OPTIONS", "PATCH"]),
    st.from_regex(r"\A/[A-Za-z0-9_.~%/-]{0,40}\Z"),
)
routes = weighted(
    (8, st.just(("POST", "/v1/chat/completions"))),
    (6, st.just(("POST", "/v1/completions"))),
    (1, st.just(("GET", "/v1/models"))),
    (1, other_routes),
    (1, any_route),
)
authorizations = weighted(
    (8, st.just("valid")),
    (1, st.sampled_from([None, "Bearer nope", "Basic x", "Bearer"])),
    (1, header_bytes),
)


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    body: bytes
    authorization: str | bytes | None  # "valid" stands for the test's key
    extra_headers: dict[str, bytes]


cases = st.builds(
    lambda route, body, authorization, extra: Case(route[0], route[1], body, authorization, extra),
    routes,
    bodies,
    authorizations,
    st.dictionaries(
        st.sampled_from(
            ["x-request-id", "x-meridian-cache-salt", "content-type", "content-encoding", "accept"]
        ),
        header_bytes,
        max_size=3,
    ),
)


@pytest.fixture
def fuzz_fleet(tmp_path: Path, server_cert: tuple[Path, Path]) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, server_cert, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)
    try:
        fleet.start_control_plane()
        fleet.add_region("us-east")
        fleet.add_region("eu-west")
        yield fleet
    finally:
        fleet.close()


def assert_openai_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.slow  # fuzzing: seconds of CPU
def test_no_request_makes_the_gateway_answer_5xx(
    fuzz_fleet: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway: GatewayThread = fuzz_fleet.start_gateway()
    fuzz_fleet.wait_for_gateway(gateway)
    _, secret = fuzz_fleet.create_key(rpm=10**9, tpm=10**12)
    statuses: Counter[int] = Counter()

    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, timeout=30.0) as client:

        @settings(
            max_examples=NUM_CASES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(cases)
        def check(case: Case) -> None:
            headers = {name.encode(): value for name, value in case.extra_headers.items()}
            if case.authorization == "valid":
                headers[b"authorization"] = f"Bearer {secret}".encode()
            elif isinstance(case.authorization, str):
                headers[b"authorization"] = case.authorization.encode()
            elif case.authorization is not None:
                headers[b"authorization"] = case.authorization
            content = case.body if case.method not in ("GET", "HEAD", "OPTIONS") else None
            response = client.request(case.method, case.path, content=content, headers=headers)
            statuses[response.status_code] += 1
            assert response.status_code < 500, (case, response.text[:500])
            if response.status_code >= 400 and case.method != "HEAD":
                assert_openai_error(response)

        check()

    assert sum(statuses.values()) >= NUM_CASES, statuses
    # The cases reach every layer: refused early, refused by the node's rules, and served.
    assert statuses[200] > 150 and statuses[400] > 500 and statuses[401] > 50, statuses

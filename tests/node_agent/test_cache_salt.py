"""Prefix-cache partitions over HTTP: the gateway's `x-meridian-cache-salt` header and vLLM's
`cache_salt` body field; requests hit cached blocks only within the same salt."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from node_helpers import MODEL_NAME, NodeHandle

from wire.cache_salt import CACHE_SALT_HEADER as HEADER


@pytest.fixture
def http(node: NodeHandle) -> Iterator[httpx.Client]:
    with node.client() as client:
        yield client


@pytest.fixture
def prompt() -> str:
    """A prompt of several blocks that no other test has cached."""
    return f"Request {uuid.uuid4().hex}: " + "the tenant's long system prompt. " * 12


def cached_tokens(
    http: httpx.Client, prompt: str, header: str | None = None, body_salt: str | None = None
) -> int:
    body: dict[str, object] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    if body_salt is not None:
        body["cache_salt"] = body_salt
    headers = {HEADER: header} if header is not None else {}
    response = http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    count: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return count


def test_the_header_salt_partitions_the_prefix_cache(http: httpx.Client, prompt: str) -> None:
    assert cached_tokens(http, prompt, header="tenant-a") == 0
    hit = cached_tokens(http, prompt, header="tenant-a")
    assert hit >= 64
    assert cached_tokens(http, prompt, header="tenant-b") == 0
    assert cached_tokens(http, prompt) == 0
    assert cached_tokens(http, prompt, header="tenant-b") == hit
    assert cached_tokens(http, prompt) == hit


def test_the_body_salt_partitions_within_the_header_salt(http: httpx.Client, prompt: str) -> None:
    assert cached_tokens(http, prompt, body_salt="user-1") == 0
    assert cached_tokens(http, prompt, body_salt="user-1") > 0
    # The header and body together are a salt of their own: a client choosing a body salt
    # reaches neither another tenant's partition nor the body salt's alone.
    assert cached_tokens(http, prompt, header="tenant-a", body_salt="user-1") == 0
    assert cached_tokens(http, prompt, header="user-1") == 0
    assert cached_tokens(http, prompt, header="tenant-a", body_salt="user-1") > 0


def test_the_official_client_sends_a_salt_as_vllms_extra_body(
    node: NodeHandle, prompt: str
) -> None:
    with openai.OpenAI(base_url=node.base_url + "/v1", api_key="unused", max_retries=0) as client:
        counts = []
        for _ in range(2):
            reply = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=1,
                extra_body={"cache_salt": "tenant-c"},
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            counts.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert counts[0] == 0 and counts[1] is not None and counts[1] >= 64


@pytest.mark.parametrize(
    ("headers", "body_salt", "param"),
    [({HEADER: ""}, None, None), ({HEADER: "x" * 1025}, None, None), ({}, "", "cache_salt")],
    ids=["empty-header", "long-header", "empty-body"],
)
def test_an_empty_or_oversized_salt_is_400(
    http: httpx.Client, headers: dict[str, str], body_salt: str | None, param: str | None
) -> None:
    body: dict[str, object] = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    if body_salt is not None:
        body["cache_salt"] = body_salt
    response = http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "cache_salt" in error["message"] or HEADER in error["message"]

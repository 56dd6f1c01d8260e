"""The client's `X-Request-Id` through a real gateway: echoed and forwarded to the node as sent
only when it is safe ([A-Za-z0-9._:-], at most 128), else replaced by one the gateway mints, the
same in the answer and upstream."""

from __future__ import annotations

import re

import httpx
import pytest
from gw_fleet import Fleet

MINTED = re.compile(r"[0-9a-f]{32}")
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def send(http: httpx.Client, fleet: Fleet, given: bytes) -> tuple[str, str]:
    """The id the client got back, and the one the node was sent."""
    response = http.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": given})
    assert response.status_code == 200, response.text
    [seen] = [s for r in fleet.regions.values() for s in r.upstream.seen]
    return response.headers["x-request-id"], seen.headers["x-request-id"]


@pytest.mark.parametrize("given", ["req-1.2:abc_DEF", "f" * 128])
def test_a_safe_request_id_is_echoed_and_forwarded(
    two_regions: Fleet, http: httpx.Client, given: str
) -> None:
    assert send(http, two_regions, given.encode()) == (given, given)


@pytest.mark.parametrize(
    "given", [b'a"b<script>', b"x" * 129, b"a b", b"caf\xc3\xa9", b"a,b", b"{id}"]
)
def test_an_unsafe_request_id_is_replaced_in_the_answer_and_upstream(
    two_regions: Fleet, http: httpx.Client, given: bytes
) -> None:
    answered, forwarded = send(http, two_regions, given)
    assert MINTED.fullmatch(answered) and forwarded == answered


def test_a_refusal_names_a_safe_id_too(two_regions: Fleet, http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions", content=b"{", headers={"x-request-id": 'a"b<script>'}
    )
    assert response.status_code == 400
    assert MINTED.fullmatch(response.headers["x-request-id"])

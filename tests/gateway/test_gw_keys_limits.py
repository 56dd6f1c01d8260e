"""API keys, per-key rate limits and malformed bodies, through a real gateway."""

from __future__ import annotations

import ssl
import time

import httpx
import pytest
from gw_fleet import Fleet, GatewayThread, wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


def client_for(
    gateway: GatewayThread, client_ssl: ssl.SSLContext, secret: str | None
) -> httpx.Client:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers)


def new_key(fleet: Fleet, gateway: GatewayThread, rpm: int, tpm: int) -> str:
    _, secret = fleet.create_key(rpm=rpm, tpm=tpm)
    return secret


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (None, "missing_api_key"),
        ("Bearer mer-not-a-key", "invalid_api_key"),
        ("Basic abc", "invalid_api_key"),
        ("Bearer", "invalid_api_key"),
    ],
)
def test_bad_keys_get_401(
    gateway: GatewayThread,
    two_regions: Fleet,
    client_ssl: ssl.SSLContext,
    authorization: str | None,
    code: str,
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    with client_for(gateway, client_ssl, None) as http:
        response = http.post("/v1/chat/completions", json=CHAT, headers=headers)
        error = assert_openai_error(response, 401, code)
        assert error["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models", headers=headers).status_code == 401
    assert all(r.upstream.num_requests == 0 for r in two_regions.regions.values())


def test_revoked_key_is_refused_within_seconds(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    key_id, secret = two_regions.create_key()
    with client_for(gateway, client_ssl, secret) as http:
        wait_until(lambda: http.post("/v1/chat/completions", json=CHAT).status_code == 200)
        two_regions.revoke_key(key_id)
        started = time.monotonic()
        while http.post("/v1/chat/completions", json=CHAT).status_code == 200:
            assert time.monotonic() - started < 2.0, "the revoked key still works"
        response = http.post("/v1/chat/completions", json=CHAT)
        assert_openai_error(response, 401, "invalid_api_key")


@pytest.mark.slow  # seconds of waiting on timeouts
def test_requests_per_minute_limit(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    secret = new_key(two_regions, gateway, rpm=3, tpm=1_000_000)
    with client_for(gateway, client_ssl, secret) as http:
        remaining = []
        for _ in range(3):
            response = http.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200
            assert response.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(int(response.headers["x-ratelimit-remaining-requests"]))
        assert remaining == [2, 1, 0]
        refused = http.post("/v1/chat/completions", json=CHAT)
        error = assert_openai_error(refused, 429, "rate_limit_exceeded")
        assert error["type"] == "rate_limit_error" and "RPM" in str(error["message"])
        # One request comes back every 20 s at 3 a minute.
        assert 1 <= int(refused.headers["retry-after"]) <= 20
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-remaining-tokens" in refused.headers
    assert two_regions.regions["us-east"].upstream.num_requests == 3


def test_tokens_per_minute_reserve_then_settle(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    secret = new_key(two_regions, gateway, rpm=1000, tpm=300)
    body = {**CHAT, "max_tokens": 200}
    with client_for(gateway, client_ssl, secret) as http:
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200
        # Admitted with 255 reserved (the prompt's bound, 55, and max_tokens) ...
        remaining = int(first.headers["x-ratelimit-remaining-tokens"])
        assert remaining < 100
        # ... then settled at the 10 tokens really used, so a second one fits.
        second = http.post("/v1/chat/completions", json={**body, "stream": True})
        assert second.status_code == 200 and second.text.endswith("data: [DONE]\n\n")
        assert int(second.headers["x-ratelimit-remaining-tokens"]) >= remaining - 10
        # Two requests reserving 200 each at once cannot both fit; too large never fits.
        too_large = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 400})
        error = assert_openai_error(too_large, 429, "rate_limit_exceeded")
        assert "Request too large" in str(error["message"])
        assert int(too_large.headers["retry-after"]) >= 1


def test_the_token_reservation_counts_every_choice_of_n_then_settles_at_the_usage(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    secret = new_key(two_regions, gateway, rpm=1000, tpm=300)
    with client_for(gateway, client_ssl, secret) as http:
        # 4 choices of 50 and the prompt's bound (55): 255 reserved, within the 300.
        four = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50, "n": 4})
        assert four.status_code == 200
        assert int(four.headers["x-ratelimit-remaining-tokens"]) <= 300 - 55 - 4 * 50
        # Settled at the usage the node reported (10), so the same again fits at once ...
        again = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50, "n": 4})
        assert again.status_code == 200
        # ... while 5 of 50 (305) never fit.
        five = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50, "n": 5})
        error = assert_openai_error(five, 429, "rate_limit_exceeded")
        assert "Request too large" in str(error["message"])
    assert two_regions.regions["us-east"].upstream.seen[-1].body["n"] == 4


def test_token_limit_refuses_until_the_bucket_refills(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    secret = new_key(two_regions, gateway, rpm=1000, tpm=160)
    two_regions.regions["us-east"].upstream.behavior.num_chunks = 100  # all its max_tokens
    body = {**CHAT, "max_tokens": 100}  # 155 reserved, 107 used
    with client_for(gateway, client_ssl, secret) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        refused = http.post("/v1/chat/completions", json=body)
        error = assert_openai_error(refused, 429, "rate_limit_exceeded")
        assert "TPM" in str(error["message"])
        # About 100 tokens short at 2.7 tokens/s.
        assert 30 <= int(refused.headers["retry-after"]) <= 60


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b"[1, 2]", "invalid_request", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "invalid_request", "model"),
        (b'{"model": "m"}', "invalid_request", "messages"),
        (b'{"model": "m", "messages": "hi"}', "invalid_request", "messages"),
        (b'{"model": "m", "messages": [42]}', "invalid_request", "messages[0]"),
        (
            b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": -1}',
            "invalid_request",
            "max_tokens",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}',
            "invalid_request",
            "stream",
        ),
        (
            b'{"model": "m", "messages": [{"role": "system", "content": "\\ud800"}]}',
            "invalid_unicode",
            None,
        ),
        (
            b'{"model": "m", "messages": [{"role": "user"}], "x": %s}'
            % (b"[" * 100_000 + b"]" * 100_000),
            "invalid_json",
            None,
        ),
    ],
)
def test_malformed_bodies_get_400_without_reaching_upstream(
    two_regions: Fleet, http: httpx.Client, body: bytes, code: str, param: str | None
) -> None:
    response = http.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    error = assert_openai_error(response, 400, code)
    assert error["param"] == param
    assert all(r.upstream.num_requests == 0 for r in two_regions.regions.values())


def test_completions_need_a_prompt(two_regions: Fleet, http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": "m"})
    assert_openai_error(response, 400, "invalid_request")


def test_oversized_body_is_413(two_regions: Fleet, http: httpx.Client) -> None:
    content = "x" * (4 * 1024 * 1024 + 1)
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    response = http.post("/v1/chat/completions", json=body)
    assert_openai_error(response, 413, "body_too_large")


def test_unknown_route_is_openai_404(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nope"), 404, "route_not_found")

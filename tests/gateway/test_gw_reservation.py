"""What a request costs its key, through a real gateway: the prompt reserved at its upper bound
(UTF-8 bytes), and no client-made continuation that would smuggle a prompt past the estimate."""

from __future__ import annotations

import ssl

import pytest
from gw_fleet import Fleet, GatewayThread
from test_gw_keys_limits import assert_openai_error, client_for, new_key

EMOJI = "\U0001f600" * 400  # 1,600 bytes; SmolLM2 makes 1,230 tokens of it in a chat
REAL_EMOJI_CHAT_TOKENS = 1230


def body_for(path: str, prompt: str, **fields: object) -> dict[str, object]:
    if path == "/v1/chat/completions":
        return {"model": "fake-model", "messages": [{"role": "user", "content": prompt}], **fields}
    return {"model": "fake-model", "prompt": prompt, **fields}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_client_resume_token_ids_are_refused_before_admission(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext, path: str
) -> None:
    """The probe's request: 6,000 resumed ids on a 200 TPM key got 6,036 tokens of work."""
    secret = new_key(two_regions, gateway, rpm=2, tpm=200)
    refused = body_for(path, "hi", max_tokens=5, resume_token_ids=[504] * 6000)
    with client_for(gateway, client_ssl, secret) as http:
        for fields in (refused, {**refused, "resume_token_ids": None}):
            response = http.post(path, json=fields)
            error = assert_openai_error(response, 400, "invalid_request")
            assert error["param"] == "resume_token_ids"
            assert "x-ratelimit-remaining-requests" not in response.headers
        # Neither refusal took a request or a token from the key.
        served = http.post(path, json=body_for(path, "hi", max_tokens=5))
        assert served.status_code == 200, served.text
        assert served.headers["x-ratelimit-remaining-requests"] == "1"
    seen = [s for region in two_regions.regions.values() for s in region.upstream.seen]
    assert len(seen) == 1 and "resume_token_ids" not in seen[0].body


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_emoji_prompt_over_a_small_budget_is_too_large(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext, path: str
) -> None:
    """Counted by characters it was ~104 tokens and got in; it is 1,230."""
    secret = new_key(two_regions, gateway, rpm=100, tpm=1000)
    with client_for(gateway, client_ssl, secret) as http:
        response = http.post(path, json=body_for(path, EMOJI, max_tokens=5))
    error = assert_openai_error(response, 429, "rate_limit_exceeded")
    assert "Request too large" in str(error["message"]) and "Limit 1000" in str(error["message"])
    assert "UTF-8 byte" in str(error["message"])
    assert int(response.headers["retry-after"]) >= 1
    assert all(r.upstream.num_requests == 0 for r in two_regions.regions.values())


def test_an_emoji_prompt_reserves_at_least_what_the_node_will_count(
    gateway: GatewayThread, two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    """Reserved up front, the prompt's bound and max_tokens cover what the node will count, so
    the settle has nothing to charge beyond the reservation."""
    tpm, max_tokens = 2000, 5
    secret = new_key(two_regions, gateway, rpm=100, tpm=tpm)
    path = "/v1/chat/completions"
    with client_for(gateway, client_ssl, secret) as http:
        response = http.post(path, json=body_for(path, EMOJI, max_tokens=max_tokens))
    assert response.status_code == 200, response.text
    reserved = tpm - int(response.headers["x-ratelimit-remaining-tokens"])
    assert reserved >= REAL_EMOJI_CHAT_TOKENS + max_tokens

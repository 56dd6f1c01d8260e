"""The OpenAI API through the gateway, over verified HTTPS, against fake regions: passthrough,
streaming, request ids, usage handling and failures mid-stream."""

from __future__ import annotations

import itertools
import json
import ssl
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from gw_fleet import Fleet, GatewayThread, wait_until

from gateway.cache_salt import cache_salt_of
from wire.cache_salt import CACHE_SALT_HEADER

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def client(
    gateway: GatewayThread, http: httpx.Client, api_key: str, client_ssl: ssl.SSLContext
) -> Iterator[openai.OpenAI]:
    """The official openai client, verifying the gateway's certificate, no retries."""
    with openai.OpenAI(
        base_url=gateway.base_url + "/v1",
        api_key=api_key,
        max_retries=0,
        http_client=httpx.Client(verify=client_ssl, timeout=30.0),
    ) as client:
        yield client


def sse_events(body: str) -> list[str]:
    return [line.removeprefix("data: ") for line in body.split("\n\n") if line.strip()]


def test_openai_client_chat_over_verified_https(two_regions: Fleet, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "t0 t1 t2 "
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert raw.headers["x-meridian-region"] == "us-east"
    seen = two_regions.regions["us-east"].upstream.seen[-1]
    assert seen.headers["x-request-id"] == raw.headers["x-request-id"]
    assert seen.body["max_tokens"] == 5


def test_openai_client_streams_without_usage_it_did_not_ask_for(
    two_regions: Fleet, client: openai.OpenAI
) -> None:
    stream = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t0 t1 t2 "
    assert all(c.usage is None and c.choices for c in chunks)
    # Upstream was asked for usage (to settle the reservation), and capped.
    seen = two_regions.regions["us-east"].upstream.seen[-1].body
    assert seen["stream_options"] == {"include_usage": True}
    assert seen["max_tokens"] == 1024


def test_openai_client_stream_with_usage_gets_it(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="fake-model",
        prompt="once upon",
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "t0 t1 "
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2


@pytest.mark.slow  # seconds of waiting on timeouts
def test_stream_is_relayed_chunk_by_chunk(two_regions: Fleet, http: httpx.Client) -> None:
    behavior = two_regions.regions["us-east"].upstream.behavior
    behavior.num_chunks, behavior.chunk_delay_s = 4, 0.15
    arrivals: list[float] = []
    body = {**CHAT, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"t' in line:
                arrivals.append(time.monotonic())
    assert len(arrivals) == 4
    # Each token arrives about when the node made it, not all together at the end.
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) > 0.1, gaps


def test_usage_inside_the_last_choice_is_removed_not_the_choice(
    two_regions: Fleet, http: httpx.Client
) -> None:
    two_regions.regions["us-east"].upstream.behavior.put_usage_in_last_choice = True
    response = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "stop" and "usage" not in last


def test_request_id_from_the_client_goes_upstream_and_back(
    two_regions: Fleet, http: httpx.Client
) -> None:
    response = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "abc-123"
    assert two_regions.regions["us-east"].upstream.seen[-1].headers["x-request-id"] == "abc-123"
    invalid = http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "a b"})
    assert invalid.headers["x-request-id"] not in ("", "a b")


def test_models_are_listed_and_completions_pass_through(http: httpx.Client) -> None:
    models = http.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    response = http.post("/v1/completions", json={"model": "fake-model", "prompt": "a"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "t0 t1 t2 "


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_errors_caused_by_the_request_neither_fail_over_nor_open_the_breaker(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client, status: int
) -> None:
    upstream = two_regions.regions["us-east"].upstream
    upstream.behavior.fail_status = status
    num_requests = gateway.settings.breaker_failures + 2
    for _ in range(num_requests):
        response = http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == status
        assert response.json()["error"]["code"] == "fake"
    assert upstream.num_requests == num_requests  # never skipped for an open breaker
    assert two_regions.regions["eu-west"].upstream.num_requests == 0
    assert gateway.handlers.router.regions["us-east"].breaker.state == "closed"
    state = gateway.handlers.router.regions["us-east"]
    assert (state.num_awaiting_first_byte, state.awaited_tokens) == (0, 0)


def new_key(fleet: Fleet, gateway: GatewayThread) -> tuple[str, str]:
    return fleet.create_key()


def test_the_node_sees_the_max_tokens_the_gateway_reserved(
    two_regions: Fleet, http: httpx.Client
) -> None:
    upstream = two_regions.regions["us-east"].upstream
    completion = {"model": "fake-model", "prompt": "once", "max_tokens": None}
    assert http.post("/v1/completions", json=completion).status_code == 200
    assert upstream.seen[-1].body["max_tokens"] == 16  # OpenAI's default, as reserved
    chat = {**CHAT, "max_tokens": None, "max_completion_tokens": 7}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    seen = upstream.seen[-1].body
    assert seen["max_tokens"] == seen["max_completion_tokens"] == 7
    streamed = http.post("/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": None})
    assert streamed.status_code == 200 and upstream.seen[-1].body["max_tokens"] == 1024


def test_nodes_get_the_serving_token_and_never_the_clients_key(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    serving_token = "srv-" + "s" * 30
    gateway = two_regions.start_gateway(serving_token=serving_token)
    two_regions.wait_for_gateway(gateway)
    _, secret = new_key(two_regions, gateway)
    upstream = two_regions.regions["us-east"].upstream
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        completion = {"model": "fake-model", "prompt": "a"}
        assert http.post("/v1/completions", json=completion).status_code == 200
    assert len(upstream.seen) == 2
    for seen in upstream.seen:
        assert seen.headers["authorization"] == f"Bearer {serving_token}"
        assert secret not in str(seen.headers)


def test_without_a_serving_token_no_authorization_goes_upstream(
    two_regions: Fleet, http: httpx.Client, api_key: str
) -> None:
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert http.get("/v1/models").status_code == 200
    for seen in two_regions.regions["us-east"].upstream.seen:
        assert "authorization" not in seen.headers
        assert api_key not in str(seen.headers)


def test_each_key_gets_its_own_prefix_cache_salt_whatever_the_client_sends(
    two_regions: Fleet, gateway: GatewayThread, client_ssl: ssl.SSLContext
) -> None:
    upstream = two_regions.regions["us-east"].upstream
    salts: dict[str, set[str]] = {}
    for _ in range(2):
        key_id, secret = new_key(two_regions, gateway)
        headers = {"Authorization": f"Bearer {secret}", CACHE_SALT_HEADER: "chosen-by-client"}
        body = {**CHAT, "cache_salt": "also-chosen-by-client"}
        with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
            for _ in range(2):
                assert http.post("/v1/chat/completions", json=body).status_code == 200
        seen = upstream.seen[-2:]
        salts[key_id] = {s.headers[CACHE_SALT_HEADER] for s in seen}
        assert all("cache_salt" not in s.body for s in seen)
    assert [len(s) for s in salts.values()] == [1, 1]  # one salt per key ...
    assert len(set.union(*salts.values())) == 2  # ... and keys apart
    for key_id, salt in salts.items():
        assert salt == {cache_salt_of(key_id)} and len(cache_salt_of(key_id)) == 32


def test_an_operator_may_let_keys_share_prefix_caches(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway = two_regions.start_gateway(share_prefix_cache=True)
    two_regions.wait_for_gateway(gateway)
    _, secret = new_key(two_regions, gateway)
    headers = {"Authorization": f"Bearer {secret}", CACHE_SALT_HEADER: "chosen-by-client"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    seen = two_regions.regions["us-east"].upstream.seen[-1]
    assert CACHE_SALT_HEADER not in seen.headers


def test_health_and_metrics(gateway: GatewayThread, http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json=CHAT)
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json()["regions"]["us-east"]["breaker"] == "closed"
    metrics = httpx.get(gateway.metrics_url).text
    assert 'meridian_gateway_requests_total{region="us-east",status="200"}' in metrics
    assert "meridian_gateway_routing_decisions_total" in metrics
    assert "meridian_gateway_upstream_ttft_seconds_bucket" in metrics


def test_a_client_leaving_mid_stream_stops_the_upstream_and_settles(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client
) -> None:
    upstream = two_regions.regions["us-east"].upstream
    upstream.behavior.num_chunks, upstream.behavior.chunk_delay_s = 50, 0.05
    state = gateway.handlers.router.regions["us-east"]
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        # Held, so that leaving the loop does not close the iterator (and with it the stream).
        lines = response.iter_lines()
        for line in lines:
            if '"content":"t0 "' in line:
                break  # leave after the first token
        # Streaming: in flight, but past its first byte (no queue of ours there for routing).
        assert (state.num_in_flight, state.num_awaiting_first_byte) == (1, 0)
    wait_until(lambda: state.num_in_flight == 0, what="the stream to be abandoned")
    assert (state.num_awaiting_first_byte, state.awaited_tokens) == (0, 0)
    wait_until(lambda: upstream.num_abandoned == 1, what="the upstream to be closed")
    metrics = httpx.get(gateway.metrics_url).text
    assert 'region="us-east",status="499"' in metrics

"""Region choice and failover through a real gateway, with RTTs made real by delaying forwarders
and load reported through real heartbeats."""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import Counter

import httpx
import pytest
from gw_fleet import Fleet, GatewayThread, wait_until

from wire.deflection import ALTERNATIVE_HEADER

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}
MAX_LOAD_S = 10.0


def served_by(http: httpx.Client, body: dict[str, object] = CHAT) -> str:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.headers["x-meridian-region"]


def test_nearer_region_serves_when_both_are_idle(two_regions: Fleet, http: httpx.Client) -> None:
    assert two_regions.regions["us-east"].rtt_ms < 10 < two_regions.regions["eu-west"].rtt_ms
    assert {served_by(http) for _ in range(10)} == {"us-east"}
    assert two_regions.regions["eu-west"].upstream.num_requests == 0


@pytest.mark.slow  # seconds of waiting on timeouts
def test_farther_region_serves_once_the_nearer_is_loaded(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client
) -> None:
    assert served_by(http) == "us-east"
    # 5,000 prompt tokens waiting at 1,000 tokens/s: about 5 s of queue, far more than 50 ms.
    two_regions.regions["us-east"].load.num_waiting_prefill_tokens = 5000
    router = gateway.handlers.router
    wait_until(
        lambda: router.regions["us-east"].summary.queue.expected_queue_delay_s > 1.0,
        what="the load to reach the gateway",
    )
    assert {served_by(http) for _ in range(5)} == {"eu-west"}
    two_regions.regions["us-east"].load.num_waiting_prefill_tokens = 0
    wait_until(lambda: router.regions["us-east"].summary.queue.expected_queue_delay_s == 0.0)
    assert served_by(http) == "us-east"


def test_the_router_learns_the_node_s_prefix_cache_hits_from_the_stream_s_usage(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client
) -> None:
    # The node says 40,000 prompt tokens were cached: 10 s of prefill at the gateway's assumed
    # 4,000 tokens/s that the prediction charged and the stream never waited for. The residual
    # is taken against the prediction less them, so it reads about +10 s (the hits reached the
    # router through the real SSE path); without them it would be near 0.
    two_regions.regions["us-east"].upstream.behavior.cached_tokens = 40_000
    east = gateway.handlers.router.regions["us-east"]
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert response.status_code == 200
        response.read()
    wait_until(lambda: east.num_ttft_samples == 1, what="the stream's TTFT to reach the router")
    prefill_s = 40_000 / gateway.handlers.router.config.prefill_tokens_per_s
    assert abs(east.ttft_residual_s - prefill_s) < 1.0


def test_a_stream_a_grammar_constrains_does_not_teach_the_router(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client
) -> None:
    # Its TTFT holds the node's compile of the grammar: the region is not slower for it.
    east = gateway.handlers.router.regions["us-east"]
    registry = gateway.handlers.metrics.registry
    count = "meridian_gateway_upstream_ttft_seconds_count"
    streams = {"region": "us-east", "kind": "stream"}

    def num_streams_timed() -> float:
        return registry.get_sample_value(count, streams) or 0

    def stream(body: dict[str, object]) -> None:
        timed = num_streams_timed()
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            response.read()
        wait_until(lambda: num_streams_timed() > timed, what="the stream's TTFT measured")

    stream({**CHAT, "stream": True, "response_format": {"type": "json_object"}})
    assert east.num_ttft_samples == 0
    stream({**CHAT, "stream": True})
    assert east.num_ttft_samples == 1


def test_draining_a_region_moves_new_traffic_within_a_second(
    two_regions: Fleet, http: httpx.Client
) -> None:
    assert served_by(http) == "us-east"
    started = time.monotonic()
    two_regions.set_region_state("us-east", "draining")
    while served_by(http) != "eu-west":
        assert time.monotonic() - started < 1.0, "traffic still goes to the draining region"
    assert time.monotonic() - started < 1.0
    assert {served_by(http) for _ in range(5)} == {"eu-west"}


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_node_draining_itself_gets_no_new_work(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client
) -> None:
    two_regions.regions["us-east"].load.draining = True
    router = gateway.handlers.router
    wait_until(lambda: router.regions["us-east"].summary.healthy_nodes == 0, 3.0)
    assert served_by(http) == "eu-west"


async def _load(
    base_url: str,
    headers: dict[str, str],
    verify: ssl.SSLContext,
    num_requests: int,
    concurrency: int,
    on_progress: asyncio.Event,
) -> list[int]:
    """`num_requests` non-streamed requests, `concurrency` at a time, bounded by MAX_LOAD_S."""
    statuses: list[int] = []
    queue = iter(range(num_requests))
    deadline = time.monotonic() + MAX_LOAD_S

    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, verify=verify, timeout=MAX_LOAD_S
    ) as client:

        async def worker() -> None:
            for _ in queue:
                if time.monotonic() > deadline:
                    return
                response = await client.post("/v1/chat/completions", json=CHAT)
                statuses.append(response.status_code)
                if len(statuses) >= num_requests // 4:
                    on_progress.set()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


@pytest.mark.slow  # seconds of waiting on timeouts
def test_killing_a_region_under_load_loses_no_request(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client, client_ssl: ssl.SSLContext
) -> None:
    num_requests = 200
    # Each request spends 100 ms at us-east, so several are in flight there when it dies.
    two_regions.regions["us-east"].upstream.behavior.delay_s = 0.1

    async def run() -> list[int]:
        progress = asyncio.Event()
        load = asyncio.create_task(
            _load(gateway.base_url, dict(http.headers), client_ssl, num_requests, 8, progress)
        )
        await asyncio.wait_for(progress.wait(), MAX_LOAD_S)
        await asyncio.to_thread(two_regions.kill_region, "us-east")
        return await load

    statuses = asyncio.run(run())
    assert len(statuses) == num_requests
    assert Counter(statuses) == {200: num_requests}
    assert two_regions.regions["eu-west"].upstream.num_requests > 0
    metrics = httpx.get(gateway.metrics_url).text
    retried = re.findall(
        r'meridian_gateway_retries_total\{cause="\w+",region="us-east"\} (\d+)', metrics
    )
    # One cut before its first chunk fails over; one cut mid-generation resumes (whole.py).
    resumed = re.findall(
        r'meridian_gateway_stream_resumes_total\{from_region="us-east",to_region="eu-west"\} '
        r"(\d+)",
        metrics,
    )
    num_cut = sum(float(n) for n in retried + resumed)
    assert num_cut >= 1, "no request was in flight at the kill"


def test_5xx_and_429_before_the_first_byte_fail_over(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client
) -> None:
    upstream = two_regions.regions["us-east"].upstream
    upstream.behavior.fail_status = 500
    assert served_by(http) == "eu-west"
    upstream.behavior.fail_status = 429
    assert served_by(http) == "eu-west"
    streamed = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert streamed.headers["x-meridian-region"] == "eu-west"
    assert streamed.text.endswith("data: [DONE]\n\n")
    metrics = httpx.get(gateway.metrics_url).text
    assert 'meridian_gateway_retries_total{cause="500",region="us-east"} 1.0' in metrics
    router = gateway.handlers.router
    for state in router.regions.values():
        assert (state.num_awaiting_first_byte, state.awaited_tokens) == (0, 0)


def test_a_region_that_sends_the_first_attempt_back_keeps_its_breaker_and_is_asked_last(
    two_regions: Fleet, gateway: GatewayThread, http: httpx.Client
) -> None:
    us_east, eu_west = (two_regions.regions[r].upstream for r in ("us-east", "eu-west"))
    us_east.behavior.deflects = "told"
    for _ in range(4):  # two failures would open its breaker; deflections are none
        assert served_by(http) == "eu-west"
        # Told what eu-west costs; eu-west, the failover, is told nothing.
        told = us_east.seen[-1].headers[ALTERNATIVE_HEADER]
        assert float(told) > two_regions.regions["eu-west"].rtt_ms / 1000
        assert ALTERNATIVE_HEADER not in eu_west.seen[-1].headers
    router = gateway.handlers.router
    assert router.regions["us-east"].breaker.state == "closed"
    metrics = httpx.get(gateway.metrics_url).text
    assert 'meridian_gateway_retries_total{cause="deflected",region="us-east"} 4.0' in metrics
    # With nowhere else to go, the region that sent the request back takes it, asked again
    # without an alternative.
    eu_west.behavior.fail_status = 500
    assert served_by(http) == "us-east"
    assert ALTERNATIVE_HEADER not in us_east.seen[-1].headers
    assert ALTERNATIVE_HEADER in us_east.seen[-2].headers
    for state in router.regions.values():
        assert (state.num_awaiting_first_byte, state.awaited_tokens) == (0, 0)
    # A region that sends back what it was not told an alternative for is refusing it: a 429
    # like any other, and the request does not go round again.
    us_east.behavior.deflects = "all"
    num_seen = len(us_east.seen)
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 429 and response.json()["error"]["code"] == "deflected"
    assert len(us_east.seen) == num_seen + 2


def test_when_every_region_fails_the_last_answer_is_returned(
    two_regions: Fleet, http: httpx.Client
) -> None:
    for region in two_regions.regions.values():
        region.upstream.behavior.fail_status = 429
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "fake"


def test_a_slow_first_byte_fails_over_for_streams(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway = two_regions.start_gateway(first_byte_timeout_s=0.3)
    two_regions.wait_for_gateway(gateway)
    _, secret = two_regions.create_key()
    two_regions.regions["us-east"].upstream.behavior.delay_s = 2.0
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        started = time.monotonic()
        response = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert response.headers["x-meridian-region"] == "eu-west"
        assert time.monotonic() - started < 1.5


def test_the_last_region_is_waited_on_past_the_first_byte_timeout_while_it_is_healthy(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway = two_regions.start_gateway(first_byte_timeout_s=0.3)
    two_regions.wait_for_gateway(gateway)
    _, secret = two_regions.create_key()
    for region in two_regions.regions.values():  # both slower than the timeout
        region.upstream.behavior.delay_s = 1.0
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        response = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    # us-east timed out and was failed over; eu-west, the last to try, was waited on.
    assert response.status_code == 200 and response.headers["x-meridian-region"] == "eu-west"
    assert response.text.rstrip().endswith("data: [DONE]")
    assert [r.upstream.num_requests for r in two_regions.regions.values()] == [1, 1]


@pytest.mark.slow  # seconds of waiting on heartbeats
def test_the_last_region_is_given_up_on_once_it_shows_no_healthy_node(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway = two_regions.start_gateway(
        first_byte_timeout_s=0.3, unhealthy_node_silence_s=0.2, request_deadline_s=60.0
    )
    two_regions.wait_for_gateway(gateway)
    _, secret = two_regions.create_key()
    for region in two_regions.regions.values():  # accept and read, never answer: hung
        region.upstream.behavior.delay_s = 3600.0
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(
        base_url=gateway.base_url, verify=client_ssl, headers=headers, timeout=60.0
    ) as http:
        started_s = time.monotonic()
        two_regions.regions["eu-west"].is_beating = False  # hung with its heartbeats
        response = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        took_s = time.monotonic() - started_s
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"
    assert took_s < 15.0  # the control plane's view, not the deadline's 60 s
    assert gateway.handlers.router.regions["eu-west"].summary.healthy_nodes == 0


@pytest.mark.slow  # seconds of waiting on timeouts
def test_circuit_breaker_stops_trying_a_failing_region_then_probes_it(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    gateway = two_regions.start_gateway(breaker_failures=2, breaker_open_s=0.5)
    two_regions.wait_for_gateway(gateway)
    _, secret = two_regions.create_key()
    upstream = two_regions.regions["us-east"].upstream
    upstream.behavior.fail_status = 500
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        for _ in range(5):
            assert served_by(http) == "eu-west"
        assert upstream.num_requests == 2  # open after two failures
        upstream.behavior.fail_status = None
        breaker = gateway.handlers.router.regions["us-east"].breaker
        wait_until(lambda: breaker.is_available(time.monotonic()), 5.0, "the breaker's open time")
        assert served_by(http) == "us-east"  # the half-open probe succeeds
        assert breaker.state == "closed"


def test_two_near_regions_share_concurrent_load(fleet: Fleet, client_ssl: ssl.SSLContext) -> None:
    fleet.add_region("us-east")
    fleet.add_region("toronto")  # about 7.5 ms from New York: within the tolerance of the best
    for region in fleet.regions.values():
        region.upstream.behavior.delay_s = 0.1
    gateway = fleet.start_gateway()
    fleet.wait_for_gateway(gateway)
    _, secret = fleet.create_key()

    async def burst() -> Counter[str]:
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(
            base_url=gateway.base_url, headers=headers, verify=client_ssl, timeout=10.0
        ) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=CHAT) for _ in range(16))
            )
        return Counter(r.headers["x-meridian-region"] for r in responses)

    regions = asyncio.run(burst())
    assert set(regions) == {"us-east", "toronto"}, regions


def test_same_system_prompt_sticks_to_one_region(fleet: Fleet, client_ssl: ssl.SSLContext) -> None:
    fleet.add_region("us-east")
    fleet.add_region("toronto")
    gateway = fleet.start_gateway()
    fleet.wait_for_gateway(gateway)
    _, secret = fleet.create_key()
    headers = {"Authorization": f"Bearer {secret}"}

    def body(system: str) -> dict[str, object]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
        return {"model": "fake-model", "messages": messages}

    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        choices = {
            f"prompt {i}": {served_by(http, body(f"prompt {i}")) for _ in range(3)}
            for i in range(12)
        }
    assert all(len(regions) == 1 for regions in choices.values()), choices
    assert set().union(*choices.values()) == {"us-east", "toronto"}

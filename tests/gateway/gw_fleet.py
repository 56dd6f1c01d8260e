"""The gateway's test harness: a real control plane, fake regions (a fast OpenAI-speaking upstream
behind a TCP forwarder that delays bytes by the simulated RTT from the PoP, registered through
real heartbeats) and real gateways, all on 127.0.0.1.

The control plane, the fakes and the forwarders share one background event loop; each gateway
runs under uvicorn on its own thread and loop, as it would in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import bounded_wait
import httpx
import plain_http
import uvicorn
import uvloop
from gw_fakes import DelayProxy, FakeUpstream

from control_plane.app import create_app as create_control_plane
from control_plane.settings import Settings as ControlPlaneSettings
from gateway.api import Handlers
from gateway.app import HANDLERS, create_app
from gateway.errors import GatewayError
from gateway.server import GatewayServer
from gateway.settings import GatewaySettings
from gateway.tls import server_context
from wire.connection_guard import bind_socket
from wire.geo import locate, rtt_ms

T = TypeVar("T")
POP = "new-york"
MAX_START_S = 20.0
MAX_KEY_S = 10.0  # a new key reaching a running gateway, on a loaded machine
# What fake nodes serve unless a test says otherwise, and the weights they report for it.
FAKE_MODEL = "fake-model"
FAKE_WEIGHTS = "f" * 32
# Fake nodes beat every 0.5 s (unhealthy after 1.5 s): fast for tests, with room for this
# harness's loop to stall on a busy 2-core machine without regions flapping (at 0.25 s, a
# stall of 0.8 s during a full CI run once took both regions out of routing).
HEARTBEAT_INTERVAL_S = 0.5


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll until `predicate()` holds (tests/bounded_wait.py), every 10 ms: the harness's waits
    are on servers of its own, which answer within milliseconds."""
    bounded_wait.wait_until(predicate, timeout_s, what or repr(predicate), interval_s=0.01)


class BackgroundLoop:
    """An asyncio loop on its own thread, for the harness's servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gw-harness")
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout_s: float = 30.0) -> T:
        async def wrapper() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@dataclass
class Tokens:
    admin: str = field(default_factory=lambda: "adm-" + secrets.token_urlsafe(24))
    gateway: str = field(default_factory=lambda: "gw-" + secrets.token_urlsafe(24))
    node: dict[str, str] = field(default_factory=dict)  # each node's own, minted by node id


@dataclass
class Load:
    """What a fake region's heartbeats report."""

    num_waiting: int = 0
    num_waiting_prefill_tokens: int = 0
    decode_tokens_per_s: float = 1000.0
    kv_blocks_free: int = 1000
    draining: bool = False


@dataclass
class FakeRegion:
    name: str
    upstream: FakeUpstream
    proxy: DelayProxy
    rtt_ms: float
    load: Load = field(default_factory=Load)
    model: str = FAKE_MODEL  # what its nodes serve, under this name
    weights_id: str = FAKE_WEIGHTS  # and the weights they report serving it with
    # What its nodes report serving it as, whole (None: `weights_id` in fp32, unquantized).
    model_identity: dict[str, object] | None = None
    is_beating: bool = True  # the upstream's node
    # More nodes of the region, by id, that beat (at the same URL and load) while True.
    spare_nodes: dict[str, bool] = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        """The upstream's node: the one that beats while `is_beating`."""
        return self.upstream.node_id

    def beating_nodes(self) -> list[str]:
        spares = [node_id for node_id, is_beating in self.spare_nodes.items() if is_beating]
        return [self.node_id, *spares] if self.is_beating else spares


class GatewayThread:
    """A gateway (create_app + GatewayServer) on its own thread and event loop."""

    def __init__(self, settings: GatewaySettings, cert: tuple[Path, Path] | None) -> None:
        self.settings = settings
        metrics_sock = bind_socket("127.0.0.1", 0)
        self.metrics_url = f"http://127.0.0.1:{metrics_sock.getsockname()[1]}/metrics"
        self.app = create_app(settings, metrics_sock)
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        context = server_context(*cert) if cert is not None else None
        self.server = GatewayServer(self.app, sock, context, settings)
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gateway")
        scheme = "https" if cert is not None else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self._loop.run_until_complete(self.server.serve())
        self._loop.close()

    @property
    def handlers(self) -> Handlers:
        return self.app[HANDLERS]

    def start(self) -> None:
        self._thread.start()
        wait_until(lambda: self.server.is_started, MAX_START_S, "the gateway to start")

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self.server.stop)
        self._thread.join(timeout=10)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def holds_key(self, secret: str) -> bool:
        try:
            self.handlers.keys.authenticate(f"Bearer {secret}")
        except GatewayError:
            return False
        return True


class Fleet:
    """One control plane, fake regions, gateways; everything stopped by `close()`."""

    def __init__(
        self,
        tmp_path: Path,
        cert: tuple[Path, Path] | None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        missed_beats: int = 3,
    ) -> None:
        self.tmp_path = tmp_path
        self.heartbeat_interval_s = heartbeat_interval_s
        self.missed_beats = missed_beats
        self.proxies: list[DelayProxy] = []
        self.cert = cert
        self.tokens = Tokens()
        self.loop = BackgroundLoop()
        self.regions: dict[str, FakeRegion] = {}
        self.gateways: list[GatewayThread] = []
        self._cp_server: uvicorn.Server | None = None
        self._cp_task: asyncio.Future[None] | None = None
        self._beats: asyncio.Task[None] | None = None
        self._beat_now = asyncio.Event()  # on self.loop: a region was added, beat without waiting
        self.cp_url = ""
        self.admin: httpx.Client | None = None

    # Control plane.

    def start_control_plane(self) -> None:
        settings = ControlPlaneSettings(
            db_path=str(self.tmp_path / "cp.db"),
            admin_token=self.tokens.admin,
            gateway_token=self.tokens.gateway,
            heartbeat_interval_s=self.heartbeat_interval_s,
            missed_beats=self.missed_beats,
            sweep_interval_s=0.05,
            xds_port=0,
            dns_port=0,
        )
        sock = bind_socket("127.0.0.1", 0)
        self.cp_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            create_control_plane(settings),
            log_level="warning",
            log_config=None,
            access_log=False,
            # Gateways' long polls are left waiting at the end: do not wait for them.
            timeout_graceful_shutdown=0.05,  # type: ignore[arg-type]
        )
        self._cp_server = uvicorn.Server(config)
        server = self._cp_server
        self._cp_task = asyncio.run_coroutine_threadsafe(  # type: ignore[assignment]
            server.serve(sockets=[sock]), self.loop.loop
        )
        wait_until(lambda: server.started, MAX_START_S, "the control plane to start")
        self.attach_control_plane(self.cp_url)

    def attach_control_plane(self, url: str) -> None:
        """Use the control plane at `url` (started elsewhere, with `self.tokens`): admin calls
        and the fake nodes' heartbeats go there."""
        self.cp_url = url
        self.admin = plain_http.client(
            base_url=self.cp_url,
            headers={"Authorization": f"Bearer {self.tokens.admin}"},
            timeout=10.0,
        )
        self._beats = self.loop.run(self._start_beats())

    async def _start_beats(self) -> asyncio.Task[None]:
        return asyncio.create_task(self._beat_forever())

    async def _beat_forever(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                for region in list(self.regions.values()):
                    for node_id in region.beating_nodes():
                        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                            await self._beat(session, region, node_id)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._beat_now.wait(), HEARTBEAT_INTERVAL_S)
                self._beat_now.clear()

    async def _beat(self, session: aiohttp.ClientSession, region: FakeRegion, node_id: str) -> None:
        token = self.tokens.node.get(node_id)
        if token is None:
            token = await self._mint(session, node_id, region.name)
        load = region.load
        body = {
            "node_id": node_id,
            "region": region.name,
            "url": region.upstream.url,
            "model": region.model,
            "model_identity": region.model_identity
            or {
                "weights_id": region.weights_id,
                "context_length": 2048,
                "dtype": "fp32",
                "quantization": "none",
            },
            "kv_blocks_total": 1000,
            "kv_blocks_free": load.kv_blocks_free,
            "block_size": 16,
            "num_running": 0,
            "num_waiting": load.num_waiting,
            "num_waiting_prefill_tokens": load.num_waiting_prefill_tokens,
            "decode_tokens_per_s": load.decode_tokens_per_s,
            "draining": load.draining,
            "timestamp": time.time(),
        }
        headers = {"Authorization": f"Bearer {token}"}
        url = self.cp_url + "/v1/nodes/heartbeat"
        async with session.post(url, json=body, headers=headers) as response:
            await response.read()

    async def _mint(self, session: aiohttp.ClientSession, node_id: str, region: str) -> str:
        url = f"{self.cp_url}/v1/nodes/{node_id}/credential"
        headers = {"Authorization": f"Bearer {self.tokens.admin}"}
        async with session.post(url, json={"region": region}, headers=headers) as response:
            response.raise_for_status()
            token: str = (await response.json())["token"]
        self.tokens.node[node_id] = token
        return token

    def mint_node_token(self, node_id: str, region: str) -> str:
        """A credential for a real node agent (its MERIDIAN_NODE_TOKEN)."""
        created = self.admin_call(
            "POST", f"/v1/nodes/{node_id}/credential", json={"region": region}
        )
        token: str = created["token"]
        return token

    def admin_call(self, method: str, path: str, **kwargs: Any) -> Any:
        assert self.admin is not None
        response = self.admin.request(method, path, **kwargs)
        assert response.status_code < 300, response.text
        return response.json() if response.content else None

    # Regions.

    def add_region(
        self,
        name: str,
        pop: str = POP,
        register: bool = True,
        model: str = FAKE_MODEL,
        weights_id: str = FAKE_WEIGHTS,
    ) -> FakeRegion:
        """A fake region at the location table's place `name`, behind the simulated RTT, whose
        node serves `model` (and refuses others) with the weights `weights_id`."""
        place = locate(name)
        region_rtt_ms = rtt_ms(locate(pop), place)
        upstream = FakeUpstream(name, f"{name}-n1", model)
        self.loop.run(upstream.start())
        proxy = DelayProxy(upstream.port, region_rtt_ms / 2000.0)
        self.loop.run(proxy.start())
        region = FakeRegion(
            name, upstream, proxy, region_rtt_ms, model=model, weights_id=weights_id
        )
        self.regions[name] = region
        if register:
            body = {"name": name, "lat": place.lat, "lon": place.lon, "ingress_url": proxy.url}
            self.admin_call("POST", "/v1/regions", json=body)
            self.loop.loop.call_soon_threadsafe(self._beat_now.set)
        return region

    def add_region_in_front_of(self, name: str, port: int, pop: str = POP) -> DelayProxy:
        """Register region `name` whose ingress is a delaying forwarder to 127.0.0.1:`port`
        (a real node agent, which sends its own heartbeats)."""
        place = locate(name)
        proxy = DelayProxy(port, rtt_ms(locate(pop), place) / 2000.0)
        self.loop.run(proxy.start())
        self.proxies.append(proxy)
        body = {"name": name, "lat": place.lat, "lon": place.lon, "ingress_url": proxy.url}
        self.admin_call("POST", "/v1/regions", json=body)
        return proxy

    def set_region_state(self, name: str, state: str) -> None:
        self.admin_call("PATCH", f"/v1/regions/{name}", json={"state": state})

    def kill_region(self, name: str) -> None:
        """The region's node dies: its connections drop, and its heartbeats stop."""
        region = self.regions[name]
        region.is_beating = False
        self.loop.run(region.upstream.stop())

    # Keys.

    def create_key(self, rpm: int = 10_000, tpm: int = 10_000_000) -> tuple[str, str]:
        """A new key's (id, secret), once every running gateway holds it (their snapshots
        follow the control plane's keys by a blocking query: milliseconds, not a poll)."""
        created = self.admin_call("POST", "/v1/keys", json={"name": "k", "rpm": rpm, "tpm": tpm})
        secret: str = created["secret"]
        for gateway in self.gateways:
            if gateway.is_running:
                wait_until(partial(gateway.holds_key, secret), MAX_KEY_S, "the new key")
        return created["id"], secret

    def revoke_key(self, key_id: str) -> None:
        self.admin_call("DELETE", f"/v1/keys/{key_id}")

    # Gateways.

    def start_gateway(self, pop: str = POP, **overrides: Any) -> GatewayThread:
        values: dict[str, Any] = {
            "pop": pop,
            "control_plane": self.cp_url,
            "gateway_token": self.tokens.gateway,
            "tls_mode": "plain" if self.cert is None else "files",
            "access_log": False,
            "freeze_gc": False,
            "breaker_open_s": 1.0,
            # The gateway's loop runs in a thread of the test process, beside the fakes and the
            # other workers on two cores: a connect to 127.0.0.1 has waited past the 0.25 s floor
            # for that loop's turn (test_gw_edge under `make test`). Tests of the floor set it.
            "min_connect_timeout_s": 1.0,
        }
        if self.cert is not None:
            values |= {"tls_cert": self.cert[0], "tls_key": self.cert[1]}
        gateway = GatewayThread(GatewaySettings(**(values | overrides)), self.cert)
        gateway.start()
        self.gateways.append(gateway)
        return gateway

    def wait_for_gateway(
        self, gateway: GatewayThread, num_regions: int | None = None, timeout_s: float = 5.0
    ) -> None:
        """Until the gateway has keys and sees `num_regions` (default: all) with healthy nodes."""
        wanted = len(self.regions) if num_regions is None else num_regions
        router = gateway.handlers.router

        def is_ready() -> bool:
            healthy = [s for s in router.regions.values() if s.summary.healthy_nodes > 0]
            return gateway.handlers.keys.is_loaded and len(healthy) >= wanted

        wait_until(is_ready, timeout_s, f"the gateway to see {wanted} healthy regions")

    def close(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        if self.admin is not None:
            self.admin.close()
        if self._beats is not None:
            self.loop.loop.call_soon_threadsafe(self._beats.cancel)
        for proxy in self.proxies:
            self.loop.run(proxy.stop())
        for region in self.regions.values():
            self.loop.run(region.proxy.stop())
            self.loop.run(region.upstream.stop())
        if self._cp_server is not None and self._cp_task is not None:
            self._cp_server.should_exit = True
            with contextlib.suppress(Exception):
                self._cp_task.result(timeout=10)
        self.loop.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port

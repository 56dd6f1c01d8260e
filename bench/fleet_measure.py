"""The simulated fleet, and what both control-plane fleet benchmarks measure with it.

`bench.control_plane_fleet` (one control plane) and `bench.fleet_replicas` (replicas on
PostgreSQL, the leader killed) drive the same simulated nodes (`Simulation`: one asyncio client,
`--connections` workers beating for their share of the nodes at evenly spread times) and take the
same measurements: heartbeat latency (request sent → reply read), and a capacity change's way to a
connected Envoy (one node of the ingress's region beats with a different `kv_blocks_free`; the
Envoy's admin `/clusters` is polled every POLL_S until that endpoint's weight follows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

POLL_S = 0.005
MAX_PROPAGATION_S = 5.0
FREE_LOW, FREE_HIGH = 500, 5000  # a node's kv_blocks_free, toggled for each capacity change


@dataclass(frozen=True)
class BenchTokens:
    """The operator's and the gateways' tokens of one run, for the control planes' environment
    and the benchmark's own calls."""

    admin_token: str
    gateway_token: str

    @classmethod
    def new(cls) -> BenchTokens:
        return cls("adm-" + secrets.token_urlsafe(24), "gw-" + secrets.token_urlsafe(24))

    @property
    def env(self) -> dict[str, str]:
        return {
            "MERIDIAN_ADMIN_TOKEN": self.admin_token,
            "MERIDIAN_GATEWAY_TOKEN": self.gateway_token,
        }

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    @property
    def gateway(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.gateway_token}"}


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


@dataclass
class Fleet:
    num_nodes: int
    num_regions: int

    def region(self, index: int) -> str:
        return f"r{index:02d}"

    def region_of(self, node: int) -> str:
        return self.region(node % self.num_regions)

    def node_id(self, node: int) -> str:
        return f"n{node:04d}"

    def url(self, node: int) -> str:
        return f"http://127.0.0.1:{20000 + node}"  # nothing listens: Envoy only needs addresses


@dataclass
class Envoy:
    proc: subprocess.Popen[bytes]
    admin_url: str


def beat_body(fleet: Fleet, node: int, kv_blocks_free: int) -> dict[str, Any]:
    return {
        "node_id": fleet.node_id(node),
        "region": fleet.region_of(node),
        "url": fleet.url(node),
        "model": "smollm2-135m-instruct",
        "kv_blocks_total": 10_000,
        "kv_blocks_free": kv_blocks_free,
        "block_size": 16,
        "num_running": 4,
        "num_waiting": 1,
        "num_waiting_prefill_tokens": 200,
        "decode_tokens_per_s": 150.0,
        "num_in_flight": 5,
        "timestamp": time.time(),
    }


class Simulation:
    def __init__(
        self, fleet: Fleet, base_url: str, node_tokens: list[str], args: argparse.Namespace
    ):
        self.fleet = fleet
        self.url = base_url + "/v1/nodes/heartbeat"
        # Each node beats with its own credential, as node agents do.
        self.headers = [
            {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            for token in node_tokens
        ]
        self.args = args
        self.free = [FREE_LOW] * fleet.num_nodes
        self.rng = random.Random(7)
        self.latencies_s: list[float] = []  # after the warm-up only
        self.late_s: list[float] = []
        self.num_sent = 0
        self.num_failed = 0
        self.num_skipped = 0
        self.measuring = False

    def free_of(self, node: int) -> int:
        free = self.free[node]
        if self.args.churn and self.fleet.region_of(node) != self.fleet.region(0):
            free = round(free * (1 + self.args.churn * self.rng.uniform(-1, 1)))
        return free

    async def beat(self, session: aiohttp.ClientSession, node: int) -> float:
        body = json.dumps(beat_body(self.fleet, node, self.free_of(node)))
        sent = time.perf_counter()
        async with session.post(self.url, data=body, headers=self.headers[node]) as response:
            await response.read()
            ok = response.status == 200
        took_s = time.perf_counter() - sent
        self.num_sent += 1
        self.num_failed += not ok
        if self.measuring:
            self.latencies_s.append(took_s)
        return took_s

    async def worker(self, session: aiohttp.ClientSession, index: int, stop_at: float) -> None:
        """Beats for nodes index, index + C, ... at evenly spread offsets in every interval."""
        mine = list(range(index, self.fleet.num_nodes, self.args.connections))
        interval_s = self.args.interval_s
        offsets = [node / self.fleet.num_nodes * interval_s for node in mine]
        start = time.monotonic()
        period = 0
        while mine and start + period * interval_s < stop_at:
            for node, offset in zip(mine, offsets, strict=True):
                due = start + period * interval_s + offset
                if due >= stop_at:
                    return
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif -delay > interval_s:
                    self.num_skipped += self.measuring
                    continue
                elif self.measuring:
                    self.late_s.append(-delay)
                try:
                    await self.beat(session, node)
                except (aiohttp.ClientError, TimeoutError):
                    self.num_failed += 1
            period += 1

    async def change_capacity(
        self, session: aiohttp.ClientSession, envoy: Envoy, cluster: str, node: int
    ) -> float | None:
        """Flip one node's free KV blocks; seconds until the ingress Envoy's weight follows."""
        host = self.fleet.url(node).removeprefix("http://")
        before = await endpoint_weight(session, envoy, cluster, host)
        self.free[node] = FREE_HIGH if self.free[node] == FREE_LOW else FREE_LOW
        started = time.perf_counter()
        await self.beat(session, node)
        while time.perf_counter() - started < MAX_PROPAGATION_S:
            if await endpoint_weight(session, envoy, cluster, host) not in (before, None):
                return time.perf_counter() - started
            await asyncio.sleep(POLL_S)
        return None


async def endpoint_weight(
    session: aiohttp.ClientSession, envoy: Envoy, cluster: str, host: str
) -> int | None:
    async with session.get(envoy.admin_url + "/clusters") as response:
        text = await response.text()
    prefix = f"{cluster}::{host}::weight::"
    for line in text.splitlines():
        if line.startswith(prefix):
            return int(line[len(prefix) :])
    return None


async def endpoint_acks(
    session: aiohttp.ClientSession, base_url: str, admin: dict[str, str], role: str
) -> int:
    """EDS updates the Envoys of `role` have ACKed so far (from GET /v1/xds)."""
    async with session.get(base_url + "/v1/xds", headers=admin) as response:
        status = await response.json()
    return sum(
        envoy["types"].get("endpoints", {}).get("num_acks", 0)
        for envoy in status["envoys"]
        if envoy["role"] == role
    )


async def register_regions(session: aiohttp.ClientSession, base_url: str, fleet: Fleet) -> None:
    for index in range(fleet.num_regions):
        body = {
            "name": fleet.region(index),
            "lat": -60.0 + (index * 37) % 120,
            "lon": -170.0 + (index * 53) % 340,
            "ingress_url": f"http://127.0.0.1:{30000 + index}",
        }
        async with session.post(base_url + "/v1/regions", json=body) as response:
            assert response.status == 201, await response.text()


async def mint_credentials(
    session: aiohttp.ClientSession, base_url: str, fleet: Fleet
) -> list[str]:
    """Every node's own heartbeat token, minted by the operator (a few at a time)."""
    tokens = [""] * fleet.num_nodes
    pending = iter(range(fleet.num_nodes))

    async def mint() -> None:
        for node in pending:
            body = {"region": fleet.region_of(node), "url": fleet.url(node)}
            url = f"{base_url}/v1/nodes/{fleet.node_id(node)}/credential"
            async with session.post(url, json=body) as response:
                assert response.status == 201, await response.text()
                tokens[node] = (await response.json())["token"]

    await asyncio.gather(*(mint() for _ in range(8)))
    return tokens


async def wait_ready(session: aiohttp.ClientSession, envoys: Sequence[Envoy], wait: Any) -> None:
    """Until every Envoy's admin `/ready` answers 200 (`wait`: `wait_until` of the caller)."""
    for envoy in envoys:

        async def is_ready(envoy: Envoy = envoy) -> bool:
            async with session.get(envoy.admin_url + "/ready") as response:
                return response.status == 200

        await wait(is_ready, "envoy")


async def healthy_nodes(session: aiohttp.ClientSession, url: str, gateway: dict[str, str]) -> int:
    """The nodes the region summaries at `url` count healthy (a cheap read, unlike /v1/status)."""
    async with session.get(url + "/v1/regions/summary", headers=gateway) as response:
        regions = (await response.json())["regions"]
    return sum(int(region["healthy_nodes"]) for region in regions)


async def changes_to_envoy(
    sim: Simulation,
    session: aiohttp.ClientSession,
    ingress: Envoy,
    count: int,
    stop_at: float | None = None,
) -> list[float]:
    """Up to `count` capacity changes of node 0 (of the ingress's region), each timed until
    `ingress` follows; spaced 0.5 s and a bit more each time, so as not to fall in step with the
    control plane's ticks; none started within 1 s of `stop_at` (monotonic)."""
    cluster = f"meridian_{sim.fleet.region(0)}_nodes"
    seen: list[float] = []
    for change in range(count):
        took = await sim.change_capacity(session, ingress, cluster, node=0)
        if took is not None:
            seen.append(took)
        if stop_at is not None and time.monotonic() + 1.0 > stop_at:
            break
        await asyncio.sleep(0.5 + 0.05 * change)
    return seen


def p50_and(values_s: Sequence[float], share: float | None) -> tuple[float, float]:
    """(p50, p`share` — or the max when `share` is None) of `values_s`, in milliseconds."""
    ms = [1000 * value for value in values_s]
    if not ms:
        return 0.0, 0.0
    top = max(ms) if share is None else percentile(ms, share)
    return round(statistics.median(ms), 2), round(top, 2)

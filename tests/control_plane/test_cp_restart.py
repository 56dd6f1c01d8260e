"""A control plane that stops or restarts (a real process, on the same database and port) does
not take the fleet away from gateways: a stop never publishes an empty fleet, and a restarted one
keeps the last known health for a grace period; under load through a real gateway, no request
fails."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ControlPlaneProcess, bearer, free_port, heartbeat, new_tokens

from control_plane.tokens import TokenSet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
import contextlib

from gw_fleet import Fleet, Tokens, wait_until
from suite_env import child_env

pytestmark = pytest.mark.slow

NUM_CONCURRENT = 32
MAX_WAIT_S = 30.0  # generous bounds on waits for something that should happen in a second


def token_env(tokens: TokenSet | Tokens) -> dict[str, str]:
    return {"MERIDIAN_ADMIN_TOKEN": tokens.admin, "MERIDIAN_GATEWAY_TOKEN": tokens.gateway}


def process_env(tokens: Tokens) -> dict[str, str]:
    env = child_env()
    return env | token_env(tokens)


@dataclass
class Beater:
    """A node that beats every 0.1 s from its own thread, until stopped."""

    base_url: str
    token: str
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=2.0) as http:
            while not self.stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    http.post(
                        "/v1/nodes/heartbeat", json=heartbeat("n1"), headers=bearer(self.token)
                    )
                self.stop.wait(0.1)


@dataclass
class Watcher:
    """A gateway's blocking queries, from its own thread: every summary document it is sent."""

    base_url: str
    token: str
    healthy: list[int] = field(default_factory=list)  # us-east's healthy_nodes, per document
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        index = 0
        with httpx.Client(base_url=self.base_url, timeout=MAX_WAIT_S) as http:
            while not self.stop.is_set():
                try:
                    params = {"index": index, "wait": "10s"}
                    answer = http.get(
                        "/v1/regions/summary", params=params, headers=bearer(self.token)
                    )
                    document = answer.json()
                except (httpx.HTTPError, ValueError):
                    self.stop.wait(0.05)
                    continue
                index = document["index"]
                self.healthy += [r["healthy_nodes"] for r in document["regions"]]


def num_saved(db_path: Path) -> int:
    """Nodes in the last health snapshot the control plane saved (it saves every second)."""
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        return int(conn.execute("SELECT count(*) FROM node_health").fetchone()[0])


def start_region_and_node(cp: ControlPlaneProcess, tokens: TokenSet) -> str:
    admin = bearer(tokens.admin)
    with httpx.Client(base_url=cp.base_url, timeout=10.0) as http:
        region = {"name": "us-east", "lat": 40.7, "lon": -74.0}
        assert http.post("/v1/regions", json=region, headers=admin).status_code == 201
        minted = http.post("/v1/nodes/n1/credential", json={"region": "us-east"}, headers=admin)
        token: str = minted.json()["token"]
    return token


def summary(cp: ControlPlaneProcess, tokens: TokenSet) -> dict[str, Any]:
    response = httpx.get(
        cp.base_url + "/v1/regions/summary", headers=bearer(tokens.gateway), timeout=10.0
    )
    (region,) = response.json()["regions"]
    return dict(region)


@pytest.fixture
def threads() -> Iterator[list[tuple[threading.Thread, threading.Event]]]:
    started: list[tuple[threading.Thread, threading.Event]] = []
    yield started
    for thread, stop in started:
        stop.set()
        thread.join(timeout=MAX_WAIT_S)


def run_in_thread(
    threads: list[tuple[threading.Thread, threading.Event]], worker: Beater | Watcher
) -> None:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    threads.append((thread, worker.stop))


def test_a_graceful_stop_never_publishes_an_empty_fleet(
    tmp_path: Path, start_process: Any, threads: list[tuple[threading.Thread, threading.Event]]
) -> None:
    tokens = new_tokens()
    # Unhealthy after 0.6 s of silence: well inside uvicorn's graceful wait for open requests.
    args = ["--db", str(tmp_path / "cp.db"), "--heartbeat-interval", "0.2"]
    cp = start_process(args, token_env(tokens))
    beater = Beater(cp.base_url, start_region_and_node(cp, tokens))
    run_in_thread(threads, beater)
    watcher = Watcher(cp.base_url, tokens.gateway)
    run_in_thread(threads, watcher)
    wait_until(lambda: 1 in watcher.healthy, MAX_WAIT_S, "the node to be healthy")
    cp.proc.send_signal(signal.SIGTERM)
    assert cp.proc.wait(timeout=MAX_WAIT_S) in (0, -signal.SIGTERM)
    seen = watcher.healthy[watcher.healthy.index(1) :]
    assert 0 not in seen, seen


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_restarted_control_plane_keeps_last_known_health_for_a_grace_period(
    tmp_path: Path,
    start_process: Any,
    threads: list[tuple[threading.Thread, threading.Event]],
    how: str,
) -> None:
    tokens = new_tokens()
    args = ["--db", str(tmp_path / "cp.db"), "--heartbeat-interval", "0.5"]
    first = start_process(args, token_env(tokens))
    beater = Beater(first.base_url, start_region_and_node(first, tokens))
    run_in_thread(threads, beater)
    wait_until(lambda: summary(first, tokens)["healthy_nodes"] == 1, MAX_WAIT_S, "a healthy node")
    wait_until(lambda: num_saved(tmp_path / "cp.db") == 1, MAX_WAIT_S, "a health snapshot")
    beater.stop.set()  # the node goes quiet (backing off) while the control plane is away
    if how == "SIGKILL":
        first.kill()
    else:
        first.stop()

    second = start_process(args, token_env(tokens), port=first.port)
    region = summary(second, tokens)
    assert region["healthy_nodes"] == 1 and region["kv_blocks_free"] == 600
    # ... for the grace period only (3 heartbeat timeouts, 4.5 s here): a node that never
    # comes back is unhealthy afterwards.
    wait_until(
        lambda: summary(second, tokens)["healthy_nodes"] == 0, MAX_WAIT_S, "the grace to end"
    )


@dataclass
class Load:
    """NUM_CONCURRENT clients sending chat completions through the gateway without pause."""

    url: str
    api_key: str
    num_ok: int = 0
    failures: list[str] = field(default_factory=list)
    is_running: bool = True

    @property
    def num_done(self) -> int:
        return self.num_ok + len(self.failures)

    async def client(self) -> None:
        headers = bearer(self.api_key)
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(timeout=MAX_WAIT_S) as http:
            while self.is_running:
                try:
                    response = await http.post(self.url, json=body, headers=headers)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if response.status_code == 200:
                    self.num_ok += 1
                else:
                    self.failures.append(f"{response.status_code} {response.text[:200]}")

    async def run(self, until: threading.Event) -> None:
        clients = [asyncio.create_task(self.client()) for _ in range(NUM_CONCURRENT)]
        await asyncio.to_thread(until.wait)
        self.is_running = False
        await asyncio.gather(*clients)


def test_no_request_fails_through_a_gateway_while_the_control_plane_restarts(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path, cert=None)
    port = free_port()
    args = ["--db", str(tmp_path / "cp.db"), "--heartbeat-interval", "1.0"]
    log = tmp_path / "control_plane.log"
    processes = [ControlPlaneProcess(args, process_env(fleet.tokens), log, port)]
    done = threading.Event()
    try:
        fleet.attach_control_plane(processes[0].base_url)
        for name in ("us-east", "eu-west"):
            fleet.add_region(name)
        _, api_key = fleet.create_key()
        # Short watch backoff: the gateway finds the restarted control plane within a second.
        gateway = fleet.start_gateway(max_watch_backoff_s=0.5)
        fleet.wait_for_gateway(gateway, timeout_s=MAX_WAIT_S)
        load = Load(gateway.base_url + "/v1/chat/completions", api_key)
        loop_thread = threading.Thread(target=asyncio.run, args=(load.run(done),), daemon=True)
        loop_thread.start()
        wait_until(lambda: load.num_ok >= 100, MAX_WAIT_S, "load to be flowing")
        wait_until(lambda: num_saved(tmp_path / "cp.db") == 2, MAX_WAIT_S, "a health snapshot")

        index_before = gateway.handlers.router.index
        processes[0].kill()
        for region in fleet.regions.values():
            region.is_beating = False  # the nodes lost us: they back off (up to 30 s)
        processes.append(ControlPlaneProcess(args, process_env(fleet.tokens), log, port))
        # The gateway adopts the restarted control plane's fleet before any node is back ...
        wait_until(
            lambda: gateway.handlers.router.index > index_before,
            MAX_WAIT_S,
            "the gateway to hear from the restarted control plane",
        )
        done_at_restart = load.num_done
        wait_until(lambda: load.num_done >= done_at_restart + 200, MAX_WAIT_S, "more load")
        for region in fleet.regions.values():
            region.is_beating = True  # ... and then the nodes come back
        wait_until(lambda: load.num_done >= done_at_restart + 400, MAX_WAIT_S, "load after")
        done.set()
        loop_thread.join(timeout=MAX_WAIT_S)
        assert load.failures == [], load.failures[:5]
    finally:
        done.set()
        fleet.close()
        for process in processes:
            process.stop()

"""A key's limits across PoPs, each on its own Redis, with a real control plane handing out
shares: the fleet stays within the key's budget (plus the stated bound), and a key at its limit
stays refused when its PoP's Redis dies or comes back empty.

Needs a `redis-server` (tests skip without one, see gw_redis.py).
"""

from __future__ import annotations

import contextlib
import sqlite3
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gw_fleet import Fleet, free_port, wait_until
from gw_redis import REDIS_SERVER, redis_server
from gw_shares import limiter_of, wait_for_even_shares

pytestmark = [
    pytest.mark.slow,  # starts processes
    pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server (see gw_redis.py)"),
]
POPS = ("new-york", "london", "singapore")
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
# The key of the live probe: 200 TPM. A request that reserves about 115 tokens and uses 67: two
# fit, then none for about 15 s (the refill is 3.3 tokens a second).
TPM = 200
BIG = {**CHAT, "max_tokens": 60}
REPORT_INTERVAL_S = 1.0  # the gateway's default


class RedisPerPop:
    """A redis-server per PoP, on ports of their own; killed and restarted on demand."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.ports: dict[str, int] = {}
        self._stack = contextlib.ExitStack()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, pop: str) -> str:
        port = self.ports.setdefault(pop, free_port())
        directory = self.tmp_path / f"redis-{pop}-{time.monotonic_ns()}"
        directory.mkdir()
        self.processes[pop] = self._stack.enter_context(redis_server(port, directory))
        return f"redis://127.0.0.1:{port}/0"

    def kill(self, pop: str) -> None:
        process = self.processes.pop(pop)
        process.kill()
        process.wait(timeout=10)

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def redises(tmp_path: Path) -> Iterator[RedisPerPop]:
    redises = RedisPerPop(tmp_path)
    try:
        yield redises
    finally:
        redises.close()


def post(http: httpx.Client, body: dict[str, object]) -> httpx.Response:
    return http.post("/v1/chat/completions", json=body)


def test_a_key_spread_over_three_pops_stays_within_its_budget(
    fleet: Fleet, redises: RedisPerPop, client_ssl: ssl.SSLContext
) -> None:
    tpm = 1200  # requests reserve about 55 tokens and use 8: room for many at each PoP
    fleet.add_region("us-east")
    gateways = [fleet.start_gateway(pop=pop, redis=redises.start(pop)) for pop in POPS]
    _, secret = fleet.create_key(rpm=100_000, tpm=tpm)
    wait_for_even_shares(fleet, gateways)
    headers = {"Authorization": f"Bearer {secret}"}
    clients = [
        httpx.Client(base_url=g.base_url, verify=client_ssl, headers=headers) for g in gateways
    ]
    used = num_ok = num_refused = 0
    started = time.monotonic()
    try:
        while time.monotonic() - started < 8.0:  # round robin, as fast as answers come
            for http in clients:
                response = post(http, CHAT)
                if response.status_code == 200:
                    used += response.json()["usage"]["total_tokens"]
                    num_ok += 1
                else:
                    assert response.status_code == 429, response.text
                    num_refused += 1
        elapsed_s = time.monotonic() - started
    finally:
        for http in clients:
            http.close()
    # The key's budget over the window plus the stated bound (docs/gateway.md): one report
    # interval at the key's rate. Every request used less than it reserved: no debt.
    budget = tpm + tpm / 60 * (elapsed_s + REPORT_INTERVAL_S)
    assert num_refused > 0 and used > tpm / 2, (used, num_ok, num_refused)
    print(f"{used} tokens used in {elapsed_s:.1f} s ({num_ok} requests); budget {budget:.0f}")
    assert used <= budget


def exhaust(http: httpx.Client) -> httpx.Response:
    """Requests until the key is refused (its buckets below one more request)."""
    for _ in range(10):
        response = post(http, BIG)
        if response.status_code == 429:
            return response
        assert response.status_code == 200, response.text
    raise AssertionError("the key was never refused")


def refused_for(http: httpx.Client, num_requests: int) -> list[int]:
    return [post(http, BIG).status_code for _ in range(num_requests)]


@pytest.fixture
def one_pop(fleet: Fleet) -> Fleet:
    fleet.add_region("us-east")
    fleet.regions["us-east"].upstream.behavior.num_chunks = 60  # every max_token used
    return fleet


def test_a_key_at_its_limit_stays_refused_while_redis_is_down(
    one_pop: Fleet, redises: RedisPerPop, client_ssl: ssl.SSLContext
) -> None:
    gateway = one_pop.start_gateway(pop="new-york", redis=redises.start("new-york"))
    _, secret = one_pop.create_key(rpm=10_000, tpm=TPM)
    one_pop.wait_for_gateway(gateway)
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        retry_after_s = int(exhaust(http).headers["retry-after"])
        assert retry_after_s >= 10
        killed = time.monotonic()
        redises.kill("new-york")
        statuses = refused_for(http, 5)
        assert time.monotonic() - killed < retry_after_s - 5  # all within the outage
    assert statuses == [429] * 5


def test_a_key_at_its_limit_stays_refused_when_redis_comes_back_empty(
    one_pop: Fleet, redises: RedisPerPop, client_ssl: ssl.SSLContext
) -> None:
    gateway = one_pop.start_gateway(pop="new-york", redis=redises.start("new-york"))
    _, secret = one_pop.create_key(rpm=10_000, tpm=TPM)
    one_pop.wait_for_gateway(gateway)
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        exhaust(http)
        redises.kill("new-york")
        redises.start("new-york")  # the same port, nothing kept
        assert refused_for(http, 3) == [429] * 3
        # Reseeded from the control plane within a report or two: Redis holds the debt again.
        buckets = limiter_of(gateway).buckets
        wait_until(lambda: not buckets.needs_levels, 5.0, "the levels from the control plane")
        assert refused_for(http, 3) == [429] * 3


def test_a_pop_and_its_redis_restarted_together_start_from_the_control_planes_levels(
    one_pop: Fleet, redises: RedisPerPop, client_ssl: ssl.SSLContext
) -> None:
    gateway = one_pop.start_gateway(pop="new-york", redis=redises.start("new-york"))
    key_id, secret = one_pop.create_key(rpm=10_000, tpm=TPM)
    one_pop.wait_for_gateway(gateway)
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
        exhaust(http)
    # The control plane has heard this PoP's levels (the next report after the refusal).
    wait_until(lambda: (reported_tokens(one_pop, key_id) or TPM) < 115, 5.0, "the report")
    gateway.stop()
    one_pop.gateways.remove(gateway)
    redises.kill("new-york")
    restarted = one_pop.start_gateway(pop="new-york", redis=redises.start("new-york"))
    one_pop.wait_for_gateway(restarted)
    wait_until(lambda: len(restarted.handlers.keys) > 0, what="the key")
    with httpx.Client(base_url=restarted.base_url, verify=client_ssl, headers=headers) as http:
        assert refused_for(http, 3) == [429] * 3


def reported_tokens(fleet: Fleet, key_id: str) -> float | None:
    """The token level the control plane last heard from new-york for the key."""
    with contextlib.closing(sqlite3.connect(fleet.tmp_path / "cp.db")) as conn:
        row = conn.execute(
            "SELECT token_level FROM limit_shares WHERE key_id = ? AND pop = 'new-york'",
            (key_id,),
        ).fetchone()
    return None if row is None or row[0] is None else float(row[0])

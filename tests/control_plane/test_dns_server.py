"""The authoritative DNS, through `dnspython` over real UDP on 127.0.0.1, fed by the live fleet:
nearest healthy region per client subnet, failover, shedding with hysteresis, fail-open, and the
protocol's edges (NXDOMAIN, REFUSED, NOTIMP, FORMERR, SOA/NS, TTL, ECS scope)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import dns.edns
import dns.flags
import dns.message
import dns.opcode
import dns.query
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import pytest
from conftest import ControlPlaneClient, make_settings

from control_plane.settings import Settings
from control_plane.tokens import TokenSet
from wire.geo import REGIONS, client_subnet_of

HOSTNAME = "api.meridian.test"
# Answer addresses: the ingress URL's host (an IP literal) for most regions; eu-west also has
# an IPv6 address, configured.
INGRESS = {name: f"http://10.0.0.{i}:8000" for i, name in enumerate(REGIONS, start=1)}
EU_WEST_V6 = "2001:db8:ffff::2"
LONDON_CLIENTS = [f"10.77.{i}.0/24" for i in range(40)]  # all placed in London by the test config


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet, request: pytest.FixtureRequest) -> Settings:
    dns_config: dict[str, Any] = {
        "region_addresses": {"eu-west": ["10.0.0.3", EU_WEST_V6]},
        "client_subnets": {"10.77.0.0/16": "london"},
    } | getattr(request, "param", {})
    # Slow heartbeats: nodes stay healthy through a test unless it says otherwise.
    return make_settings(tmp_path / "cp.db", tokens, heartbeat_interval_s=5.0, dns=dns_config)


async def add_fleet(cp: ControlPlaneClient, regions: list[str], with_nodes: bool = True) -> None:
    for name in regions:
        where = REGIONS[name]
        await cp.add_region(name, lat=where.lat, lon=where.lon, ingress_url=INGRESS[name])
        if with_nodes:
            await cp.beat(f"{name}-n1", name, kv_blocks_free=500, kv_blocks_total=1000)
    settle(cp)


def settle(cp: ControlPlaneClient) -> None:
    """Publish the summaries now instead of waiting for the next sweep tick."""
    cp.services.summaries.refresh()


def dns_port(cp: ControlPlaneClient) -> int:
    assert cp.services.dns is not None
    return cp.services.dns.port


async def ask(
    cp: ControlPlaneClient,
    name: str = HOSTNAME,
    rdtype: str = "A",
    subnet: str | None = None,
    **make: Any,
) -> dns.message.Message:
    if subnet is not None:
        address, prefix = subnet.split("/")
        make["options"] = [dns.edns.ECSOption(address, int(prefix))]
        make.setdefault("use_edns", 0)
    query = dns.message.make_query(name, rdtype, **make)
    # dnspython's blocking client, off the event loop that runs the server.
    return await asyncio.to_thread(dns.query.udp, query, "127.0.0.1", 2.0, dns_port(cp))


async def answer_of(cp: ControlPlaneClient, subnet: str | None = None, rdtype: str = "A") -> str:
    response = await ask(cp, subnet=subnet, rdtype=rdtype)
    assert response.rcode() == dns.rcode.NOERROR
    (rrset,) = response.answer
    (record,) = rrset
    return str(record.address)


def region_of(address: str) -> str:
    return next(name for name, url in INGRESS.items() if f"//{address}:" in url)


async def regions_for(cp: ControlPlaneClient, subnets: list[str]) -> list[str]:
    return [region_of(await answer_of(cp, subnet)) for subnet in subnets]


ALL = list(REGIONS)


@pytest.mark.asyncio
async def test_each_client_subnet_gets_its_nearest_region(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ALL)
    expected = {
        "new-york": "us-east",
        "seattle": "us-west",
        "london": "eu-west",
        "paris": "eu-central",
        "sao-paulo": "sa-east",
        "mumbai": "ap-southeast",
        "seoul": "ap-northeast",
    }
    for city, region in expected.items():
        assert region_of(await answer_of(cp, client_subnet_of(city))) == region, city
        assert region_of(await answer_of(cp, client_subnet_of(city, family=6))) == region, city
    # The documentation prefixes stand for three big cities.
    assert region_of(await answer_of(cp, "203.0.113.0/24")) == "ap-northeast"

    response = await ask(cp, subnet=client_subnet_of("london"))
    assert response.flags & dns.flags.AA and not response.flags & dns.flags.RA
    assert response.answer[0].ttl == 5
    (ecs,) = response.options
    assert isinstance(ecs, dns.edns.ECSOption)
    assert (ecs.address, ecs.srclen, ecs.scopelen) == ("198.18.10.0", 24, 24)


@pytest.mark.asyncio
async def test_without_client_subnet_the_source_address_decides(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ALL)
    # 127.0.0.1 is in no subnet of the table: the default location (New York) applies.
    assert region_of(await answer_of(cp)) == "us-east"
    # ECS with source /0 means "do not use my subnet": the same, with scope 0.
    response = await ask(cp, subnet="0.0.0.0/0")
    assert region_of(str(response.answer[0][0].address)) == "us-east"
    assert response.options[0].scopelen == 0


@pytest.mark.parametrize("settings", [{"client_subnets": {"127.0.0.0/8": "tokyo"}}], indirect=True)
@pytest.mark.asyncio
async def test_client_subnet_table_is_configurable(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ALL)
    assert region_of(await answer_of(cp)) == "ap-northeast"


@pytest.mark.asyncio
async def test_aaaa_answers_and_nodata_for_a_missing_family(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ALL)
    assert await answer_of(cp, client_subnet_of("london"), rdtype="AAAA") == EU_WEST_V6
    nodata = await ask(cp, rdtype="AAAA", subnet=client_subnet_of("new-york"))
    assert nodata.rcode() == dns.rcode.NOERROR and not nodata.answer
    assert nodata.authority[0].rdtype == dns.rdatatype.SOA


@pytest.mark.asyncio
async def test_disabled_region_fails_over_to_the_next_nearest(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ALL)
    london = client_subnet_of("london")
    assert region_of(await answer_of(cp, london)) == "eu-west"
    patch = await cp.http.patch("/v1/regions/eu-west", json={"state": "disabled"}, headers=cp.admin)
    assert patch.status_code == 200
    assert region_of(await answer_of(cp, london)) == "eu-central"
    await cp.http.patch("/v1/regions/eu-west", json={"state": "active"}, headers=cp.admin)
    assert region_of(await answer_of(cp, london)) == "eu-west"


@pytest.mark.asyncio
async def test_region_whose_nodes_stop_beating_fails_over(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ["eu-west", "eu-central", "us-east"])
    london = client_subnet_of("london")
    assert region_of(await answer_of(cp, london)) == "eu-west"
    # Time passes (the sweep judges every node silent), then all but eu-west's beat again.
    cp.services.summaries.tick(time.monotonic() + 3600)
    for name in ("eu-central", "us-east"):
        await cp.beat(f"{name}-n1", name)
    settle(cp)
    assert region_of(await answer_of(cp, london)) == "eu-central"
    # A draining node takes its region out of answers too (step 4 of its drain sequence).
    await cp.beat("eu-central-n1", "eu-central", draining=True)
    await cp.services.drain_loop.step()
    assert cp.services.fleet.nodes["eu-central-n1"].drain_phase == "dns"
    assert region_of(await answer_of(cp, london)) == "us-east"


@pytest.mark.asyncio
async def test_fail_open_to_the_nearest_when_every_region_is_unhealthy(
    cp: ControlPlaneClient,
) -> None:
    await add_fleet(cp, ALL, with_nodes=False)  # registered, but no node has ever beaten
    assert region_of(await answer_of(cp, client_subnet_of("london"))) == "eu-west"
    assert region_of(await answer_of(cp, client_subnet_of("seoul"))) == "ap-northeast"


@pytest.mark.asyncio
async def test_saturated_region_sheds_part_of_its_clients_without_flapping(
    cp: ControlPlaneClient,
) -> None:
    await add_fleet(cp, ["eu-west", "eu-central", "us-east"])

    async def load_eu_west(used: float) -> list[str]:
        free = round(1000 * (1 - used))
        await cp.beat("eu-west-n1", "eu-west", kv_blocks_free=free, kv_blocks_total=1000)
        settle(cp)
        return await regions_for(cp, LONDON_CLIENTS)

    assert set(await load_eu_west(0.5)) == {"eu-west"}
    # Between the marks (leave 0.8, enter 0.9 = the routing policy's saturation threshold):
    # not shedding yet, however the load moves.
    for used in (0.85, 0.89, 0.82, 0.88):
        assert set(await load_eu_west(used)) == {"eu-west"}
    shed = await load_eu_west(0.95)
    moved = [
        client for client, region in zip(LONDON_CLIENTS, shed, strict=True) if region != "eu-west"
    ]
    assert set(shed) == {"eu-west", "eu-central"}
    assert 8 <= len(moved) <= 32  # about half (shed_share 0.5), chosen by subnet hash
    # Oscillating between the marks while shedding: the very same answers every time.
    for used in (0.85, 0.89, 0.82, 0.95, 0.88):
        assert await load_eu_west(used) == shed
    assert set(await load_eu_west(0.7)) == {"eu-west"}  # below the leave mark: all back


@pytest.mark.asyncio
async def test_zone_apex_unknown_names_and_foreign_names(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ["us-east"])
    soa = await ask(cp, "meridian.test", "SOA")
    assert soa.rcode() == dns.rcode.NOERROR and soa.flags & dns.flags.AA
    assert soa.answer[0].rdtype == dns.rdatatype.SOA and soa.answer[0][0].minimum == 5
    ns = await ask(cp, "meridian.test", "NS")
    assert str(ns.answer[0][0].target) == "ns1.meridian.test."
    assert str(ns.additional[0][0].address) == "127.0.0.1"
    glue = await ask(cp, "ns1.meridian.test", "A")
    assert str(glue.answer[0][0].address) == "127.0.0.1"

    missing = await ask(cp, "nope.meridian.test", "A")
    assert missing.rcode() == dns.rcode.NXDOMAIN and missing.flags & dns.flags.AA
    assert missing.authority[0].rdtype == dns.rdatatype.SOA and missing.authority[0].ttl == 5
    mx = await ask(cp, HOSTNAME, "MX")  # the name exists, that type does not: NODATA
    assert mx.rcode() == dns.rcode.NOERROR and not mx.answer and mx.authority

    foreign = await ask(cp, "www.example.com", "A")
    assert foreign.rcode() == dns.rcode.REFUSED and not foreign.flags & dns.flags.AA
    chaos = await ask(cp, "version.bind", "TXT", rdclass=dns.rdataclass.CH)
    assert chaos.rcode() == dns.rcode.REFUSED
    transfer = await ask(cp, "meridian.test", "AXFR")
    assert transfer.rcode() == dns.rcode.REFUSED


@pytest.mark.asyncio
async def test_bad_queries_get_notimp_formerr_badvers_or_nothing(cp: ControlPlaneClient) -> None:
    await add_fleet(cp, ["us-east"])
    notify = dns.message.make_query("meridian.test", "SOA")
    notify.set_opcode(dns.opcode.NOTIFY)
    reply = await asyncio.to_thread(dns.query.udp, notify, "127.0.0.1", 2.0, dns_port(cp))
    assert reply.rcode() == dns.rcode.NOTIMP
    future = await ask(cp, use_edns=1)
    assert future.rcode() == dns.rcode.BADVERS

    def raw(packet: bytes) -> bytes | None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(0.5)
            sock.sendto(packet, ("127.0.0.1", dns_port(cp)))
            try:
                return sock.recv(4096)
            except TimeoutError:
                return None

    garbage = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xff\xff"
    formerr = await asyncio.to_thread(raw, garbage)
    assert formerr is not None and formerr[:2] == b"\x12\x34" and formerr[3] & 0x0F == 1
    assert await asyncio.to_thread(raw, b"\x01") is None  # not even a header: dropped
    response = dns.message.make_response(dns.message.make_query(HOSTNAME, "A"))
    assert await asyncio.to_thread(raw, response.to_wire()) is None  # never answer answers
    # The server is still there.
    assert region_of(await answer_of(cp)) == "us-east"


@pytest.mark.slow
def test_control_plane_process_serves_dns_on_its_dns_port(
    tmp_path: Path, start_process: Any
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start_process(["--db", str(tmp_path / "cp.db"), "--xds-port", "0", "--dns-port", str(port)])
    query = dns.message.make_query("meridian.test", "SOA")
    reply = dns.query.udp(query, "127.0.0.1", timeout=5.0, port=port)
    assert reply.rcode() == dns.rcode.NOERROR and reply.answer[0].rdtype == dns.rdatatype.SOA
    nothing = dns.query.udp(dns.message.make_query(HOSTNAME, "A"), "127.0.0.1", 5.0, port)
    assert nothing.rcode() == dns.rcode.SERVFAIL  # no region registered: nothing to answer

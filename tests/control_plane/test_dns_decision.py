"""The DNS's pure parts: geography (wire/geo.py), client location, and the steering rule."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

import pytest

from control_plane.dns.config import DnsConfig
from control_plane.dns.decision import (
    ShedMarks,
    Target,
    choose,
    client_hash,
    client_network,
    next_shedding,
)
from wire.geo import (
    CITIES,
    DEFAULT_CLIENT_SUBNETS,
    HOP_RTT_MS,
    LOCATIONS,
    REGIONS,
    ClientLocator,
    client_subnet_of,
    distance_km,
    locate,
    rtt_ms,
)
from wire.region_summary import RegionState

MARKS = ShedMarks(
    enter_kv_used_share=0.9,
    leave_kv_used_share=0.8,
    enter_queue_delay_s=5.0,
    leave_queue_delay_s=2.0,
)


def target(
    name: str,
    state: RegionState = "active",
    num_healthy_nodes: int = 1,
    kv_used_share: float = 0.5,
    queue_delay_s: float = 0.0,
    has_address: bool = True,
) -> Target:
    region = REGIONS[name]
    index = list(REGIONS).index(name) + 1
    addresses = (ipaddress.ip_address(f"10.0.0.{index}"),) if has_address else ()
    return Target(
        name,
        region.lat,
        region.lon,
        state,
        num_healthy_nodes,
        kv_used_share,
        queue_delay_s,
        addresses,
    )


def fleet(**overrides: Target) -> list[Target]:
    return [overrides.get(name.replace("-", "_"), target(name)) for name in REGIONS]


def pick(city: str, targets: Iterable[Target], shedding: frozenset[str] = frozenset()) -> str:
    decision = choose(locate(city), 0.0, list(targets), shedding, shed_share=0.5)
    assert decision is not None
    return decision.target.name


def test_distances_and_rtt_follow_the_great_circle() -> None:
    km = distance_km(locate("new-york"), locate("london"))
    assert 5550 < km < 5600  # about 5,570 km
    assert rtt_ms(locate("new-york"), locate("london")) == pytest.approx(km / 100 + HOP_RTT_MS)
    assert rtt_ms(locate("paris"), locate("paris"), num_hops=3) == 3 * HOP_RTT_MS
    assert distance_km(locate("sydney"), locate("london")) > 16_000
    assert set(REGIONS) == {
        "us-east",
        "us-west",
        "eu-west",
        "eu-central",
        "ap-southeast",
        "ap-northeast",
        "sa-east",
    }
    with pytest.raises(KeyError, match="unknown location 'atlantis'"):
        locate("atlantis")


def test_client_locator_takes_the_longest_prefix() -> None:
    subnets = {**DEFAULT_CLIENT_SUBNETS, "192.0.2.128/25": "chicago"}
    locator = ClientLocator(subnets, LOCATIONS)
    assert locator.locate(ipaddress.ip_address("192.0.2.10")) == locate("new-york")
    assert locator.locate(ipaddress.ip_address("192.0.2.200")) == locate("chicago")
    assert locator.locate(ipaddress.ip_address("2001:db8:a::1")) == locate(
        list(CITIES)[9]  # the tenth city's /48
    )
    assert locator.locate(ipaddress.ip_address("8.8.8.8")) is None
    for city in CITIES:
        network = ipaddress.ip_network(client_subnet_of(city, family=6))
        assert locator.locate(network.network_address) == locate(city)
    with pytest.raises(ValueError, match="unknown location 'mars'"):
        ClientLocator({"10.0.0.0/8": "mars"}, LOCATIONS)


def test_nearest_healthy_region_answers_each_city() -> None:
    targets = fleet()
    expected = {
        "new-york": "us-east",
        "toronto": "us-east",
        "seattle": "us-west",
        "los-angeles": "us-west",
        "london": "eu-west",
        "paris": "eu-central",
        "stockholm": "eu-central",
        "buenos-aires": "sa-east",
        "mumbai": "ap-southeast",
        "sydney": "ap-southeast",
        "seoul": "ap-northeast",
    }
    assert {city: pick(city, targets) for city in expected} == expected


def test_unhealthy_disabled_draining_and_unaddressed_regions_are_skipped() -> None:
    for broken in (
        target("eu-west", num_healthy_nodes=0),
        target("eu-west", state="disabled"),
        target("eu-west", state="draining"),
        target("eu-west", has_address=False),
    ):
        assert pick("london", fleet(eu_west=broken)) == "eu-central"


def test_fail_open_to_the_nearest_when_nothing_is_healthy() -> None:
    dead = [target(name, num_healthy_nodes=0) for name in REGIONS]
    decision = choose(locate("london"), 0.0, dead, frozenset(), 0.5)
    assert decision is not None and decision.reason == "fail_open"
    assert decision.target.name == "eu-west"
    # An operator's "disabled" is honoured while anything else can answer...
    dead[list(REGIONS).index("eu-west")] = target("eu-west", state="disabled")
    assert pick("london", dead) == "eu-central"
    # ...and only when everything is disabled is the nearest disabled one answered.
    all_disabled = [target(name, state="disabled") for name in REGIONS]
    assert pick("london", all_disabled) == "eu-west"
    assert choose(locate("london"), 0.0, [], frozenset(), 0.5) is None


def test_shedding_moves_the_hashed_share_to_the_next_nearest_unsaturated() -> None:
    targets = fleet()
    shedding = frozenset({"eu-west"})
    moved = choose(locate("london"), 0.2, targets, shedding, shed_share=0.5)
    kept = choose(locate("london"), 0.7, targets, shedding, shed_share=0.5)
    assert moved is not None and (moved.target.name, moved.reason) == ("eu-central", "shed")
    assert kept is not None and (kept.target.name, kept.reason) == ("eu-west", "nearest")
    # The next-nearest is shedding too: skip to one that is not.
    both = frozenset({"eu-west", "eu-central"})
    moved = choose(locate("london"), 0.2, targets, both, shed_share=0.5)
    assert moved is not None and moved.target.name == "us-east"
    # Everyone healthy is shedding: moving helps nobody, the nearest answers.
    everyone = frozenset(REGIONS)
    stay = choose(locate("london"), 0.2, targets, everyone, shed_share=0.5)
    assert stay is not None and stay.target.name == "eu-west"


def test_shedding_has_hysteresis_so_oscillating_load_does_not_flap() -> None:
    def step(previous: frozenset[str], used: float, queue_s: float = 0.0) -> frozenset[str]:
        return next_shedding(
            previous, [target("eu-west", kv_used_share=used, queue_delay_s=queue_s)], MARKS
        )

    state: frozenset[str] = frozenset()
    # Between the marks and not shedding: stays out, however it oscillates.
    for used in (0.85, 0.89, 0.81, 0.9, 0.86):
        state = step(state, used)
        assert state == frozenset()
    state = step(state, 0.95)  # above the enter mark: in
    assert state == {"eu-west"}
    for used in (0.85, 0.89, 0.81, 0.9, 0.86):  # between the marks while shedding: stays in
        state = step(state, used)
        assert state == {"eu-west"}
    assert step(state, 0.8) == frozenset()  # at the leave mark: out
    # Queue delay has its own pair of marks; both must be low to leave.
    state = step(frozenset(), 0.1, queue_s=6.0)
    assert state == {"eu-west"}
    assert step(state, 0.1, queue_s=3.0) == {"eu-west"}
    assert step(state, 0.85, queue_s=1.0) == {"eu-west"}
    assert step(state, 0.1, queue_s=1.0) == frozenset()
    # An unhealthy region is not "shedding": it gets no clients at all.
    sick = [target("eu-west", num_healthy_nodes=0, kv_used_share=0.99)]
    assert next_shedding(frozenset({"eu-west"}), sick, MARKS) == frozenset()


def test_client_subnets_hash_stably_and_spread() -> None:
    a = client_network(ipaddress.ip_address("198.51.100.77"))
    assert str(a) == "198.51.100.0/24"
    assert str(client_network(ipaddress.ip_address("198.51.100.77"), 16)) == "198.51.0.0/16"
    assert str(client_network(ipaddress.ip_address("2001:db8::1"), 64)) == "2001:db8::/56"
    assert client_hash(a) == client_hash(client_network(ipaddress.ip_address("198.51.100.1")))
    shares = [client_hash(ipaddress.ip_network((0x0A000000 + (i << 8), 24))) for i in range(1000)]
    assert all(0.0 <= share < 1.0 for share in shares)
    assert 400 < sum(share < 0.5 for share in shares) < 600


def test_dns_config_refuses_bad_values_at_start() -> None:
    with pytest.raises(ValueError, match=r"not in dns\.zone"):
        DnsConfig(zone="meridian.test", hostname="api.example.test")
    with pytest.raises(ValueError, match="unknown location 'mars'"):
        DnsConfig(client_subnets={"10.0.0.0/8": "mars"})
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 network"):
        DnsConfig(client_subnets={"10.0.0.0/40": "paris"})
    with pytest.raises(ValueError, match="leave_queue_delay_s"):
        DnsConfig(enter_queue_delay_s=1.0, leave_queue_delay_s=2.0)

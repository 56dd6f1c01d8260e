"""Building blocks of the world: Anycast catchments, the DNS resolver caches, the summary watch."""

from __future__ import annotations

import gc

from simulator.access import AnycastAccess, DnsAccess
from simulator.calibration import ServiceCalibration
from simulator.compare import world_spec
from simulator.control import ControlTiming, PopWatch, SimControlPlane
from simulator.events import EventLoop
from simulator.models import DEFAULT_MODEL
from simulator.policies import NearestChooser
from simulator.run import World, WorldOptions
from simulator.scenarios import SCENARIOS
from wire.geo import REGIONS
from wire.model_catalog import ModelCatalog
from wire.region_summary import ModelLoad, QueueEstimate, RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy


def test_a_run_leaves_what_the_process_froze_frozen_and_thaws_only_its_own() -> None:
    """A world freezes what exists before its run; where the process froze objects of its own
    (the suite freezes its modules), thawing the world's would thaw those too, and every later
    full collection would walk them again."""
    spec = world_spec(SCENARIOS["steady"], 0, 10, ServiceCalibration())
    gc.freeze()
    World(spec, "meridian").run()
    assert gc.get_freeze_count() > 0  # (unfreezing empties the permanent generation)
    gc.unfreeze()
    World(spec, "meridian").run()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the suite's freeze (tests/suite_gc.py), as it was


def test_a_withdrawn_pop_sends_its_clients_to_the_next_nearest_and_wins_them_back() -> None:
    spec = world_spec(SCENARIOS["steady"], 0, 10, ServiceCalibration())
    access = World(spec, "meridian").traffic.access
    assert isinstance(access, AnycastAccess)
    before = dict(access.catchment)
    assert before["tokyo"] == before["seoul"] == "tokyo"
    access.withdraw("tokyo")
    assert access.pop_for("tokyo", 0.0) == access.pop_for("seoul", 0.0) == "singapore"
    moved = {city for city in before if before[city] != access.catchment[city]}
    assert moved == {city for city, pop in before.items() if pop == "tokyo"}
    access.announce("tokyo")
    assert access.catchment == before


def test_a_pop_found_by_dns_changes_only_once_the_resolvers_ttl_has_passed() -> None:
    spec = world_spec(SCENARIOS["steady"], 0, 10, ServiceCalibration(), WorldOptions(access="dns"))
    access = World(spec, "meridian").traffic.access
    assert isinstance(access, DnsAccess)
    geography = spec.geography
    anycast = AnycastAccess(geography.pops, geography.cities)
    # The DNS decision and Anycast agree on the nearest PoP while every PoP is up.
    assert {c: access.pop_for(c, 0.0) for c in geography.cities} == anycast.catchment
    ttl_s = access.config.ttl_s
    access.withdraw("tokyo")
    assert access.pop_for("tokyo", ttl_s - 0.01) == "tokyo"  # the resolver's cached answer
    assert access.pop_for("tokyo", ttl_s) == "singapore"
    access.announce("tokyo")
    assert access.pop_for("tokyo", ttl_s + 1.0) == "singapore"  # cached again
    assert access.pop_for("tokyo", 2 * ttl_s) == "tokyo"


def summary(name: str, healthy_nodes: int) -> RegionSummary:
    place = REGIONS[name]
    queue = QueueEstimate(
        num_waiting=0, num_waiting_prefill_tokens=0, decode_tokens_per_s=0.0,
        expected_queue_delay_s=0.0,
    )  # fmt: skip
    served = ModelLoad(
        name=DEFAULT_MODEL, healthy_nodes=healthy_nodes, kv_blocks_free=10, kv_blocks_total=10,
        queue=queue,
    )  # fmt: skip
    return RegionSummary(
        name=name,
        lat=place.lat,
        lon=place.lon,
        state="active",
        ingress_url=f"http://198.19.0.{len(name)}:8000",
        healthy_nodes=healthy_nodes,
        kv_blocks_free=10,
        kv_blocks_total=10,
        queue=queue,
        weight=1.0,
        models=(served,) if healthy_nodes else (),
    )


def document(index: int, tokyo_nodes: int) -> RegionSummaryIndex:
    regions = [summary("ap-northeast", tokyo_nodes), summary("ap-southeast", 2)]
    return RegionSummaryIndex(index=index, regions=regions, routing=RoutingPolicy())


def test_a_dns_answer_changes_only_once_its_ttl_has_passed() -> None:
    current = [document(1, tokyo_nodes=2)]
    dns = NearestChooser(lambda: current[0], ["tokyo"])
    ttl_s = dns.config.ttl_s
    assert dns.answer("tokyo", DEFAULT_MODEL, 10.0) == "ap-northeast"
    current[0] = document(2, tokyo_nodes=0)  # Tokyo's nodes are gone
    # The resolver's cache.
    assert dns.answer("tokyo", DEFAULT_MODEL, 10.0 + ttl_s - 0.01) == "ap-northeast"
    assert dns.answer("tokyo", DEFAULT_MODEL, 10.0 + ttl_s) == "ap-southeast"


def test_a_watch_hears_of_each_change_one_way_later_and_polls_again_at_once() -> None:
    control = SimControlPlane(
        EventLoop(), ControlTiming(), {}, RoutingPolicy(), seed=0, catalog=ModelCatalog()
    )
    first = control.current
    control.published_s += [1.0, 1.05]
    control.documents += [document(first.index + 1, 2), document(first.index + 2, 2)]
    watch = PopWatch(control, delay_s=0.1, poll_at_cp_s=0.1)
    assert watch.read(0.19) is None  # the first answer is on its way
    assert watch.read(0.2) is first
    assert watch.read(1.09) is first
    second = watch.read(1.1)  # published at 1.0, 0.1 s on the way
    assert second is not None and second.index == first.index + 1
    # The next poll reached the control plane at 1.2, after the third was published at 1.05.
    assert watch.read(1.29) is second
    third = watch.read(1.31)
    assert third is not None and third.index == first.index + 2

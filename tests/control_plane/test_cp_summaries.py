"""Region summaries and blocking queries, against the app served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from conftest import ControlPlaneClient, eventually, make_settings

from control_plane.changes import ChangeFeed, parse_wait_s
from control_plane.model import Fleet, Listed, Node, NodeIdentity, Region
from control_plane.settings import Settings
from control_plane.summaries import (
    MAX_QUEUE_DELAY_S,
    SummaryPublisher,
    expected_queue_delay_s,
    route_view,
    summarize_region,
)
from control_plane.tokens import TokenSet
from wire.heartbeat import Heartbeat
from wire.model_catalog import ModelCatalog
from wire.region_summary import RegionSummary, RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

NUM_WATCHERS = 50


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet) -> Settings:
    # Production's sweep interval (0.25 s), fast heartbeats so health changes come quickly.
    return make_settings(
        tmp_path / "cp.db", tokens, heartbeat_interval_s=0.2, sweep_interval_s=0.25
    )


async def watch(
    cp: ControlPlaneClient, index: int, wait: str = "10s"
) -> tuple[RegionSummaryIndex, float]:
    started = time.monotonic()
    response = await cp.http.get(
        "/v1/regions/summary", params={"index": index, "wait": wait}, headers=cp.gateway
    )
    assert response.status_code == 200, response.text
    assert int(response.headers["x-meridian-index"]) == int(response.json()["index"])
    return RegionSummaryIndex.model_validate_json(response.content), time.monotonic() - started


async def current_when(
    cp: ControlPlaneClient, holds: Callable[[RegionSummaryIndex], bool]
) -> RegionSummaryIndex:
    """The summaries once `holds` is true of them (polled, bounded)."""
    found: list[RegionSummaryIndex] = []

    async def check() -> bool:
        found[:] = [await current(cp)]
        return holds(found[0])

    await eventually(check)
    return found[0]


async def current(cp: ControlPlaneClient) -> RegionSummaryIndex:
    return (await watch(cp, 0))[0]


@pytest.mark.asyncio
async def test_an_admin_change_wakes_every_waiting_gateway(live_cp: ControlPlaneClient) -> None:
    await live_cp.add_region("us-east")
    before = await current(live_cp)
    watchers = [asyncio.create_task(watch(live_cp, before.index)) for _ in range(NUM_WATCHERS)]
    await asyncio.sleep(0.3)
    assert not any(w.done() for w in watchers)
    patch = await live_cp.http.patch(
        "/v1/regions/us-east", json={"state": "draining"}, headers=live_cp.admin
    )
    assert patch.status_code == 200
    # Woken by the change, long before their 10 s wait ends (how soon is bench/fleet_measure.py's
    # to measure, not a test's).
    results = await asyncio.wait_for(asyncio.gather(*watchers), timeout=5)
    for document, waited_s in results:
        assert document.index > before.index and document.regions[0].state == "draining"
        assert waited_s < 5


@pytest.mark.asyncio
async def test_wait_times_out_with_the_same_index(live_cp: ControlPlaneClient) -> None:
    await live_cp.add_region("us-east")
    before = await current(live_cp)
    document, waited_s = await watch(live_cp, before.index, wait="700ms")
    assert 0.65 <= waited_s < 5  # its own wait, not the 10 s default
    assert document.index == before.index and document == before


@pytest.mark.asyncio
async def test_index_zero_or_from_elsewhere_answers_at_once(live_cp: ControlPlaneClient) -> None:
    before = await current(live_cp)
    _, waited_s = await watch(live_cp, 0, wait="5s")
    assert waited_s < 0.5
    ahead, waited_s = await watch(live_cp, before.index + 1000, wait="5s")
    assert waited_s < 0.5 and ahead.index == before.index


@pytest.mark.asyncio
async def test_a_silent_node_leaves_the_summary_of_a_waiting_gateway(
    live_cp: ControlPlaneClient,
) -> None:
    await live_cp.add_region("us-east")
    # Read before the beat is sent: the control plane stamps it on arrival, so the silence it
    # counts is at most what is measured from here.
    last_beat_at = time.monotonic()
    await live_cp.beat("n1")
    before = await current_when(live_cp, lambda doc: doc.regions[0].healthy_nodes == 1)
    assert before.regions[0].healthy_nodes == 1
    document, _ = await watch(live_cp, before.index)
    silent_s = time.monotonic() - last_beat_at
    assert document.regions[0].healthy_nodes == 0 and document.regions[0].kv_blocks_total == 0
    assert before.regions[0].unhealthy_nodes == () and document.regions[0].unhealthy_nodes == (
        "n1",
    )
    # Unhealthy once 3 × 0.2 s have passed, not before; and the waiting gateway hears of it at
    # the next sweep, not when its 10 s wait ends.
    assert 0.6 <= silent_s < 5


@pytest.mark.asyncio
async def test_capacity_change_reaches_waiting_gateway(live_cp: ControlPlaneClient) -> None:
    await live_cp.add_region("us-east")
    await live_cp.beat("n1", kv_blocks_free=600)
    before = await current_when(live_cp, lambda doc: doc.regions[0].kv_blocks_free == 600)
    watcher = asyncio.create_task(watch(live_cp, before.index))
    await asyncio.sleep(0.1)
    await live_cp.beat("n1", kv_blocks_free=10)
    document, _ = await asyncio.wait_for(watcher, timeout=5)
    assert document.regions[0].kv_blocks_free == 10


@pytest.mark.asyncio
async def test_routing_policy_change_is_published_with_the_summaries(
    live_cp: ControlPlaneClient,
) -> None:
    before = await current(live_cp)
    assert before.routing.rtt_weight == 1.0
    watcher = asyncio.create_task(watch(live_cp, before.index))
    await asyncio.sleep(0.1)
    put = await live_cp.http.put(
        "/v1/routing", json={"rtt_weight": 2.0, "affinity_enabled": False}, headers=live_cp.admin
    )
    assert put.status_code == 200
    document, _ = await asyncio.wait_for(watcher, timeout=5)
    assert document.routing.rtt_weight == 2.0 and document.routing.affinity_enabled is False


def beat_of(node_id: str, identity: NodeIdentity) -> Heartbeat:
    """An idle node's beat (100 KV blocks, all free)."""
    return Heartbeat(
        node_id=node_id,
        region=identity.region,
        url=identity.url,
        model=identity.model,
        kv_blocks_total=100,
        kv_blocks_free=100,
        block_size=16,
        timestamp=0.0,
    )


def test_a_beat_publishes_a_node_back_to_health_now_and_capacity_at_the_tick() -> None:
    region = Region("us-east", 39.0, -77.5, None, 1.0, "active", 0.0, 0.0)
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": region})
    identity = NodeIdentity(region="us-east", url="http://n1.test:9001", model="m", tp_size=1)
    node = fleet.nodes["n1"] = Node("n1", identity, False, 0.0)
    publisher = SummaryPublisher(fleet, RoutingPolicy, ModelCatalog, ChangeFeed(1))
    beat = beat_of("n1", identity)

    def record(beat: Heartbeat, now_s: float) -> bool:
        was = route_view(node)
        fleet.record_beat(node, beat, now_s, now_s)
        return publisher.follow_beat("us-east", was, node)

    assert record(beat, 0.0)  # the node's first beat: in the summary at once
    assert publisher.current.regions[0].healthy_nodes == 1
    index = publisher.current.index
    assert not record(beat.model_copy(update={"kv_blocks_free": 10}), 1.0)
    assert publisher.current.index == index  # live capacity waits for the tick...
    publisher.tick(1.1)
    assert publisher.current.index > index and publisher.current.regions[0].kv_blocks_free == 10


def test_a_tick_recomputes_only_the_regions_whose_nodes_beat_or_fell_silent() -> None:
    names = ["eu-west", "us-east"]
    regions = {n: Region(n, 0.0, 0.0, None, 1.0, "active", 0.0, 0.0) for n in names}
    fleet = Fleet(unhealthy_after_s=3.0, regions=regions)
    beats = {}
    for name in names:
        identity = NodeIdentity(region=name, url=f"http://{name}.test:9001", model="m", tp_size=1)
        fleet.nodes[name] = Node(name, identity, False, 0.0)
        beats[name] = beat_of(name, identity)
        fleet.record_beat(fleet.nodes[name], beats[name], 0.0, 0.0)
    publisher = SummaryPublisher(fleet, RoutingPolicy, ModelCatalog, ChangeFeed(1))
    summarized: list[str] = []

    def counted(region: Region, nodes: list[Node], listed: Listed) -> RegionSummary:
        summarized.append(region.name)
        return summarize_region(region, nodes, listed)

    with mock.patch("control_plane.summaries.summarize_region", side_effect=counted):
        publisher.tick(1.0)  # nothing beat: nothing recomputed, nothing published
        assert summarized == [] and publisher.current.index == 1
        node = fleet.nodes["us-east"]
        was = route_view(node)
        fleet.record_beat(node, beats["us-east"].model_copy(update={"kv_blocks_free": 7}), 1, 1)
        assert not publisher.follow_beat("us-east", was, node)
        publisher.tick(1.5)
        assert summarized == ["us-east"]
        assert [r.kv_blocks_free for r in publisher.current.regions] == [100, 7]
        index = publisher.current.index
        publisher.tick(3.5)  # eu-west silent for 3.5 s: it alone leaves the summary
        assert summarized == ["us-east", "eu-west"] and publisher.current.index > index
        assert [r.healthy_nodes for r in publisher.current.regions] == [0, 1]


def test_a_summary_names_the_unhealthy_nodes_and_not_the_draining_ones() -> None:
    region = Region("us-east", 39.0, -77.5, None, 1.0, "active", 0.0, 0.0)
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": region})
    for name in ("n3", "n1", "n2", "n4"):
        identity = NodeIdentity("us-east", f"http://{name}.test:9001", "m", 1)
        node = fleet.nodes[name] = Node(name, identity, name == "n4", 0.0)
        fleet.record_beat(node, beat_of(name, identity), 0.0 if name in ("n1", "n3") else 2.0, 0.0)
    fleet.sweep(4.0)  # n1 and n3 silent for 4 s; n2 beats; n4 beats, but drains
    summary = summarize_region(region, list(fleet.nodes.values()))
    assert summary.healthy_nodes == 1  # n2: n4 takes no traffic, but is not unhealthy
    assert summary.unhealthy_nodes == ("n1", "n3")


def test_expected_queue_delay() -> None:
    assert expected_queue_delay_s(0, 0.0) == 0.0
    assert expected_queue_delay_s(1000, 500.0) == 2.0
    assert expected_queue_delay_s(10, 0.0) == 10.0  # no throughput yet: 1 token/s floor
    assert expected_queue_delay_s(10**9, 1.0) == MAX_QUEUE_DELAY_S


def test_parse_wait() -> None:
    assert parse_wait_s("30s", 300) == 30.0
    assert parse_wait_s("500ms", 300) == 0.5
    assert parse_wait_s("2m", 300) == 120.0
    assert parse_wait_s("7", 300) == 7.0
    assert parse_wait_s("10m", 300) == 300.0
    with pytest.raises(ValueError):
        parse_wait_s("soon", 300)


@pytest.mark.asyncio
async def test_change_feed_semantics() -> None:
    feed = ChangeFeed(5)
    assert await feed.wait_past(0, 10) == 5  # 0 never blocks
    assert await feed.wait_past(4, 10) == 5  # behind: at once
    assert await feed.wait_past(9, 10) == 5  # ahead (another server): at once
    started = time.monotonic()
    assert await feed.wait_past(5, 0.1) == 5
    assert time.monotonic() - started >= 0.1
    waiter = asyncio.create_task(feed.wait_past(5, 10))
    await asyncio.sleep(0.01)
    assert feed.advance() == 6
    assert await asyncio.wait_for(waiter, 1) == 6
    feed.advance_to(3)
    assert feed.index == 6
    feed.advance_to(9)
    assert feed.index == 9
    closing = asyncio.create_task(feed.wait_past(9, 10))
    await asyncio.sleep(0.01)
    feed.close()
    assert await asyncio.wait_for(closing, 1) == 9


def test_the_document_carries_the_catalog_and_a_catalog_change_republishes_it() -> None:
    fleet = Fleet(unhealthy_after_s=3.0, regions={})
    catalog = ModelCatalog()
    publisher = SummaryPublisher(fleet, RoutingPolicy, lambda: catalog, ChangeFeed(1))
    assert publisher.current.catalog == ModelCatalog() and publisher.current.is_model_aware
    assert not publisher.refresh()  # nothing changed
    catalog = ModelCatalog.model_validate({"models": [{"name": "m"}]})
    assert publisher.refresh()
    assert publisher.current.catalog == catalog and publisher.current.index == 2
    assert RegionSummaryIndex.model_validate_json(publisher.body).catalog == catalog

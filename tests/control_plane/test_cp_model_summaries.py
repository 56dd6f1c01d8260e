"""Per-model region summaries: each routable model's load over its own nodes, listed models only
once the catalog lists any, and the unlisted nodes in status; in memory and through the app."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ControlPlaneClient, eventually

from control_plane.api.nodes import view_of
from control_plane.changes import ChangeFeed
from control_plane.model import Fleet, Node, NodeIdentity, Region, listed_models
from control_plane.summaries import SummaryPublisher, summarize_region
from wire.heartbeat import Heartbeat, ModelIdentity
from wire.model_catalog import ModelCatalog
from wire.region_summary import RegionSummaryIndex
from wire.routing_policy import RoutingPolicy

REGION = Region("us-east", 39.0, -77.5, None, 1.0, "active", 0.0, 0.0)
Q4 = ModelIdentity(weights_id="a" * 32, context_length=8192, dtype="fp32", quantization="q4_1")
FP32 = ModelIdentity(weights_id="a" * 32, context_length=2048, dtype="fp32", quantization="none")


def identity_body(identity: ModelIdentity) -> dict[str, Any]:
    return identity.model_dump()


def add_node(
    fleet: Fleet,
    node_id: str,
    model: str,
    identity: ModelIdentity | None = None,
    drain: bool = False,
    **load: Any,
) -> Node:
    """A node of us-east that has beaten once (idle unless `load` says otherwise)."""
    who = NodeIdentity("us-east", f"http://{node_id}.test:9001", model, 1)
    node = fleet.nodes[node_id] = Node(node_id, who, drain, 0.0)
    values: dict[str, Any] = {"kv_blocks_total": 100, "kv_blocks_free": 100, "block_size": 16}
    beat = Heartbeat(
        node_id=node_id,
        region="us-east",
        url=who.url,
        model=model,
        model_identity=identity,
        timestamp=0.0,
        **(values | load),
    )
    fleet.record_beat(node, beat, 0.0, 0.0)
    return node


def test_each_model_is_summarized_over_its_own_routable_nodes() -> None:
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": REGION})
    add_node(
        fleet,
        "a1",
        "small",
        Q4,
        kv_blocks_free=40,
        num_waiting=2,
        num_waiting_prefill_tokens=300,
        decode_tokens_per_s=100.0,
    )
    add_node(fleet, "a2", "small", FP32, kv_blocks_free=10, num_running_prefill_tokens=50)
    add_node(fleet, "a3", "small", Q4)  # the same serving key as a1: listed once
    add_node(fleet, "a4", "small", Q4, drain=True)  # takes no traffic: in no load
    add_node(fleet, "b1", "large", kv_blocks_total=500, kv_blocks_free=500)  # no identity
    # Healthy without a beat (restored, or known from Consul): counted, with no numbers.
    b2 = NodeIdentity("us-east", "http://b2.test:9001", "large", 1)
    fleet.nodes["b2"] = Node("b2", b2, False, 0.0, is_beating=True)

    summary = summarize_region(REGION, list(fleet.nodes.values()))

    assert (summary.healthy_nodes, summary.kv_blocks_total, summary.kv_blocks_free) == (5, 800, 650)
    large, small = summary.models
    assert (large.name, small.name) == ("large", "small")
    assert small.healthy_nodes == 3 and (small.kv_blocks_total, small.kv_blocks_free) == (300, 150)
    assert small.serving_keys == tuple(sorted({Q4.serving_key, FP32.serving_key}))
    assert small.context_length == 2048  # the least: a request must fit any of its nodes
    assert (small.queue.num_waiting, small.queue.num_waiting_prefill_tokens) == (2, 300)
    assert small.queue.num_running_prefill_tokens == 50
    assert small.queue.decode_tokens_per_s == 100.0 and small.queue.expected_queue_delay_s == 3.0
    assert large.healthy_nodes == 2 and (large.kv_blocks_total, large.kv_blocks_free) == (500, 500)
    assert large.serving_keys == () and large.context_length is None
    assert large.queue.num_waiting == 0 and summary.queue.num_waiting == 2


def test_once_the_catalog_lists_models_only_they_are_summarized() -> None:
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": REGION})
    add_node(fleet, "a1", "small", Q4)
    add_node(fleet, "b1", "large")
    catalog = ModelCatalog.model_validate({"models": [{"name": "small"}]})
    publisher = SummaryPublisher(fleet, RoutingPolicy, lambda: catalog, ChangeFeed(1))
    (summary,) = publisher.current.regions
    assert [m.name for m in summary.models] == ["small"]
    assert summary.healthy_nodes == 2  # the totals stay over every node
    assert publisher.listed == {"small"}
    assert not view_of(fleet.nodes["b1"], publisher.listed).listed
    assert view_of(fleet.nodes["a1"], publisher.listed).listed

    # The operator lists the other model too: it is routed to from the next document on.
    catalog = ModelCatalog.model_validate({"models": [{"name": "small"}, {"name": "large"}]})
    assert publisher.refresh()
    assert [m.name for m in publisher.current.regions[0].models] == ["large", "small"]
    assert view_of(fleet.nodes["b1"], publisher.listed).listed
    # A tick recomputes with the catalog of the document it publishes into.
    b1 = fleet.nodes["b1"]
    assert b1.last_beat is not None
    fleet.record_beat(b1, b1.last_beat.model_copy(update={"kv_blocks_free": 7}), 1.0, 1.0)
    publisher.mark_dirty("us-east")
    publisher.tick(1.0)
    assert [m.kv_blocks_free for m in publisher.current.regions[0].models] == [7, 100]
    assert listed_models(ModelCatalog()) is None and listed_models(None) is None


def test_with_an_empty_catalog_a_model_without_healthy_nodes_stays_listed_with_none() -> None:
    """So that a gateway answers 503 (no capacity now), not 404, while every node of the model
    is unhealthy or draining; a catalog that lists models decides alone."""
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": REGION})
    add_node(fleet, "a1", "small", Q4)
    add_node(fleet, "b1", "large", drain=True)
    add_node(fleet, "c1", "other")
    fleet.nodes["c1"].is_beating = False  # unhealthy
    summary = summarize_region(REGION, list(fleet.nodes.values()))
    loads = {m.name: m.healthy_nodes for m in summary.models}
    assert loads == {"small": 1, "large": 0, "other": 0}
    assert summary.healthy_nodes == 1 and summary.unhealthy_nodes == ("c1",)
    listed = summarize_region(REGION, list(fleet.nodes.values()), frozenset({"small", "large"}))
    assert [m.name for m in listed.models] == ["small"]


@pytest.mark.asyncio
async def test_beats_with_model_identities_reach_the_summaries_and_status(
    live_cp: ControlPlaneClient,
) -> None:
    await live_cp.add_region("us-east")
    await live_cp.beat("n1", model="small", model_identity=identity_body(Q4))
    await live_cp.beat("n2", model="small", model_identity=identity_body(FP32))
    await live_cp.beat("n3", model="large")
    found: list[RegionSummaryIndex] = []

    async def both_models() -> bool:
        response = await live_cp.http.get("/v1/regions/summary", headers=live_cp.gateway)
        found[:] = [RegionSummaryIndex.model_validate_json(response.content)]
        return [m.healthy_nodes for m in found[0].regions[0].models] == [1, 2]

    await eventually(both_models)
    document = found[0]
    assert document.is_model_aware and document.catalog == ModelCatalog()
    large, small = document.regions[0].models
    assert (large.name, large.serving_keys) == ("large", ())
    assert small.serving_keys == tuple(sorted([Q4.serving_key, FP32.serving_key]))
    assert small.context_length == 2048 and small.kv_blocks_free == 1200

    status = (await live_cp.http.get("/v1/status", headers=live_cp.admin)).json()
    assert status["unlisted_models"] == []  # the catalog is empty: every model is listed
    nodes = {node["node_id"]: node for node in status["nodes"]}
    assert nodes["n1"]["model"] == "small" and nodes["n1"]["listed"]
    assert nodes["n1"]["last_heartbeat"]["model_identity"] == identity_body(Q4)
    listing = (await live_cp.http.get("/v1/nodes", headers=live_cp.admin)).json()
    assert [(n["model"], n["listed"]) for n in listing["nodes"]] == [
        ("small", True),
        ("small", True),
        ("large", True),
    ]

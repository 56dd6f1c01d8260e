"""A node that beats but says its engine is not alive (its core process stopped answering) is
unhealthy at once: out of the routes and named among its region's unhealthy nodes, so that a
gateway cuts its silent streams short; a beat that says the engine is alive again brings it
back."""

from __future__ import annotations

from control_plane.changes import ChangeFeed
from control_plane.model import Fleet, Node, NodeIdentity, Region
from control_plane.summaries import SummaryPublisher, route_view
from wire.heartbeat import Heartbeat
from wire.model_catalog import ModelCatalog
from wire.routing_policy import RoutingPolicy


def test_a_beat_without_a_live_engine_makes_the_node_unhealthy_at_once_and_back() -> None:
    region = Region("us-east", 39.0, -77.5, None, 1.0, "active", 0.0, 0.0)
    fleet = Fleet(unhealthy_after_s=3.0, regions={"us-east": region})
    identity = NodeIdentity(region="us-east", url="http://n1.test:9001", model="m", tp_size=1)
    node = fleet.nodes["n1"] = Node("n1", identity, False, 0.0)
    publisher = SummaryPublisher(fleet, RoutingPolicy, ModelCatalog, ChangeFeed(1))
    beat = Heartbeat(
        node_id="n1",
        region="us-east",
        url=identity.url,
        model="m",
        kv_blocks_total=100,
        kv_blocks_free=100,
        block_size=16,
        timestamp=0.0,
    )

    def record(beat: Heartbeat, now_s: float) -> bool:
        was = route_view(node)
        fleet.record_beat(node, beat, now_s, now_s)
        return publisher.follow_beat("us-east", was, node)

    assert record(beat, 0.0) and node.is_healthy
    assert publisher.current.regions[0].healthy_nodes == 1
    assert record(beat.model_copy(update={"engine_alive": False}), 0.5)  # published at once
    assert not node.is_healthy and not node.is_routable
    summary = publisher.current.regions[0]
    assert summary.healthy_nodes == 0 and summary.unhealthy_nodes == ("n1",)
    assert record(beat, 1.0) and node.is_healthy
    assert publisher.current.regions[0].unhealthy_nodes == ()


def test_a_beat_that_does_not_say_is_judged_by_the_beats_alone() -> None:
    # An older node agent: no engine_alive in its beats.
    body = {
        "node_id": "n1",
        "region": "us-east",
        "url": "http://n1.test:9001",
        "model": "m",
        "kv_blocks_total": 1,
        "kv_blocks_free": 1,
        "block_size": 16,
        "timestamp": 0.0,
    }
    assert Heartbeat.model_validate(body).engine_alive is True

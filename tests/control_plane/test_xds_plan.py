"""Pure parts of xDS: fleet → plan (weights), plan → resources, validation, content versions."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import heartbeat
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from control_plane.model import Fleet, Node, NodeIdentity, Region
from control_plane.xds.groups import EnvoyGroup, EnvoyNodeError, Role, group_of
from control_plane.xds.plan import (
    Endpoint,
    EnvoyPlan,
    Locality,
    capacity_weights,
    plan_edge,
    plan_for,
    plan_ingress,
    upstream_address,
)
from control_plane.xds.proto_rules import proto_violations
from control_plane.xds.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    resources_of,
)
from control_plane.xds.snapshot import InvalidSnapshotError, build_snapshot
from control_plane.xds.validation import snapshot_violations
from wire.heartbeat import Heartbeat

INGRESS = EnvoyGroup(Role.INGRESS, "us-east", "127.0.0.1", 10000)
EDGE = EnvoyGroup(Role.EDGE, None, "127.0.0.1", 10001)


def add_region(fleet: Fleet, name: str, **fields: Any) -> None:
    values: dict[str, Any] = {
        "lat": 40.7,
        "lon": -74.0,
        "ingress_url": None,
        "weight": 1.0,
        "state": "active",
        "created_at": 0.0,
        "updated_at": 0.0,
    }
    fleet.regions[name] = Region(name=name, **(values | fields))


def add_node(
    fleet: Fleet, node_id: str, region: str = "us-east", port: int = 9001, **beat: Any
) -> Node:
    """A node that has just beaten (healthy), with `beat` fields over conftest's heartbeat."""
    body = heartbeat(node_id, region, url=f"http://127.0.0.1:{port}") | beat
    parsed = Heartbeat.model_validate(body)
    node = Node(
        node_id=node_id,
        identity=NodeIdentity.of(parsed),
        drain_requested=False,
        registered_at=0.0,
    )
    fleet.nodes[node_id] = node
    fleet.record_beat(node, parsed, time.monotonic(), time.time())
    return node


def weights(plan: EnvoyPlan) -> dict[str, int]:
    return {e.node_id: e.weight for loc in plan.localities for e in loc.endpoints}


def test_capacity_weights_are_percent_shares_at_least_one() -> None:
    assert capacity_weights({"a": 300, "b": 100}) == {"a": 75, "b": 25}
    assert capacity_weights({"a": 10_000, "b": 1}) == {"a": 100, "b": 1}
    assert capacity_weights({"a": 0, "b": 0}) == {"a": 1, "b": 1}
    assert capacity_weights({}) == {}


def test_upstream_address_takes_plain_http_ip_urls_only() -> None:
    assert upstream_address("http://127.0.0.1:9001") == ("127.0.0.1", 9001)
    assert upstream_address("http://localhost:9001/v1") == ("127.0.0.1", 9001)
    assert upstream_address("http://[::1]:9001") == ("::1", 9001)
    assert upstream_address("http://10.0.0.5") == ("10.0.0.5", 80)
    assert upstream_address("https://127.0.0.1:9001") is None
    assert upstream_address("http://node-1.internal:9001") is None


def test_ingress_plan_weights_routable_nodes_by_free_kv_share() -> None:
    fleet = Fleet(unhealthy_after_s=3.0)
    add_region(fleet, "us-east")
    add_node(fleet, "a", port=9001, kv_blocks_free=600)
    add_node(fleet, "b", port=9002, kv_blocks_free=200)
    add_node(fleet, "full", port=9003, kv_blocks_free=0)
    add_node(fleet, "drained", port=9004).drain_requested = True
    add_node(fleet, "leaving", port=9005, draining=True)
    add_node(fleet, "silent", port=9006).is_beating = False
    add_node(fleet, "tls", url="https://127.0.0.1:9007")
    add_node(fleet, "elsewhere", region="eu-west", port=9008)

    plan = plan_ingress(INGRESS, fleet)
    assert plan.cluster_name == "meridian_us-east_nodes" and not plan.is_locality_weighted
    # Full but healthy: a trickle (1). Drained, draining, silent: no endpoint at all.
    assert weights(plan) == {"a": 75, "b": 25, "full": 1}
    assert plan.skipped_node_ids == ("tls",)
    assert [loc.region for loc in plan.localities] == ["us-east"]
    assert plan_for(INGRESS, fleet) == plan


def test_ingress_plan_of_an_unregistered_or_empty_region_has_no_endpoints() -> None:
    fleet = Fleet(unhealthy_after_s=3.0)
    add_node(fleet, "a")
    assert plan_ingress(INGRESS, fleet).localities == ()
    add_region(fleet, "us-east")
    fleet.nodes["a"].drain_requested = True
    assert plan_ingress(INGRESS, fleet).localities == ()


def test_edge_plan_has_one_weighted_locality_per_active_region() -> None:
    fleet = Fleet(unhealthy_after_s=3.0)
    add_region(fleet, "us-east")
    add_region(fleet, "us-west", weight=3.0)
    add_region(fleet, "eu-west", ingress_url="http://127.0.0.1:10443")
    add_region(fleet, "ap-south", state="draining")
    add_region(fleet, "sa-east", weight=0.0)
    add_region(fleet, "af-south")  # no nodes
    add_node(fleet, "e1", "us-east", 9001, kv_blocks_free=400)
    add_node(fleet, "e2", "us-east", 9002, kv_blocks_free=200)
    add_node(fleet, "w1", "us-west", 9003, kv_blocks_free=100)
    add_node(fleet, "eu1", "eu-west", 9004, kv_blocks_free=300)
    add_node(fleet, "ap1", "ap-south", 9005)
    add_node(fleet, "sa1", "sa-east", 9006)

    plan = plan_edge(EDGE, fleet)
    assert plan.is_locality_weighted and plan.cluster_name == "meridian_regions"
    localities = {loc.region: loc for loc in plan.localities}
    # Free KV × operator weight: 600, 300, 300 → 50%, 25%, 25%.
    assert {name: loc.weight for name, loc in localities.items()} == {
        "eu-west": 25,
        "us-east": 50,
        "us-west": 25,
    }
    # A region with an ingress URL is reached through its ingress Envoy, else its nodes directly.
    assert localities["eu-west"].endpoints == (Endpoint("ingress", "127.0.0.1", 10443, 1),)
    assert {e.node_id: e.weight for e in localities["us-east"].endpoints} == {"e1": 67, "e2": 33}


def test_group_is_read_from_node_metadata() -> None:
    node = base_pb2.Node(id="x")
    node.metadata.update(INGRESS.metadata())
    assert group_of(node) == INGRESS
    node.metadata.update(EDGE.metadata())
    del node.metadata.fields["meridian_region"]
    assert group_of(node) == EDGE
    with pytest.raises(EnvoyNodeError, match="envoy-bootstrap"):
        group_of(base_pb2.Node(id="bare"))
    with pytest.raises(EnvoyNodeError, match="needs a region"):
        EnvoyGroup(Role.INGRESS, None, "127.0.0.1", 1)
    with pytest.raises(EnvoyNodeError, match="not an IP"):
        EnvoyGroup(Role.EDGE, None, "envoy.local", 1)


def two_node_plan(group: EnvoyGroup = INGRESS, weight_b: int = 25) -> EnvoyPlan:
    endpoints = (
        Endpoint("a", "127.0.0.1", 9001, 100 - weight_b),
        Endpoint("b", "127.0.0.1", 9002, weight_b),
    )
    cluster = "meridian_regions" if group.role is Role.EDGE else "meridian_us-east_nodes"
    return EnvoyPlan(group, cluster, (Locality("us-east", 60, endpoints),))


def test_resources_are_fit_for_streams_and_retry_only_before_the_response() -> None:
    resources = resources_of(two_node_plan())
    (listener,) = resources[LISTENER_TYPE]
    assert isinstance(listener, listener_pb2.Listener)
    assert listener.address.socket_address.port_value == 10000
    manager = hcm_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert manager.request_timeout.seconds == 0 and manager.stream_idle_timeout.seconds >= 300
    assert manager.rds.route_config_name == "meridian_ingress_routes"

    (config,) = resources[ROUTE_TYPE]
    assert isinstance(config, route_pb2.RouteConfiguration)
    action = config.virtual_hosts[0].routes[-1].route  # the catch-all, to all the nodes
    assert action.cluster == "meridian_us-east_nodes" and action.timeout.seconds == 0
    assert set(action.retry_policy.retry_on.split(",")) == {
        "connect-failure",
        "refused-stream",
        "reset-before-request",
        "retriable-status-codes",
        "retriable-headers",
    }
    assert list(action.retry_policy.retriable_status_codes) == [503]  # refused by a node agent
    # A node's deflected 429 (wire/deflection.py) is retried elsewhere, promptly; other 429s
    # (a full queue) are not, and each node is told which attempt it gets.
    (matcher,) = action.retry_policy.retriable_headers
    assert matcher.name == "x-meridian-deflected" and matcher.present_match
    assert action.retry_policy.retry_back_off.base_interval.ToNanoseconds() == 2_000_000
    assert config.virtual_hosts[0].include_request_attempt_count

    (cluster,) = resources[CLUSTER_TYPE]
    assert isinstance(cluster, cluster_pb2.Cluster)
    assert cluster.type == cluster_pb2.Cluster.EDS and cluster.HasField("outlier_detection")
    for thresholds in cluster.circuit_breakers.thresholds:
        assert thresholds.max_requests.value > 1024 and thresholds.max_connections.value > 1024
        assert thresholds.max_pending_requests.value > 1024
    assert not cluster.common_lb_config.HasField("locality_weighted_lb_config")

    (assignment,) = resources[ENDPOINT_TYPE]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    (group,) = assignment.endpoints
    assert not group.HasField("load_balancing_weight")  # ingress: one locality, no weights
    assert [e.load_balancing_weight.value for e in group.lb_endpoints] == [75, 25]
    assert [e.endpoint.hostname for e in group.lb_endpoints] == ["a", "b"]


def test_edge_resources_balance_by_locality() -> None:
    resources = resources_of(two_node_plan(EDGE))
    (cluster,) = resources[CLUSTER_TYPE]
    assert isinstance(cluster, cluster_pb2.Cluster)
    assert cluster.common_lb_config.HasField("locality_weighted_lb_config")
    (assignment,) = resources[ENDPOINT_TYPE]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    assert assignment.endpoints[0].load_balancing_weight.value == 60
    assert assignment.endpoints[0].locality.region == "us-east"


def test_versions_are_content_hashes_per_type() -> None:
    first, again = build_snapshot(two_node_plan()), build_snapshot(two_node_plan())
    assert first.versions == again.versions  # same content, same version, in any process
    moved = build_snapshot(two_node_plan(weight_b=50))
    changed = {t for t in first.versions if first.versions[t] != moved.versions[t]}
    assert changed == {ENDPOINT_TYPE}
    assert len(set(first.versions.values())) == 4


Resources = dict[str, list[Any]]


def _lb_endpoint(r: Resources) -> Any:
    return r[ENDPOINT_TYPE][0].endpoints[0].lb_endpoints[0]


def _unnamed_cluster(r: Resources) -> None:
    r[CLUSTER_TYPE][0].name = ""


def _zero_weight(r: Resources) -> None:
    _lb_endpoint(r).load_balancing_weight.value = 0


def _host_name_endpoint(r: Resources) -> None:
    _lb_endpoint(r).endpoint.address.socket_address.address = "node.local"


def _negative_timeout(r: Resources) -> None:
    r[CLUSTER_TYPE][0].connect_timeout.seconds = -1


def _route_to_nowhere(r: Resources) -> None:
    r[ROUTE_TYPE][0].virtual_hosts[0].routes[0].route.cluster = "x"


def _no_assignment(r: Resources) -> None:
    r[ENDPOINT_TYPE].clear()


def _port_out_of_range(r: Resources) -> None:
    r[LISTENER_TYPE][0].address.socket_address.port_value = 70000


@pytest.mark.parametrize(
    ("spoil", "fragment"),
    [
        (_unnamed_cluster, "name: '' violates min_len"),
        (_zero_weight, "load_balancing_weight: 0 violates gte 1"),
        (_host_name_endpoint, "'node.local' is not an IP address"),
        (_negative_timeout, "connect_timeout: -1000000000 violates gt 0"),
        (_route_to_nowhere, "cluster 'x' is missing"),
        (_no_assignment, "no endpoints named"),
        (_port_out_of_range, "port_value: 70000 violates lte 65535"),
    ],
)
def test_validation_finds_what_envoy_would_reject(
    spoil: Callable[[Resources], None], fragment: str
) -> None:
    resources = resources_of(two_node_plan())
    assert snapshot_violations(resources) == []
    spoil(resources)
    problems = snapshot_violations(resources)
    assert any(fragment in problem for problem in problems), problems


def test_an_invalid_plan_builds_no_snapshot() -> None:
    zero = Endpoint("a", "127.0.0.1", 9001, 0)
    bad = EnvoyPlan(INGRESS, "meridian_us-east_nodes", (Locality("us-east", 1, (zero,)),))
    with pytest.raises(InvalidSnapshotError, match="load_balancing_weight"):
        build_snapshot(bad)


def test_proto_rules_reach_inside_typed_config() -> None:
    listener = resources_of(two_node_plan())[LISTENER_TYPE][0]
    assert isinstance(listener, listener_pb2.Listener)
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    manager.stat_prefix = ""
    listener.filter_chains[0].filters[0].typed_config.Pack(manager)
    assert any("stat_prefix" in p for p in proto_violations(listener))

"""xDS per model: an ingress's cluster per routable model (its own nodes, weighted among
themselves), a route per model on MODEL_HEADER before the catch-all, and Envoy's own 503 for a
model the region has no route for; only listed models once the catalog lists any."""

from __future__ import annotations

import json

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from test_xds_plan import EDGE, INGRESS, add_node, add_region, weights

from control_plane.model import Fleet
from control_plane.xds.plan import ModelCluster, model_cluster_name, plan_edge, plan_ingress
from control_plane.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE, ROUTE_TYPE, resources_of
from control_plane.xds.snapshot import build_snapshot
from wire.model_catalog import MODEL_HEADER


def two_model_fleet() -> Fleet:
    fleet = Fleet(unhealthy_after_s=3.0)
    add_region(fleet, "us-east")
    add_node(fleet, "a", port=9001, model="small", kv_blocks_free=600)
    add_node(fleet, "b", port=9002, model="small", kv_blocks_free=200)
    add_node(fleet, "c", port=9003, model="org/large:v2", kv_blocks_free=100)
    add_node(fleet, "d", port=9004, model="org/large:v2").drain_requested = True
    add_node(fleet, "e", port=9005, model="other", region="eu-west")
    return fleet


def model_weights(cluster: ModelCluster) -> dict[str, int]:
    return {e.node_id: e.weight for loc in cluster.localities for e in loc.endpoints}


def test_each_routable_model_has_a_cluster_of_its_own_nodes() -> None:
    plan = plan_ingress(INGRESS, two_model_fleet())
    assert weights(plan) == {"a": 67, "b": 22, "c": 11}  # all the region's routable nodes
    large, small = plan.models
    assert (large.model, small.model) == ("org/large:v2", "small")
    assert model_weights(small) == {"a": 75, "b": 25}  # weighted among the model's own nodes
    assert model_weights(large) == {"c": 100}  # the draining node is in no cluster
    assert large.cluster_name == model_cluster_name("us-east", "org/large:v2")
    assert large.cluster_name.startswith("meridian_us-east_model_org_large_v2_")
    assert model_cluster_name("us-east", "org_large_v2") != large.cluster_name
    # The edge routes to regions, not models.
    assert plan_edge(EDGE, two_model_fleet()).models == ()


def test_only_listed_models_get_a_cluster_once_the_catalog_lists_any() -> None:
    fleet = two_model_fleet()
    plan = plan_ingress(INGRESS, fleet, listed=frozenset({"small", "absent"}))
    assert [m.model for m in plan.models] == ["small"]
    assert weights(plan) == {"a": 67, "b": 22, "c": 11}  # requests without the header: all
    assert plan_ingress(INGRESS, fleet, listed=frozenset()).models == ()


def test_one_model_regions_share_the_weights_of_the_whole_region() -> None:
    fleet = Fleet(unhealthy_after_s=3.0)
    add_region(fleet, "us-east")
    add_node(fleet, "a", port=9001, kv_blocks_free=300)
    add_node(fleet, "b", port=9002, kv_blocks_free=100)
    plan = plan_ingress(INGRESS, fleet)
    (only,) = plan.models
    assert (only.cluster_name, only.localities) == (plan.cluster_name, plan.localities)
    resources = resources_of(plan)
    assert len(resources[CLUSTER_TYPE]) == len(resources[ENDPOINT_TYPE]) == 1
    # A model whose nodes Envoy cannot reach (no plain-HTTP IP URL) gets no route at all.
    add_node(fleet, "tls", model="other", url="https://127.0.0.1:9003")
    (small,) = plan_ingress(INGRESS, fleet).models
    assert small.model == only.model and small.cluster_name != plan.cluster_name
    assert model_weights(small) == {"a": 75, "b": 25}


def test_routes_send_each_model_to_its_cluster_and_others_nowhere() -> None:
    plan = plan_ingress(INGRESS, two_model_fleet())
    resources = resources_of(plan)
    (config,) = resources[ROUTE_TYPE]
    assert isinstance(config, route_pb2.RouteConfiguration)
    routes = list(config.virtual_hosts[0].routes)
    large, small = plan.models
    by_model = [(r.match.headers[0].string_match.exact, r.route.cluster) for r in routes[:2]]
    assert by_model == [(large.model, large.cluster_name), (small.model, small.cluster_name)]
    assert all(r.match.headers[0].name == MODEL_HEADER for r in routes[:3])
    assert routes[0].route.retry_policy == routes[-1].route.retry_policy
    unavailable = routes[2]
    assert unavailable.match.headers[0].present_match
    assert unavailable.direct_response.status == 503
    body = json.loads(unavailable.direct_response.body.inline_string)
    assert body["error"]["code"] == "model_unavailable"
    assert (routes[-1].name, routes[-1].route.cluster) == ("all", plan.cluster_name)
    assert not routes[-1].match.headers

    clusters = {c.name for c in resources[CLUSTER_TYPE] if isinstance(c, cluster_pb2.Cluster)}
    assert clusters == {plan.cluster_name, large.cluster_name, small.cluster_name}
    assignments = {
        a.cluster_name: [e.endpoint.hostname for g in a.endpoints for e in g.lb_endpoints]
        for a in resources[ENDPOINT_TYPE]
        if isinstance(a, endpoint_pb2.ClusterLoadAssignment)
    }
    assert assignments[small.cluster_name] == ["a", "b"]
    assert assignments[large.cluster_name] == ["c"]
    build_snapshot(plan)  # what Envoy would accept (validated)


def test_edge_routes_have_no_model_routes() -> None:
    resources = resources_of(plan_edge(EDGE, two_model_fleet()))
    (config,) = resources[ROUTE_TYPE]
    assert isinstance(config, route_pb2.RouteConfiguration)
    assert [r.name for r in config.virtual_hosts[0].routes] == ["all"]


def test_a_capacity_change_moves_only_the_endpoints() -> None:
    fleet = two_model_fleet()
    before = build_snapshot(plan_ingress(INGRESS, fleet))
    b = fleet.nodes["b"]
    assert b.last_beat is not None
    fleet.record_beat(b, b.last_beat.model_copy(update={"kv_blocks_free": 600}), 1.0, 1.0)
    after = build_snapshot(plan_ingress(INGRESS, fleet))
    changed = {t for t in before.versions if before.versions[t] != after.versions[t]}
    assert changed == {ENDPOINT_TYPE}

"""An ingress's config with the region's endpoint picker, and without one (as before); the
region's per-node load document the picker follows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import ControlPlaneClient, make_settings
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from pydantic import ValidationError
from test_xds_plan import INGRESS, add_node, add_region

from control_plane.model import Fleet
from control_plane.settings import Settings
from control_plane.tokens import TokenSet
from control_plane.xds.picker import PICKED_CLUSTER, PICKER_CLUSTER
from control_plane.xds.plan import plan_ingress
from control_plane.xds.resources import CLUSTER_TYPE, LISTENER_TYPE, ROUTE_TYPE
from control_plane.xds.snapshot import build_snapshot
from wire.region_nodes import DESTINATION_HEADER, RegionNodes

PICKERS = {"us-east": ("127.0.0.1", 9100)}


@pytest.fixture
def settings(tmp_path: Path, tokens: TokenSet) -> Settings:
    # Nodes here beat only when told: slow enough that none goes silent during a test.
    return make_settings(tmp_path / "cp.db", tokens, heartbeat_interval_s=10.0)


def fleet() -> Fleet:
    fleet = Fleet(unhealthy_after_s=3.0)
    add_region(fleet, "us-east")
    add_node(fleet, "a", port=9001)
    add_node(fleet, "b", port=9002, model="other")
    return fleet


def manager_of(snapshot_listener: object) -> hcm_pb2.HttpConnectionManager:
    assert isinstance(snapshot_listener, listener_pb2.Listener)
    manager = hcm_pb2.HttpConnectionManager()
    snapshot_listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    return manager


def test_a_region_with_a_picker_asks_it_and_routes_on_its_header() -> None:
    plan = plan_ingress(INGRESS, fleet(), pickers=PICKERS)
    assert plan.picker == ("127.0.0.1", 9100)
    snapshot = build_snapshot(plan)  # validated as Envoy would
    (listener,) = snapshot.get(LISTENER_TYPE).by_name.values()
    manager = manager_of(listener)
    assert [f.name for f in manager.http_filters] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    (strip,) = manager.early_header_mutation_extensions
    assert DESTINATION_HEADER.encode() in strip.typed_config.value
    (routes,) = snapshot.get(ROUTE_TYPE).by_name.values()
    assert isinstance(routes, route_pb2.RouteConfiguration)
    first, *rest = routes.virtual_hosts[0].routes
    assert (first.name, first.route.cluster) == ("picked", PICKED_CLUSTER)
    assert first.match.headers[0].name == DESTINATION_HEADER
    assert [r.name for r in rest][-1] == "all"  # the fallback: least request, as before
    clusters = snapshot.get(CLUSTER_TYPE).by_name
    picked = clusters[PICKED_CLUSTER]
    assert isinstance(picked, cluster_pb2.Cluster)
    assert picked.type == cluster_pb2.Cluster.ORIGINAL_DST
    assert picked.original_dst_lb_config.http_header_name == DESTINATION_HEADER
    assert PICKER_CLUSTER in clusters


def test_a_region_without_a_picker_is_as_before() -> None:
    with_other = plan_ingress(INGRESS, fleet(), pickers={"eu-west": ("127.0.0.1", 9100)})
    assert with_other.picker is None
    assert (
        build_snapshot(with_other).versions
        == build_snapshot(plan_ingress(INGRESS, fleet())).versions
    )


def test_the_pickers_setting_takes_ip_and_port_only(settings: Settings) -> None:
    values = settings.model_dump() | {"region_pickers": {"us-east": "[::1]:9100"}}
    assert Settings(**values).pickers == {"us-east": ("::1", 9100)}
    for bad in ("picker.local:9100", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:x"):
        with pytest.raises(ValidationError, match="IP:PORT"):
            Settings(**(values | {"region_pickers": {"us-east": bad}}))


@pytest.mark.asyncio
async def test_region_nodes_lists_each_routable_nodes_load_and_blocks(
    cp: ControlPlaneClient,
) -> None:
    await cp.add_region("us-east")
    await cp.beat("a", url="http://127.0.0.1:9001", num_running=2, kv_blocks_free=100, step_s=0.03)
    await cp.beat("b", url="http://127.0.0.1:9002", draining=True)
    await cp.beat("c", region="eu-west", url="http://127.0.0.1:9003")
    path = "/v1/regions/us-east/nodes"
    assert (await cp.http.get(path, headers=cp.admin)).status_code == 403
    reply = await cp.http.get(path, headers=cp.gateway)
    assert reply.status_code == 200, reply.text
    document = RegionNodes.model_validate_json(reply.content)
    loads = [(n.node_id, n.num_running, n.kv_blocks_free, n.step_s) for n in document.nodes]
    assert loads == [("a", 2, 100, 0.03)]
    assert document.index == int(reply.headers["X-Meridian-Index"])

    # A blocking query answers when the region's load moves.
    params = {"index": str(document.index), "wait": "10s"}
    waiting = asyncio.create_task(cp.http.get(path, params=params, headers=cp.gateway))
    await cp.beat("a", url="http://127.0.0.1:9001", num_running=5, kv_blocks_free=100)
    moved = RegionNodes.model_validate_json((await waiting).content)
    assert moved.index != document.index  # a digest of the document: it differs, in no order
    assert [(n.node_id, n.num_running) for n in moved.nodes] == [("a", 5)]
    unknown = await cp.http.get("/v1/regions/nowhere/nodes", headers=cp.gateway)
    assert RegionNodes.model_validate_json(unknown.content).nodes == ()
    # A name no region can have (the fuzzer's 'æ:' answered 500) is not found.
    impossible = await cp.http.get("/v1/regions/%C3%A6%3A/nodes", headers=cp.gateway)
    assert impossible.status_code == 404, impossible.text
    assert impossible.json()["error"]["code"] == "region_not_found"

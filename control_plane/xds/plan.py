"""Fleet state → what one Envoy group should route to: a small, frozen, comparable plan.

Weights follow free KV capacity. Within a region each routable node gets its share of the
region's free KV blocks in percent, at least 1 (Envoy refuses weight 0 for a listed endpoint, and
a full but healthy node should still see a trickle, so that its capacity is noticed when it frees
up). Nodes that are unhealthy, draining (asked to, or on their own) or silent since a restart are
left out of the assignment altogether rather than listed as DRAINING or UNHEALTHY: a host Envoy no
longer knows gets no new requests, its in-flight streams run to completion, and a mostly-draining
region cannot fall into Envoy's panic mode, which would spread traffic over excluded hosts again.
For the edge, each active region with a non-zero operator weight and routable nodes is one
locality, weighted by its free KV blocks times that operator weight, in percent (at least 1).

A region's ingress also has one cluster per routable model (listed by the catalog, as in the
region summaries) over the routable nodes serving it, weighted by the same rule among them: Envoy
sends a request naming the model in MODEL_HEADER there, and one without the header to the
cluster of all the region's nodes.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
import urllib.parse
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from control_plane.model import Fleet, Listed, Node, Region
from control_plane.picker_address import picker_address
from control_plane.xds.groups import EnvoyGroup, Role

WEIGHT_SCALE = 100  # weights are shares in percent
EDGE_CLUSTER = "meridian_regions"
INGRESS_ENDPOINT_ID = "ingress"  # the endpoint standing for a region's own ingress Envoy

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Endpoint:
    node_id: str
    host: str  # an IP literal (EDS takes addresses, not names)
    port: int
    weight: int  # >= 1


@dataclass(frozen=True, slots=True)
class Locality:
    region: str
    weight: int  # >= 1; only used by the edge's locality-weighted balancing
    endpoints: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True)
class ModelCluster:
    """One routable model of an ingress's region: where requests naming it go. A model that
    every routable node of the region serves (the usual region, of one model) goes to the
    region's own cluster: the same endpoints and weights, one assignment to build and push."""

    model: str
    cluster_name: str
    localities: tuple[Locality, ...]  # one, as the ingress's own cluster


@dataclass(frozen=True, slots=True)
class EnvoyPlan:
    group: EnvoyGroup
    cluster_name: str
    localities: tuple[Locality, ...]
    # Routable nodes whose URL cannot be an EDS endpoint (https, or a host name), for the logs.
    skipped_node_ids: tuple[str, ...] = ()
    models: tuple[ModelCluster, ...] = ()  # by model name (ingress only)
    # The region's endpoint picker (ingress only, where one is configured): its IP and port.
    picker: tuple[str, int] | None = None

    @property
    def is_locality_weighted(self) -> bool:
        return self.group.role is Role.EDGE

    def endpoint_ids(self) -> set[str]:
        return {e.node_id for locality in self.localities for e in locality.endpoints}

    @property
    def is_ingress(self) -> bool:
        return self.group.role is Role.INGRESS


_Endpoints = tuple[tuple[Endpoint, ...], tuple[str, ...]]  # endpoints, and node ids left out
NodesByRegion = Mapping[str, list[Node]]
Pickers = Mapping[str, tuple[str, int]]  # region -> its endpoint picker's IP and port


def pickers_of(fleet: Fleet, configured: Pickers) -> Pickers:
    """The regions' pickers: the `region_pickers` setting (`configured`), each region's own
    `picker` field (set through the admin API) over it."""
    fields = {name: picker_address(r.picker or "") for name, r in fleet.regions.items()}
    return {**configured, **{name: address for name, address in fields.items() if address}}


def nodes_by_region(fleet: Fleet) -> dict[str, list[Node]]:
    """One pass over the fleet, for planning many groups at once."""
    found: dict[str, list[Node]] = {}
    for node in fleet.nodes.values():
        found.setdefault(node.identity.region, []).append(node)
    return found


def capacity_weights(capacities: Mapping[K, float]) -> dict[K, int]:
    """Integer weights in 1..WEIGHT_SCALE proportional to capacity (all zero: all equal)."""
    total = sum(capacities.values())
    if total <= 0:
        return {key: 1 for key in capacities}
    return {
        key: max(1, min(WEIGHT_SCALE, round(WEIGHT_SCALE * value / total)))
        for key, value in capacities.items()
    }


@functools.lru_cache(maxsize=65536)  # node URLs rarely change; parsing them is slow
def upstream_address(url: str) -> tuple[str, int] | None:
    """(IP, port) of a plain-HTTP URL, or None when EDS cannot carry it."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname
    if parts.scheme != "http" or host is None:
        return None
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
        port = parts.port or 80
    except ValueError:
        return None
    return host, port


def _free_blocks(node: Node) -> int:
    return node.last_beat.kv_blocks_free if node.last_beat is not None else 0


def _routable(nodes: Iterable[Node]) -> list[Node]:
    return sorted((n for n in nodes if n.is_routable), key=lambda n: n.node_id)


def node_endpoints(nodes: Iterable[Node]) -> _Endpoints:
    """Endpoints for the routable nodes, weighted by free KV share; and the nodes left out."""
    usable: dict[str, tuple[str, int]] = {}
    skipped: list[str] = []
    routable = _routable(nodes)
    for node in routable:
        address = upstream_address(node.identity.url)
        if address is None:
            skipped.append(node.node_id)
        else:
            usable[node.node_id] = address
    free = {n.node_id: _free_blocks(n) for n in routable if n.node_id in usable}
    weights = capacity_weights(free)
    endpoints = tuple(
        Endpoint(node_id=node_id, host=host, port=port, weight=weights[node_id])
        for node_id, (host, port) in usable.items()
    )
    return endpoints, tuple(skipped)


def ingress_cluster_name(region: str) -> str:
    return f"meridian_{region}_nodes"


@functools.lru_cache(maxsize=65536)
def model_cluster_name(region: str, model: str) -> str:
    """A cluster name for any model name: readable, Envoy-stat safe, and distinct (the hash)."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", model)[:64]
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"meridian_{region}_model_{slug}_{digest}"


def model_clusters(
    region: str, nodes: list[Node], listed: Listed, all_nodes: tuple[Locality, ...]
) -> tuple[ModelCluster, ...]:
    """A cluster per listed model that routable nodes of `region` serve, by name; one without
    a usable endpoint is left out (requests for it find no model route here)."""
    routable = [node for node in nodes if node.is_routable]
    by_model: dict[str, list[Node]] = {}
    for node in routable:
        if listed is None or node.model in listed:
            by_model.setdefault(node.model, []).append(node)
    clusters: list[ModelCluster] = []
    for model in sorted(by_model):
        members = by_model[model]
        if len(members) == len(routable):
            if all_nodes:
                clusters.append(ModelCluster(model, ingress_cluster_name(region), all_nodes))
            continue
        endpoints, _ = node_endpoints(members)
        if endpoints:
            localities = (Locality(region, 1, endpoints),)
            clusters.append(ModelCluster(model, model_cluster_name(region, model), localities))
    return tuple(clusters)


def plan_ingress(
    group: EnvoyGroup,
    fleet: Fleet,
    by_region: NodesByRegion | None = None,
    listed: Listed = None,
    pickers: Pickers | None = None,
) -> EnvoyPlan:
    """A region's node agents, one locality, and a cluster per routable model (`listed`: the
    models the catalog lets be routed to, None for all), and its picker if `pickers` names
    one. Nodes of an unregistered region get no traffic."""
    assert group.region is not None
    name = ingress_cluster_name(group.region)
    if group.region not in fleet.regions:
        return EnvoyPlan(group=group, cluster_name=name, localities=())
    found = by_region.get(group.region) if by_region is not None else None
    nodes = found if found is not None else fleet.nodes_in(group.region)
    endpoints, skipped = node_endpoints(nodes)
    localities = (Locality(group.region, 1, endpoints),) if endpoints else ()
    models = model_clusters(group.region, nodes, listed, localities)
    picker = (pickers or {}).get(group.region)
    return EnvoyPlan(group, name, localities, skipped, models, picker)


def _region_endpoints(region: Region, nodes: list[Node]) -> _Endpoints:
    """The region's ingress Envoy when it has a usable ingress URL, else its node agents."""
    if region.ingress_url is not None:
        address = upstream_address(region.ingress_url)
        if address is not None:
            return (Endpoint(INGRESS_ENDPOINT_ID, address[0], address[1], 1),), ()
    return node_endpoints(nodes)


def plan_edge(group: EnvoyGroup, fleet: Fleet, by_region: NodesByRegion | None = None) -> EnvoyPlan:
    """Every active region with weight and routable nodes, as one locality each."""
    endpoints: dict[str, tuple[Endpoint, ...]] = {}
    capacity: dict[str, float] = {}
    skipped: list[str] = []
    by_region = nodes_by_region(fleet) if by_region is None else by_region
    for name in sorted(fleet.regions):
        region = fleet.regions[name]
        routable = _routable(by_region.get(name, []))
        if region.state != "active" or region.weight <= 0 or not routable:
            continue
        region_endpoints, region_skipped = _region_endpoints(region, routable)
        skipped.extend(region_skipped)
        if region_endpoints:
            endpoints[name] = region_endpoints
            capacity[name] = sum(_free_blocks(n) for n in routable) * region.weight
    weights = capacity_weights(capacity)
    localities = tuple(Locality(name, weights[name], endpoints[name]) for name in endpoints)
    return EnvoyPlan(group, EDGE_CLUSTER, localities, tuple(skipped))


def plan_for(
    group: EnvoyGroup,
    fleet: Fleet,
    by_region: NodesByRegion | None = None,
    listed: Listed = None,
    pickers: Pickers | None = None,
) -> EnvoyPlan:
    """The plan for `group`; pass `nodes_by_region(fleet)` when planning many groups."""
    if group.role is Role.EDGE:
        return plan_edge(group, fleet, by_region)
    return plan_ingress(group, fleet, by_region, listed, pickers)

"""Check a snapshot's resources as Envoy will, before they are pushed.

Envoy rejects a whole state-of-the-world response when one resource in it is bad, so a snapshot is
checked first, in two passes:
- the protoc-gen-validate rules annotated on Envoy's protos (`proto_rules`);
- what ties the resources together: unique names, every route's cluster and every listener's
  route configuration present, an assignment for every EDS cluster, IP-literal endpoint addresses,
  endpoint weights of at least 1 that fit in 32 bits, locality weights wherever the cluster
  balances by locality.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping, Sequence

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from control_plane.xds.proto_rules import proto_violations
from control_plane.xds.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    resource_name,
)

MAX_WEIGHT_SUM = 2**32 - 1


@functools.lru_cache(maxsize=65536)  # the same endpoint addresses come back in every rebuild
def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _address_violations(path: str, address: address_pb2.Address) -> list[str]:
    socket = address.socket_address
    if not is_ip(socket.address):
        return [f"{path}: {socket.address!r} is not an IP address"]
    if not 1 <= socket.port_value <= 65535:
        return [f"{path}: port {socket.port_value} is out of range"]
    return []


def _locality_weight_violations(
    assignment: endpoint_pb2.ClusterLoadAssignment, is_locality_weighted: bool
) -> list[str]:
    if not is_locality_weighted:
        return []
    return [
        f"endpoints {assignment.cluster_name} locality {group.locality.region!r}: needs a "
        "weight (the cluster balances by locality)"
        for group in assignment.endpoints
        if not group.HasField("load_balancing_weight")
    ]


def _skeleton(assignment: endpoint_pb2.ClusterLoadAssignment) -> endpoint_pb2.ClusterLoadAssignment:
    """The assignment with at most one endpoint per locality, for the generic (slow) walk: every
    endpoint is built alike, and `_endpoint_violations` checks what varies in each one. Its
    weights are set to 1 (they too are checked one by one there), so that the skeleton stays the
    same from one rebuild to the next while only capacity moves, and its walk is remembered."""
    skeleton = endpoint_pb2.ClusterLoadAssignment()
    skeleton.CopyFrom(assignment)
    for group in skeleton.endpoints:
        del group.lb_endpoints[1:]
        if group.HasField("load_balancing_weight"):
            group.load_balancing_weight.value = 1
        for lb_endpoint in group.lb_endpoints:
            if lb_endpoint.HasField("load_balancing_weight"):
                lb_endpoint.load_balancing_weight.value = 1
    return skeleton


@functools.lru_cache(maxsize=256)
def _walk(descriptor: Descriptor, wire: bytes) -> tuple[str, ...]:
    return tuple(proto_violations(message_factory.GetMessageClass(descriptor).FromString(wire)))


def _rule_violations(message: Message) -> list[str]:
    """`proto_violations`, remembered by the message's bytes: the generic walk costs tens of
    milliseconds for an edge snapshot, and most resources come back unchanged in every rebuild
    (a rebuild follows every capacity change)."""
    return list(_walk(message.DESCRIPTOR, message.SerializeToString(deterministic=True)))


def _endpoint_violations(assignment: endpoint_pb2.ClusterLoadAssignment) -> list[str]:
    """Each endpoint's address and weight, and each locality's weights, as Envoy checks them."""
    problems: list[str] = []
    for group in assignment.endpoints:
        where = f"locality {group.locality.region!r}"
        if group.HasField("load_balancing_weight") and group.load_balancing_weight.value < 1:
            problems.append(f"{where}: load_balancing_weight: 0 violates gte 1")
        total = 0
        for index, lb_endpoint in enumerate(group.lb_endpoints):
            problems += _address_violations(
                f"{where} endpoint {index}", lb_endpoint.endpoint.address
            )
            weight = lb_endpoint.load_balancing_weight
            if lb_endpoint.HasField("load_balancing_weight") and weight.value < 1:
                problems.append(
                    f"{where} endpoint {index}: load_balancing_weight: 0 violates gte 1"
                )
            total += weight.value or 1
        if total > MAX_WEIGHT_SUM:
            problems.append(f"{where}: endpoint weights sum to more than 2^32-1")
    return problems


def _names(messages: Iterable[Message]) -> list[str]:
    return [resource_name(m) for m in messages]


def reference_violations(resources: Mapping[str, Sequence[Message]]) -> list[str]:
    """Problems between resources: names, references, assignments, addresses."""
    problems: list[str] = []
    for type_url, messages in resources.items():
        names = _names(messages)
        problems += [f"{type_url}: empty resource name" for name in names if not name]
        problems += [f"{type_url}: duplicate name {n!r}" for n in set(names) if names.count(n) > 1]
    clusters = {
        c.name: c for c in resources.get(CLUSTER_TYPE, ()) if isinstance(c, cluster_pb2.Cluster)
    }
    route_names = set(_names(resources.get(ROUTE_TYPE, ())))
    for listener in resources.get(LISTENER_TYPE, ()):
        assert isinstance(listener, listener_pb2.Listener)
        problems += _address_violations(f"listener {listener.name}", listener.address)
        for chain in listener.filter_chains:
            for network_filter in chain.filters:
                manager = hcm_pb2.HttpConnectionManager()
                if (
                    network_filter.typed_config.Unpack(manager)
                    and manager.HasField("rds")
                    and manager.rds.route_config_name not in route_names
                ):
                    problems.append(
                        f"listener {listener.name}: route configuration "
                        f"{manager.rds.route_config_name!r} is missing"
                    )
    for config in resources.get(ROUTE_TYPE, ()):
        assert isinstance(config, route_pb2.RouteConfiguration)
        for host in config.virtual_hosts:
            for route in host.routes:
                if route.route.cluster and route.route.cluster not in clusters:
                    problems.append(
                        f"route {route.name}: cluster {route.route.cluster!r} is missing"
                    )
    assignments = {
        a.cluster_name: a
        for a in resources.get(ENDPOINT_TYPE, ())
        if isinstance(a, endpoint_pb2.ClusterLoadAssignment)
    }
    for name, cluster in clusters.items():
        if cluster.type != cluster_pb2.Cluster.EDS:
            continue
        service = cluster.eds_cluster_config.service_name or name
        if service not in assignments:
            problems.append(f"cluster {name}: no endpoints named {service!r}")
        else:
            weighted = cluster.common_lb_config.HasField("locality_weighted_lb_config")
            problems += _locality_weight_violations(assignments[service], weighted)
    return problems


def _message_violations(message: Message) -> list[str]:
    if isinstance(message, endpoint_pb2.ClusterLoadAssignment):
        return _rule_violations(_skeleton(message)) + _endpoint_violations(message)
    return _rule_violations(message)


def snapshot_violations(resources: Mapping[str, Sequence[Message]]) -> list[str]:
    """Everything wrong with one snapshot's resources; empty when Envoy should accept them."""
    problems = [
        f"{type_url.rsplit('.', 1)[-1]} {resource_name(message)}: {problem}"
        for type_url, messages in resources.items()
        for message in messages
        for problem in _message_violations(message)
    ]
    return problems + reference_violations(resources)

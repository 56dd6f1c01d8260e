"""A region's endpoint picker in its ingress Envoy's config (region_picker/: Envoy's ext_proc
service that names the node for each request).

Only for a region with a picker configured; otherwise the ingress is as before. With one:
- any DESTINATION_HEADER a client sent is stripped before a route is chosen (it names an
  upstream address: only the picker may);
- an HTTP filter asks the picker over ext_proc with the request's headers and its body
  (buffered up to Envoy's buffer limit: a longer body goes on partial and the picker names no
  node for it), and the response's headers (until then the picker counts the request as
  pending on its node), `failure_mode_allow`: when the picker is down, slow or names nothing,
  the request goes on without the header;
- a first route sends a request carrying the header to the original-destination cluster, which
  connects to the address the header names;
- every other route stays as it was: least request over the region's or the model's nodes.
"""

from __future__ import annotations

from typing import Final

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import address_pb2, extension_pb2, grpc_service_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_header_mutation_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import duration_pb2
from google.protobuf.message import Message

from control_plane.xds.plan import EnvoyPlan
from control_plane.xds.resources import (
    CLUSTER_TYPE,
    CONNECT_TIMEOUT_S,
    HTTP_OPTIONS_KEY,
    LISTENER_TYPE,
    ROUTE_TYPE,
    circuit_breakers,
    http1_upstream,
    listener,
    pack,
    route,
)
from wire.region_nodes import DESTINATION_HEADER

PICKED_CLUSTER: Final = "meridian_picked"  # original destination: the node the picker named
PICKER_CLUSTER: Final = "meridian_picker"  # the picker's gRPC service
# How long Envoy waits for the picker's answer to one message before going on without it.
PICKER_TIMEOUT_MS: Final = 200


def _strip_destination() -> extension_pb2.TypedExtensionConfig:
    remove = mutation_rules_pb2.HeaderMutation(remove=DESTINATION_HEADER)
    config = early_header_mutation_pb2.HeaderMutation(mutations=[remove])
    return extension_pb2.TypedExtensionConfig(
        name="meridian.strip_destination", typed_config=pack(config)
    )


def ext_proc_filter() -> hcm_pb2.HttpFilter:
    Mode = processing_mode_pb2.ProcessingMode
    config = ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=PICKER_CLUSTER)
        ),
        failure_mode_allow=True,
        processing_mode=Mode(
            request_header_mode=Mode.SEND,
            response_header_mode=Mode.SEND,  # the picker counts a request until it answers
            request_body_mode=Mode.BUFFERED_PARTIAL,
            response_body_mode=Mode.NONE,
            request_trailer_mode=Mode.SKIP,
            response_trailer_mode=Mode.SKIP,
        ),
        message_timeout=duration_pb2.Duration(nanos=PICKER_TIMEOUT_MS * 1_000_000),
        stat_prefix="meridian_picker",
    )
    return hcm_pb2.HttpFilter(name="envoy.filters.http.ext_proc", typed_config=pack(config))


def picked_route() -> route_components_pb2.Route:
    header = route_components_pb2.HeaderMatcher(name=DESTINATION_HEADER, present_match=True)
    return route(
        "picked", route_components_pb2.RouteMatch(prefix="/", headers=[header]), PICKED_CLUSTER
    )


def picked_cluster() -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(
        name=PICKED_CLUSTER,
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        original_dst_lb_config=cluster_pb2.Cluster.OriginalDstLbConfig(
            use_http_header=True, http_header_name=DESTINATION_HEADER
        ),
        connect_timeout=duration_pb2.Duration(seconds=CONNECT_TIMEOUT_S),
        circuit_breakers=circuit_breakers(),
        typed_extension_protocol_options={HTTP_OPTIONS_KEY: pack(http1_upstream())},
    )


def static_cluster(name: str, host: str, port: int) -> cluster_pb2.Cluster:
    """A cluster of one fixed address."""
    address = address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=host, port_value=port)
    )
    endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=address)
    )
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration_pb2.Duration(seconds=CONNECT_TIMEOUT_S),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])],
        ),
        circuit_breakers=circuit_breakers(),
    )


def picker_cluster(host: str, port: int) -> cluster_pb2.Cluster:
    Options = http_protocol_options_pb2.HttpProtocolOptions
    http2 = Options(
        explicit_http_config=Options.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    cluster = static_cluster(PICKER_CLUSTER, host, port)
    cluster.typed_extension_protocol_options[HTTP_OPTIONS_KEY].CopyFrom(pack(http2))
    return cluster


def add_picker(plan: EnvoyPlan, resources: dict[str, list[Message]]) -> None:
    """Put the plan's picker into an ingress's resources (nothing without one)."""
    if plan.picker is None:
        return
    resources[LISTENER_TYPE] = [listener(plan, (ext_proc_filter(),), (_strip_destination(),))]
    (config,) = resources[ROUTE_TYPE]
    assert isinstance(config, route_pb2.RouteConfiguration)
    config.virtual_hosts[0].routes.insert(0, picked_route())
    resources[CLUSTER_TYPE] += [picked_cluster(), picker_cluster(*plan.picker)]

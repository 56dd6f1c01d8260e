"""A plan → Envoy's four resources: Listener, RouteConfiguration, Cluster, ClusterLoadAssignment.

Pure functions. The choices that matter for LLM traffic:
- Streams: no request timeout and no route timeout (a completion may stream for minutes); a long
  stream idle timeout, so a request that waits in a node's queue before its first token survives.
- Retries only before the response starts: a connection that failed or was refused, a stream
  reset before the request went out, or a 503 (a node agent that is loading, draining or has lost
  its engine answers 503 without running the request), on another host. Nothing that could have
  run on the engine is retried, and Envoy never retries once response bytes have gone downstream.
  The 503 retry is what keeps a drain free of failures: in step 1 the node stops admitting while
  Envoy may still send it requests, until step 2 takes it out of EDS. A 429 marked deflected (a
  node with a request still waiting for its first token, wire/deflection.py) is retried the same
  way; Envoy sends the attempt number, so that a node deflects only early attempts. Retries
  back off by at most `RETRY_BASE_INTERVAL_S` (Envoy's default, 25 ms, would cost more than the
  prefill wait a deflection saves).
- Circuit breakers far above Envoy's defaults of 1,024 (long streams would hit them), outlier
  detection on consecutive 5xx, HTTP/1.1 to the node agents, and no update merge window, so a
  weight change applies as soon as it is accepted.
- Per model, at an ingress: a route per routable model, matching MODEL_HEADER exactly, to that
  model's cluster; a request naming a model no route has (its nodes left, or it is not listed)
  gets 503 `model_unavailable` from Envoy itself, never another model's answer; a request without
  the header goes to all the region's nodes.
"""

from __future__ import annotations

from typing import Final

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    protocol_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.config.route.v3.route_components_pb2 import Route
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from control_plane.xds.plan import EnvoyPlan, Locality
from wire.deflection import DEFLECTED_HEADER, MAX_DEFLECTIONS
from wire.errors import error_json
from wire.model_catalog import MODEL_HEADER

TYPE_PREFIX: Final = "type.googleapis.com/"
LISTENER_TYPE: Final = TYPE_PREFIX + listener_pb2.Listener.DESCRIPTOR.full_name
ROUTE_TYPE: Final = TYPE_PREFIX + route_pb2.RouteConfiguration.DESCRIPTOR.full_name
CLUSTER_TYPE: Final = TYPE_PREFIX + cluster_pb2.Cluster.DESCRIPTOR.full_name
ENDPOINT_TYPE: Final = TYPE_PREFIX + endpoint_pb2.ClusterLoadAssignment.DESCRIPTOR.full_name
# Envoy's order: clusters before their endpoints, listeners before their routes.
TYPE_ORDER: Final = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)
SHORT_NAMES: Final = {
    CLUSTER_TYPE: "clusters",
    ENDPOINT_TYPE: "endpoints",
    LISTENER_TYPE: "listeners",
    ROUTE_TYPE: "routes",
}

RETRY_ON: Final = (
    "connect-failure,refused-stream,reset-before-request,retriable-status-codes,retriable-headers"
)
RETRIABLE_STATUS_CODES: Final = (503,)
NUM_RETRIES: Final = 2
# A deflected attempt is retried, and the attempt after the last deflectable one still is.
assert NUM_RETRIES > MAX_DEFLECTIONS
RETRY_BASE_INTERVAL_S: Final = 0.002
# A draining node refuses at once, so it has the fewest requests in flight and least-request
# picks it for about 3 of 4 retries; each retry re-picks until it lands on another host.
HOST_SELECTION_ATTEMPTS: Final = 20
STREAM_IDLE_TIMEOUT_S: Final = 600
REQUEST_HEADERS_TIMEOUT_S: Final = 10
CONNECT_TIMEOUT_S: Final = 1
UPSTREAM_IDLE_TIMEOUT_S: Final = 60
MAX_CONNECTIONS: Final = 100_000  # Envoy's default is 1,024 for each of these
MAX_REQUESTS: Final = 100_000
MAX_RETRIES: Final = 1_000
HTTP_OPTIONS_KEY: Final = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
MODEL_UNAVAILABLE: Final = "model_unavailable"
MODEL_UNAVAILABLE_BODY: Final = error_json(
    503,
    "no node of this region serves the requested model now; try another region",
    MODEL_UNAVAILABLE,
).decode()


def pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message, deterministic=True)
    return packed


def resource_name(message: Message) -> str:
    if isinstance(message, endpoint_pb2.ClusterLoadAssignment):
        return message.cluster_name
    name = getattr(message, "name", None)
    assert isinstance(name, str), f"{type(message).__name__} has no name"
    return name


def _seconds(seconds: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds)


def _u32(value: int) -> wrappers_pb2.UInt32Value:
    return wrappers_pb2.UInt32Value(value=value)


def ads_source() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.ApiVersion.V3,
    )


def listener_name(plan: EnvoyPlan) -> str:
    return f"meridian_{plan.group.role}"


def route_name(plan: EnvoyPlan) -> str:
    return f"meridian_{plan.group.role}_routes"


def listener(
    plan: EnvoyPlan,
    filters: tuple[hcm_pb2.HttpFilter, ...] = (),
    early_mutations: tuple[extension_pb2.TypedExtensionConfig, ...] = (),
) -> listener_pb2.Listener:
    """The plan's listener; `filters` run before the router, `early_mutations` on a request's
    headers before anything else (before a route is chosen)."""
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=listener_name(plan),
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=ads_source(), route_config_name=route_name(plan)),
        http_filters=[
            *filters,
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.router", typed_config=pack(router_pb2.Router())
            ),
        ],
        early_header_mutation_extensions=early_mutations,
        request_timeout=_seconds(0),  # 0 disables: streams may last as long as they need
        stream_idle_timeout=_seconds(STREAM_IDLE_TIMEOUT_S),
        request_headers_timeout=_seconds(REQUEST_HEADERS_TIMEOUT_S),
    )
    address = address_pb2.Address(
        socket_address=address_pb2.SocketAddress(
            address=plan.group.listen_host, port_value=plan.group.listen_port
        )
    )
    chain = listener_components_pb2.FilterChain(
        filters=[
            listener_components_pb2.Filter(
                name="envoy.filters.network.http_connection_manager", typed_config=pack(manager)
            )
        ]
    )
    return listener_pb2.Listener(name=listener_name(plan), address=address, filter_chains=[chain])


def _retry_policy() -> route_components_pb2.RetryPolicy:
    return route_components_pb2.RetryPolicy(
        retry_on=RETRY_ON,
        retriable_status_codes=RETRIABLE_STATUS_CODES,
        retriable_headers=[
            route_components_pb2.HeaderMatcher(name=DEFLECTED_HEADER, present_match=True)
        ],
        retry_back_off=route_components_pb2.RetryPolicy.RetryBackOff(
            base_interval=duration_pb2.Duration(nanos=round(RETRY_BASE_INTERVAL_S * 1e9))
        ),
        num_retries=_u32(NUM_RETRIES),
        retry_host_predicate=[
            route_components_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=HOST_SELECTION_ATTEMPTS,
    )


def route(name: str, match: route_components_pb2.RouteMatch, cluster: str) -> Route:
    action = route_components_pb2.RouteAction(
        cluster=cluster, timeout=_seconds(0), retry_policy=_retry_policy()
    )
    return Route(name=name, match=match, route=action)


def _model_match(model: str | None) -> route_components_pb2.RouteMatch:
    """Requests whose MODEL_HEADER is `model` (None: that carry the header at all)."""
    header = route_components_pb2.HeaderMatcher(name=MODEL_HEADER)
    if model is None:
        header.present_match = True
    else:
        header.string_match.exact = model
    return route_components_pb2.RouteMatch(prefix="/", headers=[header])


def _model_unavailable() -> Route:
    body = base_pb2.DataSource(inline_string=MODEL_UNAVAILABLE_BODY)
    content_type = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", value="application/json"),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    return Route(
        name="model_unavailable",
        match=_model_match(None),
        direct_response=route_components_pb2.DirectResponseAction(status=503, body=body),
        response_headers_to_add=[content_type],
    )


def route_configuration(plan: EnvoyPlan) -> route_pb2.RouteConfiguration:
    routes = [route(f"model {m.model}", _model_match(m.model), m.cluster_name) for m in plan.models]
    if plan.is_ingress:
        routes.append(_model_unavailable())
    routes.append(route("all", route_components_pb2.RouteMatch(prefix="/"), plan.cluster_name))
    host = route_components_pb2.VirtualHost(
        name="meridian", domains=["*"], routes=routes, include_request_attempt_count=True
    )
    return route_pb2.RouteConfiguration(name=route_name(plan), virtual_hosts=[host])


def circuit_breakers() -> circuit_breaker_pb2.CircuitBreakers:
    Thresholds = circuit_breaker_pb2.CircuitBreakers.Thresholds
    return circuit_breaker_pb2.CircuitBreakers(
        thresholds=[
            Thresholds(
                priority=priority,
                max_connections=_u32(MAX_CONNECTIONS),
                max_pending_requests=_u32(MAX_REQUESTS),
                max_requests=_u32(MAX_REQUESTS),
                max_retries=_u32(MAX_RETRIES),
            )
            for priority in (base_pb2.RoutingPriority.DEFAULT, base_pb2.RoutingPriority.HIGH)
        ]
    )


def http1_upstream() -> http_protocol_options_pb2.HttpProtocolOptions:
    Options = http_protocol_options_pb2.HttpProtocolOptions
    return Options(
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(
            idle_timeout=_seconds(UPSTREAM_IDLE_TIMEOUT_S)
        ),
        explicit_http_config=Options.ExplicitHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions()
        ),
    )


def cluster(name: str, is_locality_weighted: bool) -> cluster_pb2.Cluster:
    lb_config = cluster_pb2.Cluster.CommonLbConfig(update_merge_window=_seconds(0))
    if is_locality_weighted:
        lb_config.locality_weighted_lb_config.SetInParent()
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=ads_source(), service_name=name
        ),
        connect_timeout=_seconds(CONNECT_TIMEOUT_S),
        lb_policy=cluster_pb2.Cluster.LEAST_REQUEST,
        circuit_breakers=circuit_breakers(),
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=_u32(5),
            interval=_seconds(5),
            base_ejection_time=_seconds(15),
            max_ejection_percent=_u32(50),
        ),
        common_lb_config=lb_config,
        typed_extension_protocol_options={HTTP_OPTIONS_KEY: pack(http1_upstream())},
    )


def load_assignment(
    name: str, localities: tuple[Locality, ...], is_locality_weighted: bool
) -> endpoint_pb2.ClusterLoadAssignment:
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    for locality in localities:
        group = assignment.endpoints.add(locality=base_pb2.Locality(region=locality.region))
        if is_locality_weighted:
            group.load_balancing_weight.value = locality.weight
        for endpoint in locality.endpoints:
            address = address_pb2.Address(
                socket_address=address_pb2.SocketAddress(
                    address=endpoint.host, port_value=endpoint.port
                )
            )
            group.lb_endpoints.append(
                endpoint_components_pb2.LbEndpoint(
                    endpoint=endpoint_components_pb2.Endpoint(
                        address=address, hostname=endpoint.node_id
                    ),
                    load_balancing_weight=_u32(endpoint.weight),
                )
            )
    return assignment


def resources_of(plan: EnvoyPlan) -> dict[str, list[Message]]:
    """All four resource types for one plan, by type URL: its own cluster, and each model's."""
    weighted = plan.is_locality_weighted
    clusters = [(plan.cluster_name, plan.localities, weighted)]
    clusters += [
        (m.cluster_name, m.localities, False)
        for m in plan.models
        if m.cluster_name != plan.cluster_name  # a model of every node: the plan's own cluster
    ]
    return {
        LISTENER_TYPE: [listener(plan)],
        ROUTE_TYPE: [route_configuration(plan)],
        CLUSTER_TYPE: [cluster(name, is_weighted) for name, _, is_weighted in clusters],
        ENDPOINT_TYPE: [load_assignment(*each) for each in clusters],
    }

"""Where every part of the stack listens, and how traffic reaches each region.

A pure function of the config (and of whether Envoy is used), so it can be checked before anything
starts: each region's path is gateway → RTT proxy (if `simulate_rtt`) → ingress Envoy (if used)
→ node agents. The region's `ingress_url`, registered with the control plane, is the first hop
of that path after the gateway.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from stack.config import StackConfig
from stack.errors import StackError
from wire.geo import Location, locate, rtt_ms

HOST = "127.0.0.1"


def url_of(port: int, scheme: str = "http") -> str:
    return f"{scheme}://{HOST}:{port}"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    node_id: str
    port: int

    @property
    def url(self) -> str:
        return url_of(self.port)


@dataclass(frozen=True, slots=True)
class RegionLayout:
    name: str
    lat: float
    lon: float
    rtt_ms: float  # the delay the RTT proxy adds (when on)
    nodes: tuple[NodeLayout, ...]
    envoy_port: int | None  # None: no Envoy; the node agents are reached directly
    envoy_admin_port: int | None
    rtt_proxy_port: int | None  # None: no RTT proxy

    @property
    def upstream_urls(self) -> tuple[str, ...]:
        """What the RTT proxy forwards to: the region's Envoy, else its node agents."""
        if self.envoy_port is not None:
            return (url_of(self.envoy_port),)
        return tuple(node.url for node in self.nodes)

    @property
    def ingress_url(self) -> str:
        """Where the gateway sends this region's requests."""
        if self.rtt_proxy_port is not None:
            return url_of(self.rtt_proxy_port)
        return self.upstream_urls[0]


@dataclass(frozen=True, slots=True)
class StackLayout:
    control_plane_port: int
    xds_port: int
    dns_port: int
    gateway_port: int
    gateway_pop: str
    regions: tuple[RegionLayout, ...]

    @property
    def control_plane_url(self) -> str:
        return url_of(self.control_plane_port)

    @property
    def gateway_url(self) -> str:
        return url_of(self.gateway_port, "https")

    @property
    def has_envoy(self) -> bool:
        return any(region.envoy_port is not None for region in self.regions)

    @property
    def has_rtt_proxy(self) -> bool:
        return any(region.rtt_proxy_port is not None for region in self.regions)

    @property
    def nodes(self) -> tuple[NodeLayout, ...]:
        return tuple(node for region in self.regions for node in region.nodes)

    def tcp_ports(self) -> list[tuple[int, str]]:
        """Every TCP port the stack listens on, with what listens there."""
        ports = [
            (self.control_plane_port, "control plane"),
            (self.xds_port, "control plane xDS"),
            (self.gateway_port, "gateway"),
        ]
        for region in self.regions:
            ports += [(node.port, f"node agent {node.node_id}") for node in region.nodes]
            if region.envoy_port is not None and region.envoy_admin_port is not None:
                ports.append((region.envoy_port, f"Envoy {region.name}"))
                ports.append((region.envoy_admin_port, f"Envoy {region.name} admin"))
            if region.rtt_proxy_port is not None:
                ports.append((region.rtt_proxy_port, f"RTT proxy {region.name}"))
        return ports


def plan_layout(config: StackConfig, use_envoy: bool) -> StackLayout:
    """Ports and URLs for every part; StackError if two parts would share a port."""
    ports = config.ports
    pop = locate(config.gateway.pop)
    regions = []
    for i, region in enumerate(config.regions):
        lat, lon = region.location
        nodes = tuple(
            NodeLayout(f"{region.name}-{j:02d}", ports.node_base + 100 * i + j)
            for j in range(region.nodes)
        )
        simulated_rtt_ms = region.rtt_ms
        if simulated_rtt_ms is None:
            simulated_rtt_ms = round(rtt_ms(pop, Location(region.name, lat, lon)), 1)
        regions.append(
            RegionLayout(
                name=region.name,
                lat=lat,
                lon=lon,
                rtt_ms=simulated_rtt_ms,
                nodes=nodes,
                envoy_port=ports.envoy_base + i if use_envoy else None,
                envoy_admin_port=ports.envoy_admin_base + i if use_envoy else None,
                rtt_proxy_port=ports.rtt_proxy_base + i if config.simulate_rtt else None,
            )
        )
    layout = StackLayout(
        control_plane_port=ports.control_plane,
        xds_port=ports.xds,
        dns_port=ports.dns,
        gateway_port=ports.gateway,
        gateway_pop=config.gateway.pop,
        regions=tuple(regions),
    )
    _check_distinct(layout)
    return layout


def _check_distinct(layout: StackLayout) -> None:
    owners: dict[int, str] = {}
    for port, owner in layout.tcp_ports():
        if not 1 <= port <= 65535:
            raise StackError(
                f"{owner} would listen on port {port}, outside 1-65535: lower the base"
            )
        if port in owners:
            raise StackError(
                f"{owners[port]} and {owner} would both listen on port {port}: "
                "move the bases in the config's `ports` apart"
            )
        owners[port] = owner


def _is_free(port: int, kind: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as sock:
        if kind == socket.SOCK_STREAM:
            # As the services themselves bind: a port in TIME_WAIT is free, a listener is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def check_ports_free(layout: StackLayout) -> None:
    """StackError naming the first port something else already holds."""
    busy = [
        (port, owner)
        for port, owner in layout.tcp_ports()
        if not _is_free(port, socket.SOCK_STREAM)
    ]
    if not _is_free(layout.dns_port, socket.SOCK_DGRAM):
        busy.append((layout.dns_port, "control plane DNS (UDP)"))
    if busy:
        port, owner = busy[0]
        more = f" (and {len(busy) - 1} more)" if len(busy) > 1 else ""
        raise StackError(
            f"port {port} ({owner}) is already in use on {HOST}{more}: stop what holds it, "
            "or change `ports` in the stack config"
        )


def default_num_threads(num_nodes: int) -> int:
    """Torch threads per node agent: this machine's cores shared among them."""
    return max(1, (os.cpu_count() or 1) // max(1, num_nodes))

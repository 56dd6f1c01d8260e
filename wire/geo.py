"""Simulated geography: one table of named places, distances between them, and expected RTT.

Shared by the control plane's DNS, the gateway's region choice and the simulator, so that every
part of Meridian agrees on where things are and how far apart they are.

RTT model (see ARCHITECTURE.md, "Simulated geography"): light in fibre covers about 200 km per
millisecond, so a round trip costs about 1 ms per 100 km of great-circle distance
(`FIBRE_RTT_MS_PER_100_KM`); each network hop on the way adds a fixed `HOP_RTT_MS` (switching,
queueing, the last mile). Real paths are longer than great circles; we leave that out on purpose,
so results are easy to check by hand.

Clients are placed by address: `ClientLocator` maps subnets to place names (longest prefix wins);
the default table uses only documentation and benchmarking prefixes (RFC 5737, RFC 2544,
RFC 3849), so simulated clients never collide with real networks.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Protocol

EARTH_RADIUS_KM: Final = 6371.0
FIBRE_RTT_MS_PER_100_KM: Final = 1.0
HOP_RTT_MS: Final = 2.0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Place(Protocol):
    """Anything with a position: a `Location`, a region summary, a region."""

    @property
    def lat(self) -> float: ...

    @property
    def lon(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Location:
    name: str
    lat: float
    lon: float


def _table(*rows: tuple[str, float, float]) -> dict[str, Location]:
    return {name: Location(name, lat, lon) for name, lat, lon in rows}


# Where our regions' datacenters are.
REGIONS: Final = _table(
    ("us-east", 39.04, -77.49),  # Ashburn, Virginia
    ("us-west", 45.60, -121.18),  # The Dalles, Oregon
    ("eu-west", 53.35, -6.26),  # Dublin
    ("eu-central", 50.11, 8.68),  # Frankfurt
    ("ap-southeast", 1.35, 103.82),  # Singapore
    ("ap-northeast", 35.68, 139.69),  # Tokyo
    ("sa-east", -23.55, -46.63),  # São Paulo
)

# Client cities, which are also where points of presence (gateways) may stand.
CITIES: Final = _table(
    ("new-york", 40.71, -74.01),
    ("chicago", 41.88, -87.63),
    ("dallas", 32.78, -96.80),
    ("los-angeles", 34.05, -118.24),
    ("seattle", 47.61, -122.33),
    ("toronto", 43.65, -79.38),
    ("mexico-city", 19.43, -99.13),
    ("sao-paulo", -23.55, -46.63),
    ("buenos-aires", -34.60, -58.38),
    ("london", 51.51, -0.13),
    ("paris", 48.86, 2.35),
    ("madrid", 40.42, -3.70),
    ("stockholm", 59.33, 18.07),
    ("johannesburg", -26.20, 28.05),
    ("dubai", 25.20, 55.27),
    ("mumbai", 19.08, 72.88),
    ("singapore", 1.35, 103.82),
    ("hong-kong", 22.32, 114.17),
    ("tokyo", 35.68, 139.69),
    ("seoul", 37.57, 126.98),
    ("sydney", -33.87, 151.21),
)

LOCATIONS: Final[Mapping[str, Location]] = REGIONS | CITIES


def locate(name: str) -> Location:
    """The named place; a clear error for a name that is not in the table."""
    location = LOCATIONS.get(name)
    if location is None:
        raise KeyError(f"unknown location {name!r}; known: {', '.join(sorted(LOCATIONS))}")
    return location


def distance_km(a: Place, b: Place) -> float:
    """Great-circle distance (haversine) on a spherical Earth."""
    lat_a, lat_b = math.radians(a.lat), math.radians(b.lat)
    d_lat = lat_b - lat_a
    d_lon = math.radians(b.lon - a.lon)
    h = math.sin(d_lat / 2) ** 2 + math.cos(lat_a) * math.cos(lat_b) * math.sin(d_lon / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def rtt_ms(a: Place, b: Place, num_hops: int = 1) -> float:
    """Expected round-trip time between two places over `num_hops` network hops."""
    return distance_km(a, b) * FIBRE_RTT_MS_PER_100_KM / 100.0 + num_hops * HOP_RTT_MS


# Subnet → place. Each city gets one /24 of the benchmarking range 198.18.0.0/15 and one /48 of
# the IPv6 documentation prefix; the three IPv4 documentation /24s stand for three big cities.
DEFAULT_CLIENT_SUBNETS: Final[Mapping[str, str]] = {
    "192.0.2.0/24": "new-york",  # TEST-NET-1
    "198.51.100.0/24": "london",  # TEST-NET-2
    "203.0.113.0/24": "tokyo",  # TEST-NET-3
    **{f"198.18.{i}.0/24": name for i, name in enumerate(CITIES, start=1)},
    **{f"2001:db8:{i:x}::/48": name for i, name in enumerate(CITIES, start=1)},
}


def client_subnet_of(city: str, family: int = 4) -> str:
    """The default table's subnet for a city (for tests and the simulator)."""
    index = list(CITIES).index(city) + 1
    return f"198.18.{index}.0/24" if family == 4 else f"2001:db8:{index:x}::/48"


class ClientLocator:
    """Longest-prefix match of a client address against a subnet → location table."""

    def __init__(self, subnets: Mapping[str, str], locations: Mapping[str, Location]) -> None:
        entries: list[tuple[IPNetwork, Location]] = []
        for prefix, name in subnets.items():
            location = locations.get(name)
            if location is None:
                raise ValueError(f"client subnet {prefix}: unknown location {name!r}")
            try:
                network = ipaddress.ip_network(prefix, strict=False)
            except ValueError as exc:
                raise ValueError(f"client subnet {prefix!r}: {exc}") from exc
            entries.append((network, location))
        # Most specific first, so the first match is the longest prefix.
        self._entries = sorted(entries, key=lambda entry: -entry[0].prefixlen)

    def locate(self, address: IPAddress) -> Location | None:
        for network, location in self._entries:
            if network.version == address.version and address in network:
                return location
        return None

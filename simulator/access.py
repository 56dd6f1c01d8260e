"""How clients find their PoP: Anycast (the shortest path to an announced PoP) or DNS.

- `AnycastAccess`: the gateway's own `gateway.anycast.Anycast` table; a withdrawal moves the
  PoP's clients at once (routing converges before their next request).
- `DnsAccess`: the API name resolves to a PoP by the control plane's DNS decision
  (`control_plane.dns.decision.choose`: the nearest healthy target by expected RTT from the
  client's subnet), with the PoPs as its targets; each city's resolver caches the answer for
  the TTL of `DnsConfig()`, so a withdrawn PoP keeps the clients whose caches still name it
  until their answers expire (the gateway itself keeps serving them meanwhile).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Final, Literal

from control_plane.dns import decision
from control_plane.dns.config import DnsConfig
from control_plane.dns.decision import Target
from gateway.anycast import Anycast
from wire.geo import Location, client_subnet_of

Access = Literal["anycast", "dns"]
ACCESSES: Final = ("anycast", "dns")


class AnycastAccess:
    def __init__(self, pops: Mapping[str, Location], cities: Mapping[str, Location]) -> None:
        self.anycast = Anycast(pops)
        self.cities = cities
        self.catchment = self.anycast.catchments(cities)

    def pop_for(self, city: str, now_s: float) -> str:
        return self.catchment[city]

    def withdraw(self, pop: str) -> None:
        self.anycast.withdraw(pop)
        self.catchment = self.anycast.catchments(self.cities)

    def announce(self, pop: str) -> None:
        self.anycast.announce(pop)
        self.catchment = self.anycast.catchments(self.cities)


def _pop_target(index: int, name: str, place: Location, is_announced: bool) -> Target:
    # An address per PoP (198.19.1.0/24, in the benchmarking range); PoPs report no load.
    address = ipaddress.ip_address(f"198.19.1.{index + 1}")
    state: Literal["active", "disabled"] = "active" if is_announced else "disabled"
    return Target(name, place.lat, place.lon, state, 1, 0.0, 0.0, (address,))


class DnsAccess:
    def __init__(self, pops: Mapping[str, Location], cities: Mapping[str, Location]) -> None:
        self.config = DnsConfig()
        self.pops = pops
        self.cities = cities
        self.targets = [_pop_target(i, name, pops[name], True) for i, name in enumerate(pops)]
        self.client_shares = {
            city: decision.client_hash(ipaddress.ip_network(client_subnet_of(city)))
            for city in cities
        }
        self.cache: dict[str, tuple[str, float]] = {}  # city → (PoP, expires at)

    def pop_for(self, city: str, now_s: float) -> str:
        cached = self.cache.get(city)
        if cached is not None and now_s < cached[1]:
            return cached[0]
        choice = decision.choose(
            self.cities[city],
            self.client_shares[city],
            self.targets,
            frozenset(),
            self.config.shed_share,
        )
        assert choice is not None  # every PoP target has an address
        self.cache[city] = (choice.target.name, now_s + self.config.ttl_s)
        return choice.target.name

    def _set(self, pop: str, is_announced: bool) -> None:
        names = list(self.pops)
        index = names.index(pop)
        self.targets[index] = _pop_target(index, pop, self.pops[pop], is_announced)

    def withdraw(self, pop: str) -> None:
        self._set(pop, False)

    def announce(self, pop: str) -> None:
        self._set(pop, True)


def make_access(
    access: Access, pops: Mapping[str, Location], cities: Mapping[str, Location]
) -> AnycastAccess | DnsAccess:
    return AnycastAccess(pops, cities) if access == "anycast" else DnsAccess(pops, cities)

"""Anycast, simulated: every PoP announces the same prefix from where it stands; each client's
packets reach the announcing PoP with the shortest path; a PoP that fails withdraws its route
and its clients move to the next-nearest one, with no change on the client's side.

Path length is the great-circle RTT of the shared location table (`wire/geo.py`): real BGP picks
by AS path and policy, not distance, but "nearest by RTT" is the behaviour Anycast is deployed
for and what the simulator compares policies under. Ties go to the PoP whose name sorts first, so
results are deterministic. Pure and synchronous: no sockets, no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from wire.geo import Place, rtt_ms

# The prefix every PoP announces (TEST-NET-2, a documentation range).
ANYCAST_PREFIX = "198.51.100.0/24"


@dataclass(frozen=True, slots=True)
class Route:
    pop: str
    rtt_ms: float


class NoRouteError(LookupError):
    """No PoP announces the prefix: clients cannot reach the service at all."""


class Anycast:
    def __init__(self, pops: Mapping[str, Place], prefix: str = ANYCAST_PREFIX) -> None:
        if not pops:
            raise ValueError("anycast needs at least one PoP")
        self.prefix = prefix
        self._pops = dict(pops)
        self._announcing = set(self._pops)

    @property
    def announcing(self) -> frozenset[str]:
        return frozenset(self._announcing)

    def withdraw(self, pop: str) -> None:
        """The PoP failed (or is taken out): it stops announcing the prefix."""
        self._check(pop)
        self._announcing.discard(pop)

    def announce(self, pop: str) -> None:
        """The PoP is back: it announces the prefix again and wins back its nearest clients."""
        self._check(pop)
        self._announcing.add(pop)

    def routes(self, client: Place) -> list[Route]:
        """Every announcing PoP as seen from the client, shortest path first."""
        routes = [Route(name, rtt_ms(client, self._pops[name])) for name in self._announcing]
        routes.sort(key=lambda route: (route.rtt_ms, route.pop))
        return routes

    def reach(self, client: Place) -> Route:
        """The PoP the client's packets arrive at."""
        routes = self.routes(client)
        if not routes:
            raise NoRouteError(f"no PoP announces {self.prefix}")
        return routes[0]

    def catchments(self, clients: Mapping[str, Place]) -> dict[str, str]:
        """Client name → the PoP it reaches."""
        return {name: self.reach(place).pop for name, place in clients.items()}

    def _check(self, pop: str) -> None:
        if pop not in self._pops:
            raise KeyError(f"unknown PoP {pop!r}; known: {', '.join(sorted(self._pops))}")


def moved(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Clients whose PoP changed between two catchments: name → (old PoP, new PoP)."""
    return {
        name: (before[name], pop)
        for name, pop in after.items()
        if name in before and before[name] != pop
    }


def pops_at(names: Iterable[str], locations: Mapping[str, Place]) -> dict[str, Place]:
    """PoPs named after places of the location table (e.g. `wire.geo.CITIES`)."""
    return {name: locations[name] for name in names}

"""One-way delays between places: half the true RTT of the paths, memoised (asked for at every
hop of every attempt); an edge node is one hop from its gateway, whatever the paths' jitter."""

from __future__ import annotations

from simulator.edge import POP_TO_EDGE_MS, EdgeTier
from simulator.world import Geography
from wire.geo import Location


class OneWayDelays:
    def __init__(self, geography: Geography, edge: EdgeTier | None) -> None:
        self.geography = geography
        self._delays: dict[tuple[str, str], float] = {}
        if edge is not None:
            for pop, site in edge.sites.items():
                self._delays[(pop, site.name)] = self._delays[(site.name, pop)] = (
                    POP_TO_EDGE_MS / 1000.0
                )

    def between(self, a: Location, b: Location) -> float:
        key = (a.name, b.name)
        delay = self._delays.get(key)
        if delay is None:
            delay = self._delays[key] = self.geography.true_rtt_ms(a, b) / 2000.0
        return delay

"""One-way delays between places, asked for at every hop of every attempt.

A hop between a region and a PoP rides the private backbone: its delay is half the path's RTT,
memoised. A client's own hops ride the public internet: to its PoP, and, for clients that go
to a region directly (geo-DNS, `nearest`), to and from the region. Each public hop takes half
the public path's RTT plus a seeded draw of its jitter (exponential, a per-path share of the
one-way time), and with the path's loss rate a lost packet costs TCP's minimum retransmission
timeout on top. An edge node is one hop from its gateway, whatever the paths.
"""

from __future__ import annotations

import random
from typing import Final

from simulator.edge import POP_TO_EDGE_MS, EdgeTier
from simulator.world import Geography, path_key
from wire.geo import REGIONS, Location

# What a lost packet costs a hop: Linux's TCP_RTO_MIN (200 ms), the least a retransmission waits.
LOSS_PENALTY_S: Final = 0.2


class OneWayDelays:
    def __init__(self, geography: Geography, edge: EdgeTier | None, is_via_pop: bool) -> None:
        """`is_via_pop`: clients reach regions through a PoP (else straight, over public paths)."""
        self.geography = geography
        self.is_via_pop = is_via_pop
        self.rng = random.Random(f"jitter/{geography.seed}")
        self._delays: dict[tuple[str, str], float] = {}
        # Public paths: (one-way delay, mean jitter, loss rate).
        self._public: dict[tuple[str, str], tuple[float, float, float]] = {}
        if edge is not None:
            for pop, site in edge.sites.items():
                self._delays[(pop, site.name)] = self._delays[(site.name, pop)] = (
                    POP_TO_EDGE_MS / 1000.0
                )

    def between(self, a: Location, b: Location) -> float:
        key = (a.name, b.name)
        delay = self._delays.get(key)
        if delay is not None:
            return delay
        is_region_hop = a.name in REGIONS or b.name in REGIONS
        if is_region_hop and self.is_via_pop:
            delay = self._delays[key] = self.geography.true_rtt_ms(a, b) / 2000.0
            return delay
        return self._public_hop_s(a, b)

    def _public_hop_s(self, a: Location, b: Location) -> float:
        key = path_key(a, b)
        path = self._public.get(key)
        if path is None:
            geography = self.geography
            one_way_s = geography.true_rtt_ms(a, b, is_public=True) / 2000.0
            path = (one_way_s, one_way_s * geography.jitter_share[key], geography.loss_rate[key])
            self._public[key] = path
        one_way_s, jitter_s, loss_rate = path
        rng = self.rng
        delay = one_way_s + rng.expovariate(1.0 / jitter_s) if jitter_s > 0.0 else one_way_s
        if rng.random() < loss_rate:
            delay += LOSS_PENALTY_S
        return delay

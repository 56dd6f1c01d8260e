"""The simulated planet: where PoPs, regions and clients are, and how long packets take.

Places come from the shared location table (`wire/geo.py`). The RTT the simulation charges is the
table's great-circle estimate stretched by a seeded per-path factor plus a seeded per-path offset,
on one of two kinds of path. Between PoPs, regions and the control plane traffic rides the
private backbone: close to the great circle (0-10% longer, 0-1 ms), steady. A client's own path
(to its PoP, or straight to a region under geo-DNS) is the public internet: 0-40% longer, 0-6 ms
of last mile and peering, and per packet a seeded share of jitter and of loss (simulator/delays.py
draws them). The routing code itself only ever sees the table's estimate, as in production: the
difference is what its observed-TTFT correction has to learn.

Client demand: each city's share of the population, modulated by a diurnal curve for its
continent (peak in the local afternoon). A simulated day is compressed into the length of a run,
so that every run sees each continent's peak and trough.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from wire.geo import CITIES, REGIONS, Location, rtt_ms

# Metro populations in millions (rounded), the share of clients each city sends.
POPULATION_M: Final[Mapping[str, float]] = {
    "new-york": 19.5, "chicago": 9.4, "dallas": 7.9, "los-angeles": 12.9, "seattle": 4.1,
    "toronto": 6.4, "mexico-city": 22.1, "sao-paulo": 22.6, "buenos-aires": 15.5,
    "london": 14.8, "paris": 12.4, "madrid": 6.8, "stockholm": 2.4, "johannesburg": 10.0,
    "dubai": 3.6, "mumbai": 21.3, "singapore": 5.9, "hong-kong": 7.5, "tokyo": 37.2,
    "seoul": 25.7, "sydney": 5.3,
}  # fmt: skip

CONTINENT: Final[Mapping[str, str]] = {
    "new-york": "north-america", "chicago": "north-america", "dallas": "north-america",
    "los-angeles": "north-america", "seattle": "north-america", "toronto": "north-america",
    "mexico-city": "north-america", "sao-paulo": "south-america",
    "buenos-aires": "south-america", "london": "europe", "paris": "europe", "madrid": "europe",
    "stockholm": "europe", "johannesburg": "africa", "dubai": "asia", "mumbai": "asia",
    "singapore": "asia", "hong-kong": "asia", "tokyo": "asia", "seoul": "asia",
    "sydney": "oceania",
}  # fmt: skip

# The continent's local time zone, in hours from UTC, that its diurnal curve peaks by.
CONTINENT_UTC_OFFSET_H: Final[Mapping[str, float]] = {
    "north-america": -6.0, "south-america": -3.0, "europe": 1.0, "africa": 2.0,
    "asia": 7.0, "oceania": 10.0,
}  # fmt: skip

# Points of presence: gateways stand in these cities (a subset of the table, spread out).
DEFAULT_POPS: Final = (
    "new-york", "dallas", "los-angeles", "seattle", "sao-paulo", "london", "paris",
    "stockholm", "johannesburg", "dubai", "mumbai", "singapore", "tokyo", "sydney",
)  # fmt: skip

# Where the control plane runs (heartbeats go there, summaries come from there).
CONTROL_PLANE_AT: Final = "us-east"

# Demand at the local peak (15:00) over the trough (03:00).
DIURNAL_PEAK_OVER_TROUGH: Final = 3.0
MAX_DIURNAL_FACTOR: Final = 2.0 * DIURNAL_PEAK_OVER_TROUGH / (DIURNAL_PEAK_OVER_TROUGH + 1.0)
MAX_PATH_STRETCH: Final = 0.4  # public paths are 0-40% longer than the great circle
MAX_PATH_OFFSET_MS: Final = 6.0
MAX_BACKBONE_STRETCH: Final = 0.1  # a private backbone runs close to it
MAX_BACKBONE_OFFSET_MS: Final = 1.0
# A public path's jitter: each one-way trip takes an exponential extra delay of this share of
# its one-way time on average (seeded per path between the two).
PUBLIC_JITTER_SHARE: Final = (0.02, 0.10)
# A public path loses this share of the packets per 100 ms of RTT (seeded per path between the
# two), at most MAX_PUBLIC_LOSS.
PUBLIC_LOSS_PER_100_MS: Final = (0.002, 0.008)
MAX_PUBLIC_LOSS: Final = 0.02


def diurnal_factor(continent: str, phase: float) -> float:
    """Demand relative to the daily mean (mean 1) at `phase` of the day (0 = 00:00 UTC)."""
    local_h = (phase * 24.0 + CONTINENT_UTC_OFFSET_H[continent]) % 24.0
    depth = (DIURNAL_PEAK_OVER_TROUGH - 1.0) / (DIURNAL_PEAK_OVER_TROUGH + 1.0)
    return 1.0 + depth * math.cos(2.0 * math.pi * (local_h - 15.0) / 24.0)


@dataclass(frozen=True, slots=True)
class Geography:
    pops: Mapping[str, Location]
    regions: Mapping[str, Location]
    cities: Mapping[str, Location]
    control_plane: Location
    # Seeded per path: true RTT = table RTT * stretch + offset, on the public internet and on
    # the backbone; a public path's jitter share and loss rate.
    stretch: Mapping[tuple[str, str], float]
    offset_ms: Mapping[tuple[str, str], float]
    backbone_stretch: Mapping[tuple[str, str], float]
    backbone_offset_ms: Mapping[tuple[str, str], float]
    jitter_share: Mapping[tuple[str, str], float]
    loss_rate: Mapping[tuple[str, str], float]
    seed: int = 0

    def true_rtt_ms(self, a: Location, b: Location, is_public: bool = False) -> float:
        """The path's RTT without jitter: over the backbone (PoPs, regions, the control plane),
        or, `is_public`, over the internet (a client's own path)."""
        key = path_key(a, b)
        if is_public:
            return rtt_ms(a, b) * self.stretch[key] + self.offset_ms[key]
        return rtt_ms(a, b) * self.backbone_stretch[key] + self.backbone_offset_ms[key]

    def population_shares(self) -> dict[str, float]:
        total = sum(POPULATION_M[name] for name in self.cities)
        return {name: POPULATION_M[name] / total for name in self.cities}


def path_key(a: Location, b: Location) -> tuple[str, str]:
    return (a.name, b.name) if a.name <= b.name else (b.name, a.name)


def build_geography(seed: int, pops: tuple[str, ...] = DEFAULT_POPS) -> Geography:
    rng = random.Random(f"geography/{seed}")
    paths = random.Random(f"paths/{seed}")  # apart, so the public paths stay those of before
    places = {**REGIONS, **CITIES}
    names = sorted(places)
    stretch: dict[tuple[str, str], float] = {}
    offset_ms: dict[tuple[str, str], float] = {}
    backbone_stretch: dict[tuple[str, str], float] = {}
    backbone_offset_ms: dict[tuple[str, str], float] = {}
    jitter_share: dict[tuple[str, str], float] = {}
    loss_rate: dict[tuple[str, str], float] = {}
    for i, a in enumerate(names):
        for b in names[i:]:
            key = (a, b)
            stretch[key] = 1.0 + rng.uniform(0.0, MAX_PATH_STRETCH)
            offset_ms[key] = rng.uniform(0.0, MAX_PATH_OFFSET_MS)
            backbone_stretch[key] = 1.0 + paths.uniform(0.0, MAX_BACKBONE_STRETCH)
            backbone_offset_ms[key] = paths.uniform(0.0, MAX_BACKBONE_OFFSET_MS)
            jitter_share[key] = paths.uniform(*PUBLIC_JITTER_SHARE)
            public_ms = rtt_ms(places[a], places[b]) * stretch[key] + offset_ms[key]
            loss = paths.uniform(*PUBLIC_LOSS_PER_100_MS) * public_ms / 100.0
            loss_rate[key] = min(MAX_PUBLIC_LOSS, loss)
    return Geography(
        pops={name: CITIES[name] for name in pops},
        regions=dict(REGIONS),
        cities=dict(CITIES),
        control_plane=REGIONS[CONTROL_PLANE_AT],
        stretch=stretch,
        offset_ms=offset_ms,
        backbone_stretch=backbone_stretch,
        backbone_offset_ms=backbone_offset_ms,
        jitter_share=jitter_share,
        loss_rate=loss_rate,
        seed=seed,
    )

"""The two kinds of path the stack's RTT proxy simulates, as the simulator models them
(simulator/delays.py): between PoPs and regions traffic rides a private backbone, steady at
half the RTT each way; a client's own path straight to a region (geo-DNS, no PoP) is the public
internet, where each chunk of bytes takes an exponential extra delay (on average
`jitter_share` of the one-way time) and, with probability `loss_rate`, a lost packet's
retransmission on top (TCP's minimum timeout). Draws come from a seeded RNG, so a run's schedule
is the same every time; chunks stay in order, so a late one holds back those behind it, as TCP's
in-order delivery does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final, Literal

# What a lost packet costs: Linux's TCP_RTO_MIN, the least a retransmission waits (as the
# simulator charges it).
LOSS_PENALTY_S: Final = 0.2

PathKind = Literal["backbone", "public"]


@dataclass(frozen=True, slots=True)
class PublicPath:
    """How the public internet treats a client's direct path (the backbone has neither)."""

    jitter_share: float = 0.05  # mean extra one-way delay over the one-way time
    loss_rate: float = 0.005  # share of chunks that wait for a retransmission

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter_share <= 10.0:
            raise ValueError(f"jitter_share must be 0-10, got {self.jitter_share}")
        if not 0.0 <= self.loss_rate < 1.0:
            raise ValueError(f"loss_rate must be 0 to under 1, got {self.loss_rate}")


class PathDelays:
    """Each chunk's one-way delay on one direction of one connection."""

    def __init__(self, one_way_s: float, public: PublicPath | None, rng: random.Random) -> None:
        """`public`: None for the backbone (every chunk `one_way_s` late, no draws)."""
        self.one_way_s = one_way_s
        self._jitter_s = one_way_s * public.jitter_share if public is not None else 0.0
        self._loss_rate = public.loss_rate if public is not None else 0.0
        self._rng = rng
        self.num_lost = 0  # chunks that waited for a retransmission

    @classmethod
    def steady(cls, one_way_s: float) -> PathDelays:
        return cls(one_way_s, None, random.Random(0))

    def next_s(self) -> float:
        delay_s = self.one_way_s
        if self._jitter_s > 0.0:
            delay_s += self._rng.expovariate(1.0 / self._jitter_s)
        if self._loss_rate > 0.0 and self._rng.random() < self._loss_rate:
            self.num_lost += 1
            delay_s += LOSS_PENALTY_S
        return delay_s


def connection_rng(seed: int, listen_port: int, connection: int, direction: str) -> random.Random:
    """The draws of one direction of the `connection`-th connection a route accepted: the same
    for every run with the same seed, and apart from every other's."""
    return random.Random(f"{seed}/{listen_port}/{connection}/{direction}")

"""The two kinds of path the stack's RTT proxy and Anycast front simulate, as the simulator
models them (simulator/delays.py): between PoPs and regions traffic rides a private backbone,
steady at half the RTT each way; a client's own paths (to its PoP, and straight to a region as
geo-DNS alone sends it) are the public internet, where each chunk of bytes takes an exponential
extra delay (on average `jitter_share` of the one-way time) and, with a chance that grows with
the path's length (`loss_per_100_ms` per 100 ms of RTT), a lost packet's retransmission on top
(TCP's minimum timeout): a near PoP's short public leg loses less than a far region's long
one. Draws come from a seeded RNG, so a run's schedule is the same every time; chunks stay in
order, so a late one holds back those behind it, as TCP's in-order delivery does.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Final, Literal

# What a lost packet costs: Linux's TCP_RTO_MIN, the least a retransmission waits (as the
# simulator charges it).
LOSS_PENALTY_S: Final = 0.2
MAX_LOSS_RATE: Final = 0.5  # a path that loses more is down, not slow

PathKind = Literal["backbone", "public"]


@dataclass(frozen=True, slots=True)
class PublicPath:
    """How the public internet treats a client's direct path (the backbone has neither)."""

    jitter_share: float = 0.05  # mean extra one-way delay over the one-way time
    # The share of chunks that wait for a retransmission, per 100 ms of the path's RTT (the
    # simulator draws 0.002-0.008 per path).
    loss_per_100_ms: float = 0.005

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter_share <= 10.0:
            raise ValueError(f"jitter_share must be 0-10, got {self.jitter_share}")
        if not 0.0 <= self.loss_per_100_ms <= 0.1:
            raise ValueError(f"loss_per_100_ms must be 0-0.1, got {self.loss_per_100_ms}")

    def loss_rate(self, one_way_s: float) -> float:
        """The share of chunks lost on a path of this one-way time."""
        return min(self.loss_per_100_ms * one_way_s * 20.0, MAX_LOSS_RATE)


class PathDelays:
    """Each chunk's one-way delay on one direction of one connection."""

    def __init__(self, one_way_s: float, public: PublicPath | None, rng: random.Random) -> None:
        """`public`: None for the backbone (every chunk `one_way_s` late, no draws)."""
        self.one_way_s = one_way_s
        self._jitter_s = one_way_s * public.jitter_share if public is not None else 0.0
        self._loss_rate = public.loss_rate(one_way_s) if public is not None else 0.0
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


def add_path_arguments(parser: argparse.ArgumentParser) -> None:
    """The public path's settings (`public_path_of`) and the seed, as command-line options."""
    defaults = PublicPath()
    parser.add_argument("--jitter-share", type=float, default=defaults.jitter_share)
    parser.add_argument("--loss-per-100-ms", type=float, default=defaults.loss_per_100_ms)
    parser.add_argument("--seed", type=int, default=0)


def public_path_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PublicPath:
    """The public path the options name; a bad value ends the program with a usage error."""
    try:
        return PublicPath(args.jitter_share, args.loss_per_100_ms)
    except ValueError as exc:
        parser.error(str(exc))


def connection_rng(seed: int, listen_port: int, connection: int, direction: str) -> random.Random:
    """The draws of one direction of the `connection`-th connection a route accepted: the same
    for every run with the same seed, and apart from every other's."""
    return random.Random(f"{seed}/{listen_port}/{connection}/{direction}")

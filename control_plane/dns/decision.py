"""Which region answers a client: pure functions over immutable values, no sockets, no clock.

The rule, in order:

1. Candidates are the regions we have an answer address for, ranked by expected RTT from the
   client's location (`wire.geo.rtt_ms`; name breaks ties).
2. Healthy candidates are active regions with at least one healthy node. If there is none, fail
   open: answer the nearest region that is not disabled (or, if all are, the nearest of all),
   rather than answering nothing; the TTL is short, so clients come back soon.
3. The nearest healthy region answers, unless it is shedding (saturated) and the client's subnet
   hashes into the shed share: then the next-nearest healthy region that is not shedding answers
   (if every healthy region is shedding, moving clients helps nobody: the nearest answers).

Shedding has hysteresis: `next_shedding` puts a region in when KV use or queue delay crosses the
enter marks and takes it out only when both are below the lower leave marks, so load that
oscillates between the marks does not make answers flap. Which clients move is a deterministic
hash of their subnet, so the same clients move every time (their caches stay warm).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from wire.geo import IPAddress, IPNetwork, Place, rtt_ms
from wire.region_summary import RegionState

# Clients are told apart by /24 (IPv4) or /56 (IPv6), like most ECS-sending resolvers.
CLIENT_PREFIX_V4: Final = 24
CLIENT_PREFIX_V6: Final = 56

Reason = Literal["nearest", "shed", "fail_open"]


@dataclass(frozen=True, slots=True)
class Target:
    """A region as the DNS sees it."""

    name: str
    lat: float
    lon: float
    state: RegionState
    num_healthy_nodes: int
    kv_used_share: float  # 0 when no capacity is reported
    queue_delay_s: float
    addresses: tuple[IPAddress, ...]

    @property
    def is_healthy(self) -> bool:
        return self.state == "active" and self.num_healthy_nodes > 0


@dataclass(frozen=True, slots=True)
class ShedMarks:
    enter_kv_used_share: float
    leave_kv_used_share: float
    enter_queue_delay_s: float
    leave_queue_delay_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    target: Target
    reason: Reason


def client_network(address: IPAddress, source_prefix_len: int | None = None) -> IPNetwork:
    """The subnet a client is known by: its ECS prefix or its address, cut to /24 or /56."""
    max_len = CLIENT_PREFIX_V4 if address.version == 4 else CLIENT_PREFIX_V6
    prefix_len = max_len if source_prefix_len is None else min(source_prefix_len, max_len)
    return ipaddress.ip_network((address, prefix_len), strict=False)


def client_hash(network: IPNetwork) -> float:
    """A stable number in [0, 1) for a subnet (the same on every run and every server)."""
    key = network.network_address.packed + bytes([network.prefixlen])
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def is_saturated(target: Target, marks: ShedMarks, was_shedding: bool) -> bool:
    if was_shedding:  # stay until both are at or below the leave marks
        return (
            target.kv_used_share > marks.leave_kv_used_share
            or target.queue_delay_s > marks.leave_queue_delay_s
        )
    return (
        target.kv_used_share > marks.enter_kv_used_share
        or target.queue_delay_s > marks.enter_queue_delay_s
    )


def next_shedding(
    previous: frozenset[str], targets: Iterable[Target], marks: ShedMarks
) -> frozenset[str]:
    """The healthy regions shedding clients now, given which were shedding before."""
    return frozenset(
        target.name
        for target in targets
        if target.is_healthy and is_saturated(target, marks, target.name in previous)
    )


def rank(client: Place, targets: Iterable[Target]) -> list[Target]:
    """Targets with an address, nearest (lowest expected RTT) first."""
    usable = (target for target in targets if target.addresses)
    return sorted(usable, key=lambda target: (rtt_ms(client, target), target.name))


def choose(
    client: Place,
    client_share: float,
    targets: Sequence[Target],
    shedding: frozenset[str],
    shed_share: float,
) -> Decision | None:
    """The region that answers a client at `client` whose subnet hashes to `client_share`.

    None only when no region has an answer address at all.
    """
    ranked = rank(client, targets)
    healthy = [target for target in ranked if target.is_healthy]
    if not healthy:
        fallback = [target for target in ranked if target.state != "disabled"] or ranked
        return Decision(fallback[0], "fail_open") if fallback else None
    nearest = healthy[0]
    if nearest.name in shedding and client_share < shed_share:
        relief = next((t for t in healthy[1:] if t.name not in shedding), None)
        if relief is not None:
            return Decision(relief, "shed")
    return Decision(nearest, "nearest")

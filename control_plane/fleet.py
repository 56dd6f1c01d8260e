"""In-memory fleet state: regions, nodes, their latest heartbeats, and node health.

Owned by the event loop (only touched from async code, never from worker threads). Durable facts
(regions, node identities, drain requests) are loaded from the store at start and updated after
each committed change; live capacity and last-heard-from times are memory only, so a restarted
control plane counts every node unhealthy until it beats again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from wire.heartbeat import Heartbeat
from wire.region_summary import RegionState

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    lat: float
    lon: float
    ingress_url: str | None
    weight: float
    state: RegionState
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """What a node says about itself that is worth persisting (changes rarely)."""

    region: str
    url: str
    model: str
    tp_size: int

    @classmethod
    def of(cls, beat: Heartbeat) -> NodeIdentity:
        return cls(region=beat.region, url=beat.url, model=beat.model, tp_size=beat.tp_size)


@dataclass(slots=True)
class Node:
    node_id: str
    identity: NodeIdentity
    drain_requested: bool
    registered_at: float
    last_beat: Heartbeat | None = None
    last_seen_mono: float | None = None  # event-loop clock when the last beat arrived
    last_seen_unix: float | None = None
    is_healthy: bool = False

    @property
    def is_draining(self) -> bool:
        """Asked to drain by an operator, or draining on its own (e.g. SIGTERM at the node)."""
        return self.drain_requested or (self.last_beat is not None and self.last_beat.draining)

    @property
    def is_routable(self) -> bool:
        return self.is_healthy and not self.is_draining


@dataclass(slots=True)
class Fleet:
    unhealthy_after_s: float
    regions: dict[str, Region] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)

    def record_beat(self, node: Node, beat: Heartbeat, now_mono: float, now_unix: float) -> None:
        """Store a beat: the node is healthy from now until it misses too many."""
        node.last_beat = beat
        node.last_seen_mono = now_mono
        node.last_seen_unix = now_unix
        if not node.is_healthy:
            node.is_healthy = True
            logger.info("node %s is healthy (region %s)", node.node_id, beat.region)

    def sweep(self, now_mono: float) -> list[Node]:
        """Mark nodes silent for longer than the limit unhealthy; returns the ones that changed."""
        changed: list[Node] = []
        for node in self.nodes.values():
            if not node.is_healthy or node.last_seen_mono is None:
                continue
            if now_mono - node.last_seen_mono > self.unhealthy_after_s:
                node.is_healthy = False
                changed.append(node)
                logger.warning(
                    "node %s is unhealthy: no heartbeat for %.1f s",
                    node.node_id,
                    now_mono - node.last_seen_mono,
                )
        return changed

    def nodes_in(self, region: str) -> list[Node]:
        return [node for node in self.nodes.values() if node.identity.region == region]

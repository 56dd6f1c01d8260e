"""In-memory fleet state: regions, nodes, their latest heartbeats, and node health.

Owned by the event loop (only touched from async code, never from worker threads). Durable facts
(regions, node identities, drain requests) are loaded from the store at start and updated after
each committed change; live capacity and last-heard-from times are memory only, so a restarted
control plane counts every node unhealthy until it beats again.

Nodes have two possible sources: heartbeats (the node reports to us; durable in the store) and,
with `--consul`, Consul's catalog (memory only, replaced whenever Consul's view changes). The merge
rule, one place in `Node.is_healthy`:

- Consul says the node's checks are critical: unhealthy, whatever the heartbeats say (a veto).
- The node heartbeats to us: healthy while its beats are current and its latest says its engine
  is alive (Consul passing alone is not enough: a node that reports to us and stops is gone, or
  cut off from us).
- Known only from Consul: healthy while Consul's checks pass (passing or warning); it carries no
  capacity numbers. When Consul is unreachable its opinion is "unknown": no veto, and Consul-only
  nodes are unhealthy until Consul answers again.
- Deregistered from Consul: a Consul-only node is forgotten; a heartbeat node just loses the veto.

A draining node leaves routing step by step, as its drain sequence (`control_plane.drain.sequence`)
moves: first out of EDS (`is_routable`), later out of the region summaries (`is_in_summaries`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from wire.heartbeat import Heartbeat, ModelIdentity
from wire.model_catalog import ModelCatalog
from wire.region_summary import RegionState

logger = logging.getLogger(__name__)

# A drain sequence's steps (`control_plane.drain.sequence`), in order; a node's routing follows
# its phase (out of EDS from "envoy", out of the summaries from "summaries").
STEPS: Final = ("admissions", "envoy", "summaries", "dns", "consul", "in_flight", "exit")
DONE: Final = "done"
PHASES: Final = (*STEPS, DONE)
_INDEX: Final = {name: index for index, name in enumerate(PHASES)}


def has_reached(phase: str | None, step: str) -> bool:
    """Whether a sequence in `phase` has started `step` (None: no sequence)."""
    return phase is not None and _INDEX[phase] >= _INDEX[step]


def is_known_phase(phase: str) -> bool:
    return phase in _INDEX


# The models that may be routed to: the ones the catalog lists, or None for every model some node
# serves (while the catalog lists none). A node serving another model is "unlisted": in status,
# but in no route (summaries' per-model loads, Envoy's per-model routes).
Listed = frozenset[str] | None


def listed_models(catalog: ModelCatalog | None) -> Listed:
    if catalog is None or catalog.is_empty:
        return None
    return frozenset(model.name for model in catalog.models)


def is_listed(model: str, listed: Listed) -> bool:
    return listed is None or model in listed


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
    is_deleting: bool = False  # DELETE asked: its nodes drain, then the region goes
    picker: str | None = None  # its endpoint picker's "IP:PORT" (control_plane/xds/picker.py)


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


# Consul's aggregated check status for a service instance; "unknown" while Consul is unreachable.
ConsulStatus = Literal["passing", "warning", "critical", "unknown"]
NodeSource = Literal["heartbeat", "consul"]


@dataclass(frozen=True, slots=True)
class ConsulEntry:
    """One node agent as Consul lists it (service instance id = node id)."""

    identity: NodeIdentity
    status: ConsulStatus


@dataclass(slots=True)
class Node:
    node_id: str
    identity: NodeIdentity
    drain_requested: bool
    registered_at: float
    last_beat: Heartbeat | None = None
    last_seen_mono: float | None = None  # event-loop clock when the last beat arrived
    last_seen_unix: float | None = None
    is_beating: bool = False  # heard from within the heartbeat limit
    is_from_heartbeats: bool = True  # registered by its heartbeats (in the store)
    consul: ConsulEntry | None = None  # what Consul says, when it lists this node
    num_beats: int = 0  # heartbeats received since this control plane started
    # Beats up to this one were made before the node heard its drain was cancelled: their
    # `draining` echoes the cancelled drain and is ignored.
    drain_echo_until: int = 0
    # The phase of the node's drain sequence (`control_plane.drain.book` keeps it as it moves).
    drain_phase: str | None = None

    @property
    def model(self) -> str:
        """The name it serves its model under (from its beats, or Consul's)."""
        return self.identity.model

    @property
    def model_identity(self) -> ModelIdentity | None:
        """What its model is, from its latest beat (None: not reported, or not heard from)."""
        return self.last_beat.model_identity if self.last_beat is not None else None

    @property
    def sources(self) -> list[NodeSource]:
        found: list[NodeSource] = ["heartbeat"] if self.is_from_heartbeats else []
        return found + ["consul"] if self.consul is not None else found

    @property
    def is_healthy(self) -> bool:
        """The merge rule in the module docstring."""
        if self.consul is not None and self.consul.status == "critical":
            return False
        if self.is_from_heartbeats:
            return self.is_beating and (self.last_beat is None or self.last_beat.engine_alive)
        return self.consul is not None and self.consul.status in ("passing", "warning")

    @property
    def reports_draining(self) -> bool:
        """Its latest beat says it is draining (on its own, or because it was told to)."""
        beat = self.last_beat
        return beat is not None and beat.draining and self.num_beats > self.drain_echo_until

    @property
    def is_draining(self) -> bool:
        """Asked to drain (by an operator or its region), or draining on its own (SIGTERM)."""
        return self.drain_requested or self.drain_phase is not None or self.reports_draining

    @property
    def is_out_of_eds(self) -> bool:
        return has_reached(self.drain_phase, "envoy")

    @property
    def is_out_of_summaries(self) -> bool:
        return has_reached(self.drain_phase, "summaries")

    def _has_left(self, is_out: bool) -> bool:
        # In a drain sequence, the sequence says; draining without one (a bare Fleet, as in unit
        # tests: the running control plane starts a sequence at once) means out of everything.
        return is_out if self.drain_phase is not None else self.is_draining

    @property
    def is_routable(self) -> bool:
        """Envoy routes to it: healthy, and no drain has taken it out of EDS."""
        return self.is_healthy and not self._has_left(self.is_out_of_eds)

    @property
    def is_in_summaries(self) -> bool:
        """Counted in its region's summary (gateways, DNS): a drain takes it out after EDS."""
        return self.is_healthy and not self._has_left(self.is_out_of_summaries)


@dataclass(slots=True)
class Fleet:
    unhealthy_after_s: float
    regions: dict[str, Region] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    # Consul's latest view by node id (empty without --consul), kept to merge late-coming nodes.
    consul: dict[str, ConsulEntry] = field(default_factory=dict)
    # Bumped whenever a known node moves to another region (adding or removing nodes changes
    # `len(nodes)`): together they say when the by-region index must be rebuilt.
    membership_version: int = 0
    _by_region: dict[str, list[Node]] = field(default_factory=dict, repr=False)
    _by_region_key: tuple[int, int] = (-1, -1)

    def record_beat(self, node: Node, beat: Heartbeat, now_mono: float, now_unix: float) -> None:
        """Store a beat: the node is healthy from now until it misses too many."""
        node.last_beat = beat
        node.num_beats += 1
        node.last_seen_mono = now_mono
        node.last_seen_unix = now_unix
        if not node.is_beating:
            node.is_beating = True
            logger.info("node %s is beating (region %s)", node.node_id, beat.region)

    def sweep(self, now_mono: float) -> list[Node]:
        """Mark nodes silent for longer than the limit unhealthy; returns the ones that changed."""
        changed: list[Node] = []
        for node in self.nodes.values():
            if not node.is_beating or node.last_seen_mono is None:
                continue
            if now_mono - node.last_seen_mono > self.unhealthy_after_s:
                node.is_beating = False
                changed.append(node)
                logger.warning(
                    "node %s is unhealthy: no heartbeat for %.1f s",
                    node.node_id,
                    now_mono - node.last_seen_mono,
                )
        return changed

    def nodes_in(self, region: str) -> list[Node]:
        """The nodes of `region`, from an index rebuilt only when membership changed, so that
        per-region work (a summary, an ingress plan) costs the region's size, not the fleet's."""
        key = (len(self.nodes), self.membership_version)
        if key != self._by_region_key:
            by_region: dict[str, list[Node]] = {}
            for node in self.nodes.values():
                by_region.setdefault(node.identity.region, []).append(node)
            self._by_region, self._by_region_key = by_region, key
        return list(self._by_region.get(region, ()))

    def move(self, node: Node, identity: NodeIdentity) -> None:
        """Give a known node a new identity (its region may change)."""
        if identity.region != node.identity.region:
            self.membership_version += 1
        node.identity = identity

    def forget(self, node_ids: Iterable[str], now_unix: float) -> None:
        """Drop registered nodes; one that Consul still lists stays, as a Consul-only node."""
        for node_id in node_ids:
            self.nodes.pop(node_id, None)
        self.membership_version += 1
        self.apply_consul(self.consul, now_unix)

    def merge(self, fresh: Fleet, now_unix: float) -> None:
        """Regions and registrations as the store has them (`fresh`, as another replica wrote
        them); live state (beats) is kept."""
        self.regions.clear()
        self.regions.update(fresh.regions)
        for node_id, stored in fresh.nodes.items():
            node = self.nodes.get(node_id)
            if node is None:
                stored.consul = self.consul.get(node_id)
                self.nodes[node_id] = stored
                continue
            if node.identity != stored.identity:
                self.move(node, stored.identity)
            node.drain_requested = stored.drain_requested
            node.is_from_heartbeats = True
        gone = [n for n, node in self.nodes.items() if node.is_from_heartbeats]
        gone = [n for n in gone if n not in fresh.nodes]
        if gone:
            self.forget(gone, now_unix)

    def apply_consul(self, entries: Mapping[str, ConsulEntry], now_unix: float) -> bool:
        """Adopt Consul's view; returns True if any node came, went or changed routability."""
        self.consul = dict(entries)
        is_changed = False
        for node_id, node in list(self.nodes.items()):
            entry = entries.get(node_id)
            if entry is None and not node.is_from_heartbeats:
                del self.nodes[node_id]
                self.membership_version += 1
                logger.info("node %s left Consul; forgotten", node_id)
                is_changed = True
            elif entry != node.consul:
                was_routable, old_identity = node.is_routable, node.identity
                node.consul = entry
                if entry is not None and not node.is_from_heartbeats:
                    self.move(node, entry.identity)
                is_changed |= node.is_routable != was_routable or node.identity != old_identity
        for node_id, entry in entries.items():
            if node_id not in self.nodes:
                self.nodes[node_id] = Node(
                    node_id=node_id,
                    identity=entry.identity,
                    drain_requested=False,
                    registered_at=now_unix,
                    is_from_heartbeats=False,
                    consul=entry,
                )
                self.membership_version += 1
                logger.info("node %s found in Consul (region %s)", node_id, entry.identity.region)
                is_changed = True
        return is_changed

"""Every node's drain sequence in memory, moved by the pure steps of `control_plane.drain.sequence`.

The book starts, cancels and advances sequences and makes each node's routing follow its phase (out
of EDS from step 2, out of the summaries from step 3), pushing EDS and publishing summaries when a
phase change asks for it. It writes nothing: what moved waits in `take_writes()` for the drain loop
(`control_plane.fleet.drain_loop`) to commit, and the Consul calls the steps ask for wait in
`take_consul_calls()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from control_plane import audit
from control_plane.drain.envoy_reports import PeerReports
from control_plane.drain.sequence import (
    AuditEffect,
    ConsulDeregisterEffect,
    DrainFacts,
    DrainReason,
    DrainSequence,
    DrainTimes,
    advance,
    start,
    wanted_reason,
)
from control_plane.model import Fleet, Node, has_reached
from control_plane.summaries import SummaryPublisher
from control_plane.xds.acks import lacks_endpoint
from control_plane.xds.server import XdsServer

logger = logging.getLogger(__name__)

MAX_PASSES: Final = 3  # per tick: advance, publish, advance again
# Every change that can start or end a drain calls `note` at once; the full pass over the fleet
# on a tick is a safety net, so it runs at most this often (it is O(fleet)).
RECONCILE_EVERY_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class DrainWrites:
    """What moved since the last take: rows to write (None: delete) and audit entries."""

    rows: dict[str, DrainSequence | None]
    entries: list[tuple[str, str, audit.AuditDetail]]  # node id, action, detail

    def __bool__(self) -> bool:
        return bool(self.rows or self.entries)


class DrainBook:
    def __init__(
        self,
        fleet: Fleet,
        publisher: SummaryPublisher,
        xds: XdsServer | None,
        times: DrainTimes,
        peer_envoys: PeerReports,
        has_consul: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`peer_envoys`: the other replicas' Envoys (replicas on PostgreSQL); `has_consul`: the
        fleet follows Consul (`--consul`)."""
        self.sequences: dict[str, DrainSequence] = {}
        self._has_consul = has_consul
        self._peer_envoys = peer_envoys
        self._fleet = fleet
        self._publisher = publisher
        self._xds = xds
        self._times = times
        self._clock = clock
        self._started_mono = time.monotonic()
        self._reconciled_mono = -RECONCILE_EVERY_S
        self._dirty: set[str] = set()  # node ids whose row must be written (or deleted)
        self._entries: list[tuple[str, str, audit.AuditDetail]] = []
        self._consul_calls: list[str] = []
        self._needs_publish = False
        self._needs_xds_refresh = False

    # --- starting and cancelling ---

    def restore(self, sequences: list[DrainSequence]) -> None:
        """Adopt the sequences read from the store (before the first tick)."""
        for sequence in sequences:
            node = self._fleet.nodes.get(sequence.node_id)
            if node is None:
                self._dirty.add(sequence.node_id)  # the node is gone: drop its row
                continue
            self.sequences[sequence.node_id] = sequence
            self._set_phase(node, sequence.phase)
        if sequences:
            logger.info("resuming %d drain sequences", len(self.sequences))

    def adopt(self, sequences: list[DrainSequence]) -> None:
        """The sequences as the store has them, in place of ours: a replica that does not lead
        follows the leader's writes; one just elected resumes from them. Nothing is pending."""
        wanted = {sequence.node_id: sequence for sequence in sequences}
        for node_id in [n for n in self.sequences if n not in wanted]:
            del self.sequences[node_id]
            if (node := self._fleet.nodes.get(node_id)) is not None:
                self._set_phase(node, None)
        for node_id, sequence in wanted.items():
            if (node := self._fleet.nodes.get(node_id)) is not None:
                self.sequences[node_id] = sequence
                self._set_phase(node, sequence.phase)
        self._dirty, self._entries, self._consul_calls = set(), [], []
        self._apply_routing()

    def note(self, node: Node) -> None:
        """Start or cancel `node`'s sequence if what is wanted of it changed. Synchronous, so
        the node never leaves routing ahead of its sequence; the drain loop persists the change."""
        sequence = self.sequences.get(node.node_id)
        reason = wanted_reason(node, self._fleet.regions.get(node.identity.region), sequence)
        if reason is not None and sequence is None:
            self._start(node, reason)
        elif reason is None and sequence is not None:
            self._cancel(node, sequence)

    def _start(self, node: Node, reason: DrainReason) -> None:
        sequence, effect = start(node, reason, self._clock())
        self._put(node, sequence)
        self._record(node.node_id, effect)
        logger.info("drain of node %s started (%s)", node.node_id, reason)

    def _cancel(self, node: Node, sequence: DrainSequence) -> None:
        del self.sequences[node.node_id]
        self._set_phase(node, None)
        # Its next beat is made before it hears of the cancel: a `draining` there is our echo.
        node.drain_echo_until = node.num_beats + 1
        self._record(node.node_id, AuditEffect("drain.cancel", {"phase": sequence.phase}))
        logger.info("drain of node %s cancelled in phase %s", node.node_id, sequence.phase)

    # --- moving ---

    def tick(self) -> None:
        """Start or cancel what changed, then move every sequence as far as it can go now."""
        if time.monotonic() - self._reconciled_mono >= RECONCILE_EVERY_S:
            self._reconciled_mono = time.monotonic()
            for node in list(self._fleet.nodes.values()):
                self.note(node)
        for _ in range(MAX_PASSES):
            for sequence in list(self.sequences.values()):
                self._advance(sequence)
            if not self._apply_routing():
                break

    def _advance(self, sequence: DrainSequence) -> None:
        node = self._fleet.nodes.get(sequence.node_id)
        if node is None:  # removed (DELETE /v1/nodes, its region deleted, or gone from Consul)
            del self.sequences[sequence.node_id]
            self._record(sequence.node_id, AuditEffect("drain.forget", {"phase": sequence.phase}))
            return
        moved, effects = advance(sequence, node, self._facts(sequence, node))
        for effect in effects:
            if isinstance(effect, ConsulDeregisterEffect):
                self._consul_calls.append(effect.node_id)
            else:
                self._record(node.node_id, effect)
                if effect.action == "drain.step":
                    logger.info("drain of node %s: %s done", node.node_id, effect.detail["step"])
        if moved is not sequence:
            self._put(node, moved)

    def _facts(self, sequence: DrainSequence, node: Node) -> DrainFacts:
        lagging: tuple[str, ...] | None = None
        num_envoys = 0
        if self._xds is not None:
            region = node.identity.region
            lagging = ()
            if sequence.phase == "envoy":  # only that step reads them
                peers = self._peer_envoys.acks_for(node.node_id)
                ours = self._xds.lagging(region, lacks_endpoint(node.identity.url))
                lagging = (*ours, *peers.lagging)
                num_envoys = self._xds.num_envoys_for(region) + peers.num_envoys
        return DrainFacts(
            now=self._clock(),
            times=self._times,
            is_silent=self._is_silent(node),
            lagging_envoys=lagging,
            num_envoys=num_envoys,
            summary_index=self._publisher.current.index,
            has_consul=self._has_consul,
        )

    def _is_silent(self, node: Node) -> bool:
        if not node.is_from_heartbeats:
            return True
        if node.last_seen_mono is None:
            return time.monotonic() - self._started_mono > self._times.unhealthy_after_s
        return not node.is_beating

    def _put(self, node: Node, sequence: DrainSequence) -> None:
        self.sequences[node.node_id] = sequence
        self._set_phase(node, sequence.phase)
        self._dirty.add(node.node_id)

    def _set_phase(self, node: Node, phase: str | None) -> None:
        """The node's routing follows its phase (`Node.is_out_of_eds`, `.is_out_of_summaries`):
        note what must be pushed when it changes."""
        was_out_of_eds, was_out_of_summaries = node.is_out_of_eds, node.is_out_of_summaries
        node.drain_phase = phase
        self._needs_xds_refresh |= node.is_out_of_eds != was_out_of_eds
        self._needs_publish |= node.is_out_of_summaries != was_out_of_summaries

    def _apply_routing(self) -> bool:
        """Push new EDS and publish new summaries if a phase change asked for it."""
        is_applied = self._needs_xds_refresh or self._needs_publish
        if self._needs_xds_refresh:
            self._needs_xds_refresh = False
            if self._xds is not None:
                self._xds.refresh()
        if self._needs_publish:
            self._needs_publish = False
            self._publisher.refresh()
        return is_applied

    # --- what the drain loop writes and does ---

    def _record(self, node_id: str, effect: AuditEffect) -> None:
        self._dirty.add(node_id)
        self._entries.append((node_id, effect.action, effect.detail))

    def take_writes(self) -> DrainWrites:
        writes = DrainWrites({n: self.sequences.get(n) for n in self._dirty}, self._entries)
        self._dirty, self._entries = set(), []
        return writes

    def put_back(self, writes: DrainWrites) -> None:
        """Writes that failed: taken again with the next ones."""
        self._dirty |= set(writes.rows)
        self._entries[:0] = writes.entries

    def take_consul_calls(self) -> list[str]:
        calls, self._consul_calls = self._consul_calls, []
        return calls

    def drained_regions(self) -> list[str]:
        """Regions being deleted whose every node has been told to exit."""
        return [
            region.name
            for region in self._fleet.regions.values()
            if region.is_deleting
            and all(has_reached(n.drain_phase, "exit") for n in self._fleet.nodes_in(region.name))
        ]

"""One drain sequence per node: the ordered steps that take a node out of service safely.

Whatever starts a drain — an operator (`POST /v1/nodes/{id}/drain`), the node's region (`PATCH`
to `state: draining`, or `DELETE`, as `terraform destroy` calls it), or the node itself (a node
agent that got SIGTERM reports `draining`) — the node goes through the same steps, in order:

1. admissions: the heartbeat reply says `drain: true`; done when the node reports `draining` (or
   is silent, or after `unhealthy_after_s`).
2. envoy: out of EDS; done when every connected Envoy routing to the region has ACKed endpoints
   without it (`XdsServer.lagging`, what `wait_for_ack` waits on; none connected: at once; at
   most `drain.envoy_ack_timeout_s`).
3. summaries: out of the region summaries gateways watch (published at once).
4. dns: out of DNS answers (they follow the summaries); done one DNS TTL later.
5. consul: with `--consul`, the reply says `consul_deregister: true` and the node deregisters
   itself; if it has not within half of `drain.consul_timeout_s`, or it is known from Consul only
   or silent, the control plane deregisters it through the Consul agent API. Done when Consul no
   longer lists it (at most `drain.consul_timeout_s`).
6. in_flight: done when the node reports nothing in flight, or stops beating (at most
   `drain.in_flight_timeout_s`).
7. exit: the reply says `may_exit: true`; done (phase `done`) when the node stops beating.

`tick` moves every sequence as far as it can: each step is a check on memory, never a wait.
`run`, owned by the app's lifespan, ticks every sweep interval (at once when poked) and writes what
moved to the store (table `drains`, and an audit entry per step), so a restarted control plane
resumes each sequence at its last recorded step and redoes it; every step's effect is idempotent.
Whether a node should be draining is decided from durable facts (its drain request, its region's
state) and its own reports, whenever they change (`note`) and on every tick: a sequence nobody
wants any more (undrain, region active again, a drained node restarted) is cancelled and the node
is back in routing at once. A node drained by an operator or its region stays drained (`may_exit`
keeps being sent) until undrained.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from control_plane import audit
from control_plane.audit import Actor
from control_plane.consul_sync import ConsulSync
from control_plane.fleet import Fleet, Node, Region
from control_plane.settings import Settings
from control_plane.store import Store
from control_plane.summaries import SummaryPublisher
from control_plane.xds.server import XdsServer, lacks_endpoint
from wire.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

STEPS: Final = ("admissions", "envoy", "summaries", "dns", "consul", "in_flight", "exit")
DONE: Final = "done"
PHASES: Final = (*STEPS, DONE)
_INDEX: Final = {name: index for index, name in enumerate(PHASES)}
ACTOR: Final = Actor(kind="control_plane", client="drain sequence")
MAX_PASSES: Final = 3  # per tick: advance, publish, advance again
CONSUL_CALL_TIMEOUT_S: Final = 5.0
# Every change that can start or end a drain calls `note` at once; the full pass over the fleet
# on a tick is a safety net, so it runs at most this often (it is O(fleet)).
RECONCILE_EVERY_S: Final = 1.0

DrainReason = Literal["operator", "region", "node"]


def has_reached(phase: str | None, step: str) -> bool:
    """Whether a sequence in `phase` has started `step` (None: no sequence)."""
    return phase is not None and _INDEX[phase] >= _INDEX[step]


def num_in_flight(beat: Heartbeat) -> int:
    if beat.num_in_flight is not None:
        return beat.num_in_flight
    return beat.num_running + beat.num_waiting


@dataclass(slots=True)
class StepRecord:
    started_at: float  # Unix seconds
    completed_at: float | None = None
    note: str = ""  # how it ended: "3 Envoys ACKed", "timed out after 5.0 s: ..."


@dataclass(slots=True)
class DrainSequence:
    node_id: str
    region: str
    reason: DrainReason
    started_at: float
    phase: str = STEPS[0]
    steps: dict[str, StepRecord] = field(default_factory=dict)
    is_consul_call_made: bool = False  # memory only: after a restart it may be made again

    @property
    def may_exit(self) -> bool:
        return has_reached(self.phase, "exit")

    def row(self, now: float) -> tuple[str, str, str, str, float, str, float]:
        steps = {
            name: [record.started_at, record.completed_at, record.note]
            for name, record in self.steps.items()
        }
        return (
            self.node_id,
            self.region,
            self.reason,
            self.phase,
            self.started_at,
            json.dumps(steps),
            now,
        )

    @classmethod
    def of_row(cls, row: sqlite3.Row) -> DrainSequence:
        steps = {
            name: StepRecord(started_at=started, completed_at=completed, note=note)
            for name, (started, completed, note) in json.loads(row["steps"]).items()
        }
        return cls(
            node_id=row["node_id"],
            region=row["region"],
            reason=row["reason"],
            started_at=row["started_at"],
            phase=row["phase"],
            steps=steps,
        )


def load_drains(conn: sqlite3.Connection) -> list[DrainSequence]:
    rows = conn.execute("SELECT * FROM drains ORDER BY started_at").fetchall()
    return [DrainSequence.of_row(row) for row in rows if row["phase"] in _INDEX]


def wanted_reason(
    node: Node, region: Region | None, sequence: DrainSequence | None
) -> DrainReason | None:
    """Why `node` should be draining now, or None. The node's own `draining` counts only for a
    drain it started itself (in a drain we started, it is the node's answer to us)."""
    if node.drain_requested:
        return "operator"
    if region is not None and (region.state == "draining" or region.is_deleting):
        return "region"
    if sequence is not None and sequence.reason == "node" and node.last_beat is None:
        return "node"  # not heard from since a restart: it was draining then
    is_own = sequence is None or sequence.reason == "node"
    if node.reports_draining and is_own:
        return "node"
    return None


@dataclass(frozen=True, slots=True)
class DrainTimes:
    unhealthy_after_s: float  # step 1's bound, and how long silence means a node is gone
    dns_ttl_s: float | None  # step 4's wait; None without a DNS server
    envoy_ack_timeout_s: float
    consul_timeout_s: float
    in_flight_timeout_s: float

    @classmethod
    def of(cls, settings: Settings) -> DrainTimes:
        return cls(
            unhealthy_after_s=settings.unhealthy_after_s,
            dns_ttl_s=float(settings.dns.ttl_s),
            envoy_ack_timeout_s=settings.drain.envoy_ack_timeout_s,
            consul_timeout_s=settings.drain.consul_timeout_s,
            in_flight_timeout_s=settings.drain.in_flight_timeout_s,
        )


class Drainer:
    """Every node's drain sequence; see the module docstring."""

    def __init__(
        self,
        fleet: Fleet,
        store: Store,
        publisher: SummaryPublisher,
        xds: XdsServer | None,
        times: DrainTimes,
        on_region_drained: Callable[[str], Awaitable[None]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sequences: dict[str, DrainSequence] = {}
        self.consul: ConsulSync | None = None  # set by the lifespan with --consul
        self._fleet = fleet
        self._store = store
        self._publisher = publisher
        self._xds = xds
        self._times = times
        self._on_region_drained = on_region_drained
        self._clock = clock
        self._started_mono = time.monotonic()
        self._reconciled_mono = -RECONCILE_EVERY_S
        self._dirty: set[str] = set()  # node ids whose row must be written (or deleted)
        self._entries: list[tuple[str, str, audit.AuditDetail]] = []  # audit entries to write
        self._needs_publish = False
        self._needs_xds_refresh = False
        self._finishing: set[str] = set()  # regions being deleted now
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._checks: dict[str, Callable[[DrainSequence, Node, float], str | None]] = {
            "admissions": self._check_admissions,
            "envoy": self._check_envoy,
            "summaries": self._check_summaries,
            "dns": self._check_dns,
            "consul": self._check_consul,
            "in_flight": self._check_in_flight,
            "exit": self._check_exit,
        }

    # --- starting and cancelling ---

    def restore(self, sequences: list[DrainSequence]) -> None:
        """Adopt the sequences read from the store at start (before the first tick)."""
        for sequence in sequences:
            node = self._fleet.nodes.get(sequence.node_id)
            if node is None:
                self._dirty.add(sequence.node_id)  # the node is gone: drop its row
                continue
            self.sequences[sequence.node_id] = sequence
            self._set_phase(node, sequence.phase)
        if sequences:
            logger.info("resuming %d drain sequences", len(self.sequences))

    def note(self, node: Node) -> None:
        """Start or cancel `node`'s sequence if what is wanted of it changed. Synchronous, so
        the node never leaves routing ahead of its sequence; the loop persists the change."""
        sequence = self.sequences.get(node.node_id)
        reason = wanted_reason(node, self._fleet.regions.get(node.identity.region), sequence)
        if reason is not None and sequence is None:
            self._start(node, reason)
        elif reason is None and sequence is not None:
            self._cancel(node, sequence)

    def _start(self, node: Node, reason: DrainReason) -> None:
        now = self._clock()
        sequence = DrainSequence(node.node_id, node.identity.region, reason, started_at=now)
        self.sequences[node.node_id] = sequence
        self._enter(sequence, node, STEPS[0], now)
        self._record(sequence, "drain.start", {"reason": reason})
        logger.info("drain of node %s started (%s)", node.node_id, reason)
        self._wake.set()

    def _cancel(self, node: Node, sequence: DrainSequence) -> None:
        del self.sequences[node.node_id]
        self._set_phase(node, None)
        # Its next beat is made before it hears of the cancel: a `draining` there is our echo.
        node.drain_echo_until = node.num_beats + 1
        self._record(sequence, "drain.cancel", {"phase": sequence.phase})
        logger.info("drain of node %s cancelled in phase %s", node.node_id, sequence.phase)
        self._wake.set()

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
            if not self._apply_effects():
                break

    def _advance(self, sequence: DrainSequence) -> None:
        node = self._fleet.nodes.get(sequence.node_id)
        if node is None:  # removed (DELETE /v1/nodes, its region deleted, or gone from Consul)
            del self.sequences[sequence.node_id]
            self._record(sequence, "drain.forget", {"phase": sequence.phase})
            return
        now = self._clock()
        while sequence.phase != DONE:
            record = sequence.steps[sequence.phase]
            note = self._checks[sequence.phase](sequence, node, now - record.started_at)
            if note is None:
                return
            record.completed_at, record.note = now, note
            took_s = round(now - record.started_at, 3)
            detail: audit.AuditDetail = {"step": sequence.phase, "note": note, "took_s": took_s}
            self._record(sequence, "drain.step", detail)
            logger.info("drain of node %s: %s done (%s)", node.node_id, sequence.phase, note)
            self._enter(sequence, node, PHASES[_INDEX[sequence.phase] + 1], now)

    def _enter(self, sequence: DrainSequence, node: Node, phase: str, now: float) -> None:
        sequence.phase = phase
        if phase != DONE:
            sequence.steps[phase] = StepRecord(started_at=now)
        self._set_phase(node, phase)
        self._dirty.add(node.node_id)

    def _set_phase(self, node: Node, phase: str | None) -> None:
        """The node's routing follows its phase: out of EDS from step 2, of summaries from 3."""
        node.drain_phase = phase
        is_out_of_eds = has_reached(phase, "envoy")
        is_out_of_summaries = has_reached(phase, "summaries")
        if node.is_out_of_eds != is_out_of_eds:
            node.is_out_of_eds = is_out_of_eds
            self._needs_xds_refresh = True
        if node.is_out_of_summaries != is_out_of_summaries:
            node.is_out_of_summaries = is_out_of_summaries
            self._needs_publish = True

    def _apply_effects(self) -> bool:
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

    # --- the steps' checks: a note when done, None while waiting ---

    def _is_silent(self, node: Node) -> bool:
        """The node has stopped beating (or has not beaten since a restart long enough ago)."""
        if not node.is_from_heartbeats:
            return True
        if node.last_seen_mono is None:
            return time.monotonic() - self._started_mono > self._times.unhealthy_after_s
        return not node.is_beating

    def _check_admissions(self, sequence: DrainSequence, node: Node, waited_s: float) -> str | None:
        if not node.is_from_heartbeats:
            return "known from Consul only: nothing to tell it"
        if node.reports_draining:
            return "the node reports draining"
        if self._is_silent(node):
            return "the node is not heartbeating"
        if waited_s >= self._times.unhealthy_after_s:
            return f"timed out after {waited_s:.1f} s: the node does not report draining"
        return None

    def _check_envoy(self, sequence: DrainSequence, node: Node, waited_s: float) -> str | None:
        if self._xds is None:
            return "no xDS server"
        region = node.identity.region
        lagging = self._xds.lagging(region, lacks_endpoint(node.identity.url))
        if not lagging:
            return f"out of EDS, ACKed by {self._xds.num_envoys_for(region)} Envoys"
        if waited_s >= self._times.envoy_ack_timeout_s:
            return f"timed out after {waited_s:.1f} s: not ACKed by {', '.join(sorted(lagging))}"
        return None

    def _check_summaries(self, sequence: DrainSequence, node: Node, waited_s: float) -> str | None:
        if self._needs_publish:
            return None  # published between passes of this tick
        return f"out of the region summaries (index {self._publisher.current.index})"

    def _check_dns(self, sequence: DrainSequence, node: Node, waited_s: float) -> str | None:
        ttl_s = self._times.dns_ttl_s
        if ttl_s is None:
            return "no DNS server"
        if waited_s >= ttl_s:
            return f"out of DNS answers; waited one TTL ({ttl_s:g} s)"
        return None

    def _check_consul(self, sequence: DrainSequence, node: Node, waited_s: float) -> str | None:
        if self.consul is None:
            return "no Consul"
        if node.consul is None:
            return "out of Consul" + (
                " (deregistered by us)" if sequence.is_consul_call_made else ""
            )
        is_on_its_own = node.is_from_heartbeats and not self._is_silent(node)
        if not sequence.is_consul_call_made and (
            not is_on_its_own or waited_s >= self._times.consul_timeout_s / 2
        ):
            sequence.is_consul_call_made = True
            self._spawn(self._deregister_from_consul(self.consul, node.node_id))
        if waited_s >= self._times.consul_timeout_s:
            return f"timed out after {waited_s:.1f} s: still in Consul"
        return None

    @staticmethod
    async def _deregister_from_consul(consul: ConsulSync, node_id: str) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CONSUL_CALL_TIMEOUT_S):
                await consul.deregister(node_id)

    def _check_in_flight(self, sequence: DrainSequence, node: Node, waited_s: float) -> str | None:
        if not node.is_from_heartbeats:
            return "known from Consul only: nothing to wait for"
        if self._is_silent(node):
            return "the node is not heartbeating"
        if node.last_beat is None:
            return None
        count = num_in_flight(node.last_beat)
        if count == 0:
            return "nothing in flight"
        if waited_s >= self._times.in_flight_timeout_s:
            return f"timed out after {waited_s:.1f} s with {count} in flight"
        return None

    def _check_exit(self, sequence: DrainSequence, node: Node, waited_s: float) -> str | None:
        return "the node has stopped" if self._is_silent(node) else None

    # --- persistence, regions, the loop ---

    def _record(self, sequence: DrainSequence, action: str, detail: audit.AuditDetail) -> None:
        self._dirty.add(sequence.node_id)
        self._entries.append((sequence.node_id, action, detail))

    async def flush(self) -> None:
        """Write every sequence that moved (its row, or its removal) and the audit entries."""
        if not self._dirty and not self._entries:
            return
        dirty, entries = self._dirty, self._entries
        self._dirty, self._entries = set(), []
        now = self._clock()
        rows = {node_id: self.sequences.get(node_id) for node_id in dirty}
        values = {node_id: s.row(now) if s is not None else None for node_id, s in rows.items()}

        def change(conn: sqlite3.Connection) -> None:
            for node_id, row in values.items():
                if row is None:
                    conn.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))
                else:
                    conn.execute(
                        "INSERT OR REPLACE INTO drains (node_id, region, reason, phase, "
                        "started_at, steps, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        row,
                    )
            for node_id, action, detail in entries:
                audit.record(conn, ACTOR, action, node_id, detail)

        try:
            await self._store.write(change)
        except BaseException:
            self._dirty |= dirty  # written again with the next flush
            self._entries[:0] = entries
            raise

    def drained_regions(self) -> list[str]:
        """Regions being deleted whose every node has been told to exit."""
        return [
            region.name
            for region in self._fleet.regions.values()
            if region.is_deleting
            and region.name not in self._finishing
            and all(has_reached(n.drain_phase, "exit") for n in self._fleet.nodes_in(region.name))
        ]

    async def _finish_regions(self) -> None:
        for name in self.drained_regions():
            self._finishing.add(name)
            try:
                await self._on_region_drained(name)
            finally:
                self._finishing.discard(name)

    def poke(self) -> None:
        """Tick now rather than at the next interval."""
        self._wake.set()

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def step(self) -> None:
        """One tick and its writes (the loop's body; tests call it directly)."""
        self.tick()
        await self.flush()
        await self._finish_regions()

    async def run(self, interval_s: float) -> None:
        """Until cancelled: a step every `interval_s`, or as soon as poked."""
        try:
            while True:
                # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation
                # that races with the event, and the lifespan would wait for this loop forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval_s):
                        await self._wake.wait()
                self._wake.clear()
                try:
                    await self.step()
                except Exception:
                    logger.exception("drain step failed")  # the next tick tries again
        finally:
            for task in list(self._tasks):
                task.cancel()

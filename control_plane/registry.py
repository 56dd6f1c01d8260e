"""The fleet registry: regions, nodes, drains — durable changes first, then memory, then watchers.

The registry is the one writer of fleet state: every change is one `FleetStore` transaction (with
its audit entry); only after it commits does the in-memory `Fleet` change and the region summaries
get published (which wakes watchers and Envoy). Changes are serialized by one lock so memory always
follows the store's commit order. Heartbeats from known nodes with an unchanged identity touch
memory only. Consul's view (with `--consul`) is memory only too: it is merged into the fleet as it
comes (see `control_plane.fleet`). Whatever may start or end a drain (a drain request, a region's
state, a node's own report) is noted in the `DrainBook`, which starts or cancels that node's drain
sequence (`control_plane.drain`); `step_drains` moves the sequences, writes what moved, makes the
Consul calls the steps asked for, and ends the deletes of regions whose nodes are drained.
A node's credential (`control_plane.node_credentials`) changes with its registration: the first
one binds a URL the credential left open, and an operator's move rebinds region and URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Final

from control_plane import audit
from control_plane.audit import Actor
from control_plane.consul_sync import ConsulSync
from control_plane.drain import ACTOR as DRAIN_ACTOR
from control_plane.drain import DrainSequence
from control_plane.drain_book import DrainBook
from control_plane.errors import ConflictError, NotFoundError
from control_plane.fleet import ConsulEntry, Fleet, Node, NodeIdentity, Region
from control_plane.fleet_store import (
    FleetStore,
    Registration,
    SavedBeats,
    load_drains,
    load_fleet,
    load_health,
)
from control_plane.leadership import Leadership, SoleLeader
from control_plane.node_credentials import CredentialRegistry
from control_plane.schemas import NodePatch, RegionCreate, RegionPatch
from control_plane.store import Connection
from control_plane.summaries import SummaryPublisher
from wire.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

CONSUL_CALL_TIMEOUT_S: Final = 5.0


@dataclass(slots=True)
class _Registration:
    actor: Actor
    identity: NodeIdentity
    done: asyncio.Future[Node]


def _settle(future: asyncio.Future[Node], like: asyncio.Future[Node]) -> None:
    """Give `future` the outcome of `like` (a done callback)."""
    if future.done():
        return
    if like.cancelled():
        future.cancel()
    elif (error := like.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(like.result())


class Registry:
    def __init__(
        self,
        store: FleetStore,
        fleet: Fleet,
        credentials: CredentialRegistry,
        publisher: SummaryPublisher,
        drains: DrainBook,
    ) -> None:
        self.fleet = fleet
        self.credentials = credentials
        self.drains = drains
        self.store = store
        self.consul: ConsulSync | None = None  # set by the lifespan with --consul
        self._publisher = publisher
        self._lock = asyncio.Lock()
        self._pending: dict[str, _Registration] = {}  # registrations waiting for the next write
        self._wake_drains = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.leadership: Leadership = SoleLeader()  # a LeaderLease between replicas
        # The beats this replica received since the last health save (other replicas read them).
        self._local_beats: dict[str, tuple[Heartbeat, float]] = {}

    def _on_change(self) -> None:
        """Something routing-relevant changed: publish now."""
        self._publisher.refresh()

    def _on_region_change(self, region: str) -> None:
        """... in one region only (a node registered or back to health): publish that region."""
        self._publisher.refresh_region(region)

    def _note_drain(self, node: Node) -> None:
        """A node's drain may start or end: the book decides, the drain loop writes it. Only the
        leader moves drains; the others follow the store (`follow`)."""
        if self.leadership.is_leader:
            self.drains.note(node)
            self._wake_drains.set()

    # --- regions ---

    def get_region(self, name: str) -> Region:
        region = self.fleet.regions.get(name)
        if region is None:
            raise NotFoundError(f"region {name!r} not found", "region_not_found")
        return region

    async def create_region(self, actor: Actor, body: RegionCreate) -> Region:
        now = time.time()
        region = Region(**body.model_dump(), created_at=now, updated_at=now)

        async with self._lock:
            await self.store.create_region(actor, region, body.model_dump())
            self.fleet.regions[region.name] = region
        self._on_change()
        return region

    async def update_region(self, actor: Actor, name: str, patch: RegionPatch) -> Region:
        fields = patch.model_dump(include=patch.model_fields_set)
        async with self._lock:
            old = self.get_region(name)
            region = dataclasses.replace(old, **fields, updated_at=time.time())
            # A pending delete ends when the operator sets the region to anything but draining.
            region = dataclasses.replace(
                region, is_deleting=old.is_deleting and region.state == "draining"
            )
            await self.store.update_region(actor, region, "region.update", fields)
            self.fleet.regions[name] = region
            self._note_region(name)
        self._on_change()
        return region

    def _note_region(self, name: str) -> None:
        for node in self.fleet.nodes_in(name):
            self._note_drain(node)

    async def delete_region(self, actor: Actor, name: str) -> Region | None:
        """Deregister a region: at once if no node is known in it (returns None); otherwise it is
        set draining and returned, its nodes go through the drain sequence, and `step_drains`
        calls `finish_region_delete` once every one of them has been told to exit. Idempotent."""
        async with self._lock:
            old = self.get_region(name)
            if old.is_deleting:
                return old
            if self.fleet.nodes_in(name):
                region = dataclasses.replace(
                    old, state="draining", is_deleting=True, updated_at=time.time()
                )
                detail: audit.AuditDetail = {"drain_first": True}
                await self.store.update_region(actor, region, "region.delete", detail)
                self.fleet.regions[name] = region
                self._note_region(name)
            else:
                await self.store.delete_region(actor, name, "region.delete")
                self.fleet.regions.pop(name, None)
                region = None
        self._on_change()
        return region

    async def finish_region_delete(self, actor: Actor, name: str) -> None:
        """The end of a region's DELETE: its nodes are drained; forget it and them."""
        async with self._lock:
            region = self.fleet.regions.get(name)
            if region is None or not region.is_deleting:
                return  # cancelled meanwhile
            node_ids = tuple(
                node.node_id for node in self.fleet.nodes_in(name) if node.is_from_heartbeats
            )
            await self.store.delete_region(actor, name, "region.deleted", node_ids)
            self.fleet.regions.pop(name, None)
            for node_id in node_ids:
                self.fleet.nodes.pop(node_id, None)
            self.fleet.membership_version += 1
            self.fleet.apply_consul(self.fleet.consul, time.time())
        self._on_change()

    # --- nodes ---

    def get_node(self, node_id: str) -> Node:
        node = self.fleet.nodes.get(node_id)
        if node is None:
            raise NotFoundError(f"node {node_id!r} not found", "node_not_found")
        return node

    async def record_heartbeat(self, actor: Actor, beat: Heartbeat) -> Node:
        identity = NodeIdentity.of(beat)
        node = self.fleet.nodes.get(beat.node_id)
        if node is None or node.identity != identity or not node.is_from_heartbeats:
            node = await self._register_node(actor, beat.node_id, identity)
        now_unix = time.time()
        self._apply_beat(node, beat, time.monotonic(), now_unix)
        self._local_beats[node.node_id] = (beat, now_unix)
        return node

    def _apply_beat(self, node: Node, beat: Heartbeat, seen_mono: float, seen_unix: float) -> None:
        was_routed = (node.is_routable, node.is_in_summaries)
        was_draining = node.reports_draining
        self.fleet.record_beat(node, beat, seen_mono, seen_unix)
        if node.reports_draining != was_draining or node.num_beats == 1:
            self._note_drain(node)  # it started or stopped draining on its own, or is back
        if (node.is_routable, node.is_in_summaries) != was_routed:
            self._on_region_change(beat.region)  # back to health
        else:
            self._publisher.mark_dirty(beat.region)  # only live capacity: at the next sweep

    async def _register_node(self, actor: Actor, node_id: str, identity: NodeIdentity) -> Node:
        """Register a node (or its new identity). Registrations that arrive while another is
        being written share the next transaction (group commit): a thousand nodes starting at
        once cost a few store writes, not a thousand one after another."""
        pending = self._pending.get(node_id)
        if pending is None or pending.identity != identity:
            # The latest identity wins; a beat that brought an older one gets the same node.
            done = asyncio.get_running_loop().create_future()
            if pending is not None:
                done.add_done_callback(functools.partial(_settle, pending.done))
            pending = _Registration(actor, identity, done)
            self._pending[node_id] = pending
        async with self._lock:
            if not pending.done.done():
                await self._register_pending()
        return await pending.done

    async def _register_pending(self) -> None:
        """Write every pending registration in one transaction, then apply them (under the lock)."""
        batch, self._pending = self._pending, {}
        batch = {
            node_id: reg
            for node_id, reg in batch.items()
            if not self._is_registered(node_id, reg.identity, reg)
        }
        now = time.time()
        registrations = [Registration(r.actor, n, r.identity) for n, r in batch.items()]
        try:
            await self.store.register_nodes(registrations, now)
        except BaseException as exc:
            for reg in batch.values():
                if not reg.done.done():
                    reg.done.set_exception(exc)
            raise
        regions: set[str] = set()
        for node_id, reg in batch.items():
            self.credentials.rebind(node_id, reg.identity.region, reg.identity.url)
            node = self.fleet.nodes.get(node_id)  # Consul may have listed it meanwhile
            regions.add(reg.identity.region)
            if node is None:
                node = Node(
                    node_id=node_id,
                    identity=reg.identity,
                    drain_requested=False,
                    registered_at=now,
                    consul=self.fleet.consul.get(node_id),
                )
                self.fleet.nodes[node_id] = node
            else:
                regions.add(node.identity.region)
                self.fleet.move(node, reg.identity)
                node.is_from_heartbeats = True
            reg.done.set_result(node)
        for region in sorted(regions):
            self._on_region_change(region)

    def _is_registered(self, node_id: str, identity: NodeIdentity, reg: _Registration) -> bool:
        """Already registered with this identity (by a concurrent beat): settle `reg` now."""
        node = self.fleet.nodes.get(node_id)
        if node is None or node.identity != identity or not node.is_from_heartbeats:
            return False
        if not reg.done.done():
            reg.done.set_result(node)
        return True

    def _refuse_consul_only(self, node_id: str, action: str) -> None:
        node = self.fleet.nodes.get(node_id)
        if node is not None and not node.is_from_heartbeats:
            raise ConflictError(
                f"node {node_id!r} is known only from Consul; {action} it there (deregister the "
                "service, or drain the node agent itself)",
                "node_in_consul",
            )

    async def set_drain(self, actor: Actor, node_id: str, drain: bool) -> Node:
        self._refuse_consul_only(node_id, "drain" if drain else "undrain")

        async with self._lock:
            await self.store.set_drain_requested(actor, node_id, drain, time.time())
            node = self.get_node(node_id)
            node.drain_requested = drain
            self._note_drain(node)
        self._on_change()
        return node

    async def update_node(self, actor: Actor, node_id: str, patch: NodePatch) -> Node:
        """An operator moves a node to another region or URL: its registration and credential
        change in one transaction, and routing follows at once (beats from the old place are
        refused from now on)."""
        self._refuse_consul_only(node_id, "move")
        node = self.get_node(node_id)
        old_region = node.identity.region
        identity = dataclasses.replace(
            node.identity, region=patch.region or old_region, url=patch.url or node.identity.url
        )

        async with self._lock:
            await self.store.move_node(actor, node_id, identity, time.time())
            self.credentials.rebind(node_id, identity.region, identity.url)
            self.fleet.move(node, identity)
            self._note_drain(node)
        self._on_region_change(old_region)
        self._on_region_change(identity.region)
        return node

    async def delete_node(self, actor: Actor, node_id: str) -> None:
        """Forget a node. If it is still running, its next heartbeat registers it again; if
        Consul lists it, it stays as a Consul-only node."""
        self._refuse_consul_only(node_id, "remove")

        async with self._lock:
            await self.store.delete_node(actor, node_id)
            self.fleet.nodes.pop(node_id, None)
            self.fleet.membership_version += 1
            self.fleet.apply_consul(self.fleet.consul, time.time())
        self._on_change()

    # --- Consul ---

    def apply_consul(self, entries: dict[str, ConsulEntry]) -> None:
        """Merge Consul's latest view (memory only; nothing to persist or audit)."""
        if self.fleet.apply_consul(entries, time.time()):
            for node in self.fleet.nodes.values():
                if node.drain_phase is None and not node.is_from_heartbeats:
                    self._note_drain(node)  # a Consul-only node in a draining region
            self._on_change()

    # --- drains ---

    async def step_drains(self) -> None:
        """On the leader: move every drain sequence, write what moved, make the Consul calls the
        steps asked for, and end the deletes of regions whose nodes have all been told to exit."""
        epoch = self.leadership.epoch
        if not self.leadership.is_leader:
            return
        self.drains.tick()
        writes = self.drains.take_writes()
        if writes:
            try:
                await self.store.write_drains(writes.rows, writes.entries, time.time(), epoch)
            except BaseException:
                self.drains.put_back(writes)  # written again with the next step
                raise
        for node_id in self.drains.take_consul_calls():
            if self.consul is not None:
                self._spawn(_deregister_from_consul(self.consul, node_id))
        for name in self.drains.drained_regions():
            await self.finish_region_delete(DRAIN_ACTOR, name)

    def poke_drains(self) -> None:
        """Step the drains now rather than at the next interval."""
        self._wake_drains.set()

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run_drains(self, interval_s: float) -> None:
        """Until cancelled: a drain step every `interval_s`, or as soon as one is noted."""
        try:
            while True:
                # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation
                # that races with the event, and the lifespan would wait for this loop forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval_s):
                        await self._wake_drains.wait()
                self._wake_drains.clear()
                try:
                    await self.step_drains()
                except Exception:
                    logger.exception("drain step failed")  # the next step tries again
        finally:
            for task in list(self._tasks):
                task.cancel()

    # --- replicas ---

    async def take_lead(self) -> None:
        """Just elected: resume every drain where the store says it stood, then lead."""
        sequences = await self.store.store.read(load_drains)
        async with self._lock:
            self.drains.adopt(sequences)
            for node in self.fleet.nodes.values():
                self.drains.note(node)
        self._wake_drains.set()

    def take_local_beats(self) -> SavedBeats:
        """The beats received here since the last call, for the health save."""
        beats, self._local_beats = self._local_beats, {}
        return [(node_id, beat, seen_at) for node_id, (beat, seen_at) in beats.items()]

    async def follow(self, kinds: set[str], beats_since: float) -> None:
        """Another replica changed `kinds` of fleet state: memory follows the store. For
        "beats", the rows saved from `beats_since` on (Unix seconds) are read; the summaries are
        published at once, not at the next tick, since the beats have already waited for the
        other replica's save."""
        unhealthy_after_s = self.fleet.unhealthy_after_s

        def read(conn: Connection) -> tuple[Fleet | None, list[DrainSequence] | None, SavedBeats]:
            fresh = load_fleet(conn, unhealthy_after_s) if kinds & {"regions", "nodes"} else None
            drains = load_drains(conn) if "drains" in kinds else None
            beats = load_health(conn, beats_since) if "beats" in kinds else []
            return fresh, drains, beats

        async with self._lock:
            fresh, drains, beats = await self.store.store.read(read)
            if fresh is not None:
                self._merge(fresh)
            if drains is not None and not self.leadership.is_leader:
                self.drains.adopt(drains)
            now_mono, now_unix = time.monotonic(), time.time()
            for node_id, beat, seen_at in beats:
                node = self.fleet.nodes.get(node_id)
                is_newer = node is not None and (node.last_seen_unix or 0.0) < seen_at
                if node is not None and node.is_from_heartbeats and is_newer:
                    seen_mono = now_mono - max(0.0, now_unix - seen_at)
                    self._apply_beat(node, beat, seen_mono, seen_at)
        if fresh is not None or drains is not None or beats:
            self._on_change()

    def _merge(self, fresh: Fleet) -> None:
        """Regions and registrations as the store has them; live state (beats) is kept."""
        self.fleet.regions.clear()
        self.fleet.regions.update(fresh.regions)
        for node_id, stored in fresh.nodes.items():
            node = self.fleet.nodes.get(node_id)
            if node is None:
                stored.consul = self.fleet.consul.get(node_id)
                self.fleet.nodes[node_id] = stored
                continue
            if node.identity != stored.identity:
                self.fleet.move(node, stored.identity)
            node.drain_requested = stored.drain_requested
            node.is_from_heartbeats = True
        gone = [n for n, node in self.fleet.nodes.items() if node.is_from_heartbeats]
        gone = [n for n in gone if n not in fresh.nodes]
        for node_id in gone:
            self.fleet.nodes.pop(node_id)
        if gone:
            self.fleet.membership_version += 1
            self.fleet.apply_consul(self.fleet.consul, time.time())
        for node in self.fleet.nodes.values():
            self._note_drain(node)


async def _deregister_from_consul(consul: ConsulSync, node_id: str) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CONSUL_CALL_TIMEOUT_S):
            await consul.deregister(node_id)

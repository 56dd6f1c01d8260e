"""The fleet registry: regions, nodes, drains — durable changes first, then memory, then watchers.

The registry is the one writer of fleet state: every change is one `FleetStore` transaction (with
its audit entry); only after it commits does the in-memory `Fleet` change and the region summaries
get published (which wakes watchers and Envoy). Changes are serialized by one lock so memory always
follows the store's commit order. Heartbeats from known nodes with an unchanged identity touch
memory only. Consul's view (with `--consul`) is memory only too: it is merged into the fleet as it
comes (see `control_plane.model`). Whatever may start or end a drain (a drain request, a region's
state, a node's own report) is noted in the `DrainBook`, which starts or cancels that node's drain
sequence (`control_plane.drain.sequence`); `DrainLoop` (`control_plane.fleet.drain_loop`) moves
the sequences and writes what moved. A node's credential (`control_plane.fleet.credentials`)
changes with its registration: the first one binds a URL the credential left open, and an
operator's move rebinds region and URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from typing import TypeVar

from control_plane import audit
from control_plane.audit import Actor
from control_plane.drain.book import DrainBook
from control_plane.drain.sequence import DrainSequence
from control_plane.errors import ConflictError, NotFoundError
from control_plane.fleet.credentials import CredentialRegistry
from control_plane.fleet.pending import PendingRegistration, settle
from control_plane.fleet.sql import (
    FleetStore,
    Registration,
)
from control_plane.leadership import Leadership
from control_plane.model import ConsulEntry, Fleet, Node, NodeIdentity, Region
from control_plane.schemas import NodePatch, RegionCreate, RegionPatch
from control_plane.store.base import StoreBusyError
from control_plane.summaries import SummaryPublisher
from wire.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _found(known: Mapping[str, T], name: str, kind: str) -> T:
    """`known[name]`, or the 404 for a `kind` ("region", "node") not found."""
    found = known.get(name)
    if found is None:
        raise NotFoundError(f"{kind} {name!r} not found", f"{kind}_not_found")
    return found


class Registry:
    def __init__(
        self,
        store: FleetStore,
        fleet: Fleet,
        credentials: CredentialRegistry,
        publisher: SummaryPublisher,
        drains: DrainBook,
        leadership: Leadership,
        drains_noted: asyncio.Event,
    ) -> None:
        """`drains_noted` is set whenever a drain may have started or ended (the drain loop
        waits on it)."""
        self._fleet = fleet
        self._store = store
        self._credentials = credentials
        self._drains = drains
        self._leadership = leadership
        self._drains_noted = drains_noted
        self._publisher = publisher
        self._lock = asyncio.Lock()
        # Registrations waiting for the next write (group commit).
        self._pending: dict[str, PendingRegistration] = {}
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
        if self._leadership.is_leader:
            self._drains.note(node)
            self._drains_noted.set()

    # --- regions ---

    def get_region(self, name: str) -> Region:
        return _found(self._fleet.regions, name, "region")

    async def create_region(self, actor: Actor, body: RegionCreate) -> Region:
        now = time.time()
        region = Region(**body.model_dump(), created_at=now, updated_at=now)

        async with self._lock:
            await self._store.create_region(actor, region, body.model_dump())
            self._fleet.regions[region.name] = region
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
            await self._store.update_region(actor, region, "region.update", fields)
            self._fleet.regions[name] = region
            self._note_region(name)
        self._on_change()
        return region

    def _note_region(self, name: str) -> None:
        for node in self._fleet.nodes_in(name):
            self._note_drain(node)

    async def delete_region(self, actor: Actor, name: str) -> Region | None:
        """Deregister a region: at once if no node is known in it (returns None); otherwise it is
        set draining and returned, its nodes go through the drain sequence, and `step_drains`
        calls `finish_region_delete` once every one of them has been told to exit. Idempotent."""
        async with self._lock:
            old = self.get_region(name)
            if old.is_deleting:
                return old
            if self._fleet.nodes_in(name):
                region = dataclasses.replace(
                    old, state="draining", is_deleting=True, updated_at=time.time()
                )
                detail: audit.AuditDetail = {"drain_first": True}
                await self._store.update_region(actor, region, "region.delete", detail)
                self._fleet.regions[name] = region
                self._note_region(name)
            else:
                await self._store.delete_region(actor, name, "region.delete")
                self._fleet.regions.pop(name, None)
                region = None
        self._on_change()
        return region

    async def finish_region_delete(self, actor: Actor, name: str) -> None:
        """The end of a region's DELETE: its nodes are drained; forget it and them."""
        async with self._lock:
            region = self._fleet.regions.get(name)
            if region is None or not region.is_deleting:
                return  # cancelled meanwhile
            node_ids = tuple(
                node.node_id for node in self._fleet.nodes_in(name) if node.is_from_heartbeats
            )
            await self._store.delete_region(actor, name, "region.deleted", node_ids)
            self._fleet.regions.pop(name, None)
            self._fleet.forget(node_ids, time.time())
        self._on_change()

    # --- nodes ---

    def get_node(self, node_id: str) -> Node:
        return _found(self._fleet.nodes, node_id, "node")

    async def record_heartbeat(self, actor: Actor, beat: Heartbeat) -> Node:
        identity = NodeIdentity.of(beat)
        node = self._fleet.nodes.get(beat.node_id)
        if node is None or node.identity != identity or not node.is_from_heartbeats:
            node = await self._register_node(actor, beat.node_id, identity)
        now_unix = time.time()
        self._apply_beat(node, beat, time.monotonic(), now_unix)
        self._local_beats[node.node_id] = (beat, now_unix)
        return node

    def _apply_beat(self, node: Node, beat: Heartbeat, seen_mono: float, seen_unix: float) -> None:
        was_routed = (node.is_routable, node.is_in_summaries)
        was_draining = node.reports_draining
        self._fleet.record_beat(node, beat, seen_mono, seen_unix)
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
                done.add_done_callback(functools.partial(settle, pending.done))
            pending = PendingRegistration(actor, identity, done)
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
            await self._store.register_nodes(registrations, now)
        except BaseException as exc:
            for reg in batch.values():
                if not reg.done.done():
                    reg.done.set_exception(exc)
            raise
        regions: set[str] = set()
        for node_id, reg in batch.items():
            self._credentials.rebind(node_id, reg.identity.region, reg.identity.url)
            node = self._fleet.nodes.get(node_id)  # Consul may have listed it meanwhile
            regions.add(reg.identity.region)
            if node is None:
                node = Node(
                    node_id=node_id,
                    identity=reg.identity,
                    drain_requested=False,
                    registered_at=now,
                    consul=self._fleet.consul.get(node_id),
                )
                self._fleet.nodes[node_id] = node
            else:
                regions.add(node.identity.region)
                self._fleet.move(node, reg.identity)
                node.is_from_heartbeats = True
            reg.done.set_result(node)
        for region in sorted(regions):
            self._on_region_change(region)

    def _is_registered(
        self, node_id: str, identity: NodeIdentity, reg: PendingRegistration
    ) -> bool:
        """Already registered with this identity (by a concurrent beat): settle `reg` now."""
        node = self._fleet.nodes.get(node_id)
        if node is None or node.identity != identity or not node.is_from_heartbeats:
            return False
        if not reg.done.done():
            reg.done.set_result(node)
        return True

    def _refuse_consul_only(self, node_id: str, action: str) -> None:
        node = self._fleet.nodes.get(node_id)
        if node is not None and not node.is_from_heartbeats:
            raise ConflictError(
                f"node {node_id!r} is known only from Consul; {action} it there (deregister the "
                "service, or drain the node agent itself)",
                "node_in_consul",
            )

    async def set_drain(self, actor: Actor, node_id: str, drain: bool) -> Node:
        self._refuse_consul_only(node_id, "drain" if drain else "undrain")

        async with self._lock:
            await self._store.set_drain_requested(actor, node_id, drain, time.time())
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
            await self._store.move_node(actor, node_id, identity, time.time())
            self._credentials.rebind(node_id, identity.region, identity.url)
            self._fleet.move(node, identity)
            self._note_drain(node)
        self._on_region_change(old_region)
        self._on_region_change(identity.region)
        return node

    async def delete_node(self, actor: Actor, node_id: str) -> None:
        """Forget a node. If it is still running, its next heartbeat registers it again; if
        Consul lists it, it stays as a Consul-only node."""
        self._refuse_consul_only(node_id, "remove")

        async with self._lock:
            await self._store.delete_node(actor, node_id)
            self._fleet.forget([node_id], time.time())
        self._on_change()

    # --- Consul ---

    def apply_consul(self, entries: dict[str, ConsulEntry]) -> None:
        """Merge Consul's latest view (memory only; nothing to persist or audit)."""
        if self._fleet.apply_consul(entries, time.time()):
            for node in self._fleet.nodes.values():
                if node.drain_phase is None and not node.is_from_heartbeats:
                    self._note_drain(node)  # a Consul-only node in a draining region
            self._on_change()

    # --- drains and replicas ---

    async def adopt_drains(self, sequences: list[DrainSequence]) -> None:
        """Just elected: every drain resumes where the store says it stood."""
        async with self._lock:
            self._drains.adopt(sequences)
            for node in self._fleet.nodes.values():
                self._drains.note(node)

    async def save_health(self) -> None:
        """Write the beats received here since the last save (see `health_snapshot`)."""
        beats, self._local_beats = self._local_beats, {}
        if not beats:
            return
        saved = [(node_id, beat, seen_at) for node_id, (beat, seen_at) in beats.items()]
        try:
            await self._store.save_health(saved)
        except StoreBusyError:
            logger.warning("could not save the fleet's health: the database is busy")

    async def follow(self, kinds: set[str], beats_since: float) -> None:
        """Another replica changed `kinds` of fleet state: memory follows the store. For
        "beats", the rows saved from `beats_since` on (Unix seconds) are read; the summaries are
        published at once, not at the next tick, since the beats have already waited for the
        other replica's save."""
        async with self._lock:
            read = self._store.read_changed(kinds, beats_since, self._fleet.unhealthy_after_s)
            fresh, drains, beats = await read
            if fresh is not None:
                self._fleet.merge(fresh, time.time())
                for known in self._fleet.nodes.values():
                    self._note_drain(known)
            if drains is not None and not self._leadership.is_leader:
                self._drains.adopt(drains)
            now_mono, now_unix = time.monotonic(), time.time()
            for node_id, beat, seen_at in beats:
                node = self._fleet.nodes.get(node_id)
                is_newer = node is not None and (node.last_seen_unix or 0.0) < seen_at
                if node is not None and node.is_from_heartbeats and is_newer:
                    seen_mono = now_mono - max(0.0, now_unix - seen_at)
                    self._apply_beat(node, beat, seen_mono, seen_at)
        if fresh is not None or drains is not None or beats:
            self._on_change()

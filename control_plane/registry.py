"""The fleet registry: regions and nodes — durable changes first, then memory, then watchers.

Each change is one store transaction (with its audit entry); only after it commits does the
in-memory `Fleet` change and `on_change` run (which recomputes the region summaries and wakes
watchers). Changes are serialized by one lock so memory always follows the store's commit order.
Heartbeats from known nodes with an unchanged identity touch memory only. Consul's view (with
`--consul`) is memory only too: it is merged into the fleet as it comes (see `control_plane.fleet`).
Whatever may start or end a drain (a drain request, a region's state, a node's own report) is passed
to `note_drain`, which starts or cancels that node's drain sequence (`control_plane.drain`).
A node's credential (`control_plane.node_credentials`) changes with its registration: the first
one binds a URL the credential left open, and an operator's move rebinds region and URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

from control_plane import audit
from control_plane.audit import Actor
from control_plane.errors import ConflictError, NotFoundError
from control_plane.fleet import ConsulEntry, Fleet, Node, NodeIdentity, Region
from control_plane.node_credentials import CredentialRegistry, write_binding
from control_plane.schemas import NodePatch, RegionCreate, RegionPatch
from control_plane.store import Store
from wire.heartbeat import Heartbeat


def _region_of(row: sqlite3.Row) -> Region:
    return Region(
        name=row["name"],
        lat=row["lat"],
        lon=row["lon"],
        ingress_url=row["ingress_url"],
        weight=row["weight"],
        state=row["state"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        is_deleting=bool(row["is_deleting"]),
    )


def _node_of(row: sqlite3.Row) -> Node:
    identity = NodeIdentity(
        region=row["region"], url=row["url"], model=row["model"], tp_size=row["tp_size"]
    )
    return Node(
        node_id=row["node_id"],
        identity=identity,
        drain_requested=bool(row["drain_requested"]),
        registered_at=row["registered_at"],
    )


def load_fleet(conn: sqlite3.Connection, unhealthy_after_s: float) -> Fleet:
    fleet = Fleet(unhealthy_after_s=unhealthy_after_s)
    for row in conn.execute("SELECT * FROM regions"):
        fleet.regions[row["name"]] = _region_of(row)
    for row in conn.execute("SELECT * FROM nodes"):
        fleet.nodes[row["node_id"]] = _node_of(row)
    return fleet


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


def _write_registration(
    conn: sqlite3.Connection, actor: Actor, node_id: str, identity: NodeIdentity, now: float
) -> None:
    existed = conn.execute("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
    conn.execute(
        "INSERT INTO nodes (node_id, region, url, model, tp_size, drain_requested, "
        "registered_at, updated_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?) "
        "ON CONFLICT (node_id) DO UPDATE SET region = excluded.region, "
        "url = excluded.url, model = excluded.model, tp_size = excluded.tp_size, "
        "updated_at = excluded.updated_at",
        (node_id, identity.region, identity.url, identity.model, identity.tp_size, now, now),
    )
    detail: audit.AuditDetail = {
        "region": identity.region,
        "url": identity.url,
        "model": identity.model,
        "tp_size": identity.tp_size,
    }
    audit.record(conn, actor, "node.update" if existed else "node.register", node_id, detail)


class Registry:
    def __init__(
        self,
        store: Store,
        fleet: Fleet,
        credentials: CredentialRegistry,
        on_change: Callable[[], None],
        on_capacity: Callable[[], None],
        note_drain: Callable[[Node], None] = lambda node: None,
        on_region_change: Callable[[str], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.credentials = credentials
        self._store = store
        self._on_change = on_change  # something routing-relevant changed: publish now
        # ... in one region only (a node registered or back to health): publish that region now
        self._on_region_change = on_region_change or (lambda region: on_change())
        self._on_capacity = on_capacity  # only live capacity changed: publish at the next sweep
        self._note_drain = note_drain  # a node's drain may start or end (control_plane.drain)
        self._lock = asyncio.Lock()
        self._pending: dict[str, _Registration] = {}  # registrations waiting for the next write

    # --- regions ---

    def get_region(self, name: str) -> Region:
        region = self.fleet.regions.get(name)
        if region is None:
            raise NotFoundError(f"region {name!r} not found", "region_not_found")
        return region

    async def create_region(self, actor: Actor, body: RegionCreate) -> Region:
        now = time.time()
        region = Region(**body.model_dump(), created_at=now, updated_at=now)

        def change(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO regions (name, lat, lon, ingress_url, weight, state, "
                    "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        region.name,
                        region.lat,
                        region.lon,
                        region.ingress_url,
                        region.weight,
                        region.state,
                        now,
                        now,
                    ),
                )
            except sqlite3.IntegrityError as exc:
                raise ConflictError(f"region {region.name!r} exists", "region_exists") from exc
            audit.record(conn, actor, "region.create", region.name, body.model_dump())

        async with self._lock:
            await self._store.write(change)
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
            await self._store.write(self._region_update(actor, region, "region.update", fields))
            self.fleet.regions[name] = region
            self._note_region(name)
        self._on_change()
        return region

    @staticmethod
    def _region_update(
        actor: Actor, region: Region, action: str, detail: audit.AuditDetail
    ) -> Callable[[sqlite3.Connection], None]:
        def change(conn: sqlite3.Connection) -> None:
            cursor = conn.execute(
                "UPDATE regions SET lat = ?, lon = ?, ingress_url = ?, weight = ?, state = ?, "
                "is_deleting = ?, updated_at = ? WHERE name = ?",
                (
                    region.lat,
                    region.lon,
                    region.ingress_url,
                    region.weight,
                    region.state,
                    int(region.is_deleting),
                    region.updated_at,
                    region.name,
                ),
            )
            if cursor.rowcount != 1:
                raise NotFoundError(f"region {region.name!r} not found", "region_not_found")
            audit.record(conn, actor, action, region.name, detail)

        return change

    def _note_region(self, name: str) -> None:
        for node in self.fleet.nodes_in(name):
            self._note_drain(node)

    async def delete_region(self, actor: Actor, name: str) -> Region | None:
        """Deregister a region: at once if no node is known in it (returns None); otherwise it is
        set draining and returned, its nodes go through the drain sequence, and the drain sequence
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
                await self._store.write(self._region_update(actor, region, "region.delete", detail))
                self.fleet.regions[name] = region
                self._note_region(name)
            else:
                await self._store.write(self._region_delete(actor, name, "region.delete"))
                self.fleet.regions.pop(name, None)
                region = None
        self._on_change()
        return region

    @staticmethod
    def _region_delete(
        actor: Actor, name: str, action: str, node_ids: tuple[str, ...] = ()
    ) -> Callable[[sqlite3.Connection], None]:
        def change(conn: sqlite3.Connection) -> None:
            if conn.execute("DELETE FROM regions WHERE name = ?", (name,)).rowcount != 1:
                raise NotFoundError(f"region {name!r} not found", "region_not_found")
            for node_id in node_ids:
                conn.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
                conn.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))
            detail: audit.AuditDetail = {"num_nodes_removed": len(node_ids)} if node_ids else {}
            audit.record(conn, actor, action, name, detail)

        return change

    async def finish_region_delete(self, actor: Actor, name: str) -> None:
        """The end of a region's DELETE: its nodes are drained; forget it and them."""
        async with self._lock:
            region = self.fleet.regions.get(name)
            if region is None or not region.is_deleting:
                return  # cancelled meanwhile
            node_ids = tuple(
                node.node_id for node in self.fleet.nodes_in(name) if node.is_from_heartbeats
            )
            await self._store.write(self._region_delete(actor, name, "region.deleted", node_ids))
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
        was_routed = (node.is_routable, node.is_in_summaries)
        was_draining = node.reports_draining
        self.fleet.record_beat(node, beat, time.monotonic(), time.time())
        if node.reports_draining != was_draining or node.num_beats == 1:
            self._note_drain(node)  # it started or stopped draining on its own, or is back
        if (node.is_routable, node.is_in_summaries) != was_routed:
            self._on_region_change(beat.region)  # back to health
        else:
            self._on_capacity()
        return node

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

        def change(conn: sqlite3.Connection) -> None:
            for node_id, reg in batch.items():
                _write_registration(conn, reg.actor, node_id, reg.identity, now)
                # The beat matched its credential: this binds a URL that was left open.
                write_binding(conn, node_id, reg.identity.region, reg.identity.url)

        try:
            await self._store.write(change)
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

        def change(conn: sqlite3.Connection) -> None:
            cursor = conn.execute(
                "UPDATE nodes SET drain_requested = ?, updated_at = ? WHERE node_id = ?",
                (int(drain), time.time(), node_id),
            )
            if cursor.rowcount != 1:
                raise NotFoundError(f"node {node_id!r} not found", "node_not_found")
            audit.record(conn, actor, "node.drain" if drain else "node.undrain", node_id, {})

        async with self._lock:
            await self._store.write(change)
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

        def change(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE nodes SET region = ?, url = ?, updated_at = ? WHERE node_id = ?",
                (identity.region, identity.url, time.time(), node_id),
            )
            write_binding(conn, node_id, identity.region, identity.url)
            detail: audit.AuditDetail = {"region": identity.region, "url": identity.url}
            audit.record(conn, actor, "node.move", node_id, detail)

        async with self._lock:
            await self._store.write(change)
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

        def change(conn: sqlite3.Connection) -> None:
            if conn.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,)).rowcount != 1:
                raise NotFoundError(f"node {node_id!r} not found", "node_not_found")
            conn.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))
            audit.record(conn, actor, "node.delete", node_id, {})

        async with self._lock:
            await self._store.write(change)
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

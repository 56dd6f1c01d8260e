"""The fleet registry: regions and nodes — durable changes first, then memory, then watchers.

Each change is one store transaction (with its audit entry); only after it commits does the
in-memory `Fleet` change and `on_change` run (which recomputes the region summaries and wakes
watchers). Changes are serialized by one lock so memory always follows the store's commit order.
Heartbeats from known nodes with an unchanged identity touch memory only. Consul's view (with
`--consul`) is memory only too: it is merged into the fleet as it comes (see `control_plane.fleet`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from collections.abc import Callable

from control_plane import audit
from control_plane.audit import Actor
from control_plane.errors import ConflictError, NotFoundError
from control_plane.fleet import ConsulEntry, Fleet, Node, NodeIdentity, Region
from control_plane.schemas import RegionCreate, RegionPatch
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


class Registry:
    def __init__(
        self,
        store: Store,
        fleet: Fleet,
        on_change: Callable[[], None],
        on_capacity: Callable[[], None],
    ) -> None:
        self.fleet = fleet
        self._store = store
        self._on_change = on_change  # something routing-relevant changed: publish now
        self._on_capacity = on_capacity  # only live capacity changed: publish at the next sweep
        self._lock = asyncio.Lock()

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

            def change(conn: sqlite3.Connection) -> None:
                cursor = conn.execute(
                    "UPDATE regions SET lat = ?, lon = ?, ingress_url = ?, weight = ?, state = ?, "
                    "updated_at = ? WHERE name = ?",
                    (
                        region.lat,
                        region.lon,
                        region.ingress_url,
                        region.weight,
                        region.state,
                        region.updated_at,
                        name,
                    ),
                )
                if cursor.rowcount != 1:
                    raise NotFoundError(f"region {name!r} not found", "region_not_found")
                audit.record(conn, actor, "region.update", name, fields)

            await self._store.write(change)
            self.fleet.regions[name] = region
        self._on_change()
        return region

    async def delete_region(self, actor: Actor, name: str) -> None:
        """Deregister a region; its nodes stay known but take no traffic until it returns."""

        def change(conn: sqlite3.Connection) -> None:
            if conn.execute("DELETE FROM regions WHERE name = ?", (name,)).rowcount != 1:
                raise NotFoundError(f"region {name!r} not found", "region_not_found")
            audit.record(conn, actor, "region.delete", name, {})

        async with self._lock:
            await self._store.write(change)
            self.fleet.regions.pop(name, None)
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
        was_routable = node.is_routable
        self.fleet.record_beat(node, beat, time.monotonic(), time.time())
        if node.is_routable != was_routable:
            self._on_change()  # back to health, or started / stopped draining on its own
        else:
            self._on_capacity()
        return node

    async def _register_node(self, actor: Actor, node_id: str, identity: NodeIdentity) -> Node:
        now = time.time()
        detail: audit.AuditDetail = {
            "region": identity.region,
            "url": identity.url,
            "model": identity.model,
            "tp_size": identity.tp_size,
        }

        def change(conn: sqlite3.Connection) -> None:
            existed = conn.execute("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            conn.execute(
                "INSERT INTO nodes (node_id, region, url, model, tp_size, drain_requested, "
                "registered_at, updated_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?) "
                "ON CONFLICT (node_id) DO UPDATE SET region = excluded.region, "
                "url = excluded.url, model = excluded.model, tp_size = excluded.tp_size, "
                "updated_at = excluded.updated_at",
                (
                    node_id,
                    identity.region,
                    identity.url,
                    identity.model,
                    identity.tp_size,
                    now,
                    now,
                ),
            )
            action = "node.update" if existed else "node.register"
            audit.record(conn, actor, action, node_id, detail)

        async with self._lock:
            node = self.fleet.nodes.get(node_id)
            if node is not None and node.identity == identity and node.is_from_heartbeats:
                return node  # registered by a concurrent beat
            await self._store.write(change)
            node = self.fleet.nodes.get(node_id)  # Consul may have listed it meanwhile
            if node is None:
                node = Node(
                    node_id=node_id,
                    identity=identity,
                    drain_requested=False,
                    registered_at=now,
                    consul=self.fleet.consul.get(node_id),
                )
                self.fleet.nodes[node_id] = node
            else:
                node.identity = identity
                node.is_from_heartbeats = True
        self._on_change()
        return node

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
        self._on_change()
        return node

    async def delete_node(self, actor: Actor, node_id: str) -> None:
        """Forget a node. If it is still running, its next heartbeat registers it again; if
        Consul lists it, it stays as a Consul-only node."""
        self._refuse_consul_only(node_id, "remove")

        def change(conn: sqlite3.Connection) -> None:
            if conn.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,)).rowcount != 1:
                raise NotFoundError(f"node {node_id!r} not found", "node_not_found")
            audit.record(conn, actor, "node.delete", node_id, {})

        async with self._lock:
            await self._store.write(change)
            self.fleet.nodes.pop(node_id, None)
            self.fleet.apply_consul(self.fleet.consul, time.time())
        self._on_change()

    # --- Consul ---

    def apply_consul(self, entries: dict[str, ConsulEntry]) -> None:
        """Merge Consul's latest view (memory only; nothing to persist or audit)."""
        if self.fleet.apply_consul(entries, time.time()):
            self._on_change()

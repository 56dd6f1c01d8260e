"""Every SQL statement on fleet state: regions, nodes, drain sequences and the nodes' last health.

The registry (`control_plane.fleet.registry`) and its drain loop are the only callers of the writes;
each is one transaction with its audit entry. The SQL is what SQLite and PostgreSQL both accept
(`control_plane.store`), so the one `FleetStore` serves either backend.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

from control_plane import audit
from control_plane.audit import OLD_KEY, Actor, changed_from
from control_plane.drain.sequence import ACTOR as DRAIN_ACTOR
from control_plane.drain.sequence import DrainSequence, StepRecord
from control_plane.errors import ConflictError, NotFoundError
from control_plane.fleet.credentials import write_binding
from control_plane.model import Fleet, Node, NodeIdentity, Region, is_known_phase
from control_plane.store.base import Connection, Row, Store, naming, of_row
from wire.heartbeat import Heartbeat


@dataclass(frozen=True, slots=True)
class Registration:
    actor: Actor
    node_id: str
    identity: NodeIdentity


SavedBeats = list[tuple[str, Heartbeat, float]]  # node id, its latest beat, when it arrived


def _region_of(row: Row) -> Region:
    return of_row(Region, row, is_deleting=bool(row["is_deleting"]))


def _node_of(row: Row) -> Node:
    identity = of_row(NodeIdentity, row)
    return Node(
        node_id=row["node_id"],
        identity=identity,
        drain_requested=bool(row["drain_requested"]),
        registered_at=row["registered_at"],
    )


def _drain_of(row: Row) -> DrainSequence:
    steps = {
        name: StepRecord(started_at=started, completed_at=completed, note=note)
        for name, (started, completed, note) in json.loads(row["steps"]).items()
    }
    return DrainSequence(
        node_id=row["node_id"],
        region=row["region"],
        reason=row["reason"],
        started_at=row["started_at"],
        phase=row["phase"],
        steps=steps,
    )


def _drain_row(sequence: DrainSequence, now: float) -> tuple[object, ...]:
    steps = {
        name: [record.started_at, record.completed_at, record.note]
        for name, record in sequence.steps.items()
    }
    return (
        sequence.node_id,
        sequence.region,
        sequence.reason,
        sequence.phase,
        sequence.started_at,
        json.dumps(steps),
        now,
    )


def load_fleet(conn: Connection, unhealthy_after_s: float) -> Fleet:
    fleet = Fleet(unhealthy_after_s=unhealthy_after_s)
    for row in conn.execute("SELECT * FROM regions"):
        fleet.regions[row["name"]] = _region_of(row)
    for row in conn.execute("SELECT * FROM nodes"):
        fleet.nodes[row["node_id"]] = _node_of(row)
    return fleet


def load_drains(conn: Connection) -> list[DrainSequence]:
    rows = conn.execute("SELECT * FROM drains ORDER BY started_at").fetchall()
    return [_drain_of(row) for row in rows if is_known_phase(row["phase"])]


class NotLeaderError(Exception):
    """A write only the leader may make came from a replica whose lease has moved on."""


def check_epoch(conn: Connection, epoch: int | None) -> None:
    """Inside a leader's write (`control_plane.leader`): refuse it if the lease has been taken
    over since `epoch`. The row is read FOR SHARE, so a takeover waits for this transaction to
    end: it commits before the takeover, or not at all."""
    if epoch is None:
        return
    row = conn.execute("SELECT epoch FROM leader_lease WHERE one = 1 FOR SHARE").fetchone()
    if row is None or int(row["epoch"]) != epoch:
        raise NotLeaderError(f"the lease moved on from epoch {epoch}")


def load_health(conn: Connection, seen_since: float = 0.0) -> SavedBeats:
    """The beats saved by every replica (those that arrived at `seen_since` or later)."""
    rows = conn.execute(
        "SELECT node_id, beat, seen_at FROM node_health WHERE seen_at >= ?", (seen_since,)
    ).fetchall()
    return [(r["node_id"], Heartbeat.model_validate_json(r["beat"]), r["seen_at"]) for r in rows]


def _region_values(region: Region) -> audit.AuditDetail:
    """What an operator sets on a region (its name and timestamps aside), as audit entries show
    it."""
    values = dataclasses.asdict(region)
    return {k: v for k, v in values.items() if k not in ("name", "created_at", "updated_at")}


def _identity_values(identity: NodeIdentity) -> audit.AuditDetail:
    return dataclasses.asdict(identity)


def _stored_region(conn: Connection, name: str) -> Region:
    row = conn.execute("SELECT * FROM regions WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise NotFoundError(f"region {name!r} not found", "region_not_found")
    return _region_of(row)


def _stored_node(conn: Connection, node_id: str) -> Node:
    row = conn.execute("SELECT * FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
    if row is None:
        raise NotFoundError(f"node {node_id!r} not found", "node_not_found")
    return _node_of(row)


def _update_region(conn: Connection, region: Region) -> audit.AuditDetail:
    """Write the region; returns the previous values of what changed."""
    old = _region_values(_stored_region(conn, region.name))
    cursor = conn.execute(
        "UPDATE regions SET lat = ?, lon = ?, ingress_url = ?, weight = ?, state = ?, "
        "is_deleting = ?, picker = ?, updated_at = ? WHERE name = ?",
        (
            region.lat,
            region.lon,
            region.ingress_url,
            region.weight,
            region.state,
            int(region.is_deleting),
            region.picker,
            region.updated_at,
            region.name,
        ),
    )
    if cursor.rowcount != 1:
        raise NotFoundError(f"region {region.name!r} not found", "region_not_found")
    return changed_from(old, _region_values(region))


def _register(conn: Connection, reg: Registration, now: float) -> None:
    row = conn.execute("SELECT * FROM nodes WHERE node_id = ?", (reg.node_id,)).fetchone()
    identity = reg.identity
    conn.execute(
        "INSERT INTO nodes (node_id, region, url, model, tp_size, drain_requested, "
        "registered_at, updated_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?) "
        "ON CONFLICT (node_id) DO UPDATE SET region = excluded.region, "
        "url = excluded.url, model = excluded.model, tp_size = excluded.tp_size, "
        "updated_at = excluded.updated_at",
        (reg.node_id, identity.region, identity.url, identity.model, identity.tp_size, now, now),
    )
    # The beat matched its credential: this binds a URL that was left open.
    write_binding(conn, reg.node_id, identity.region, identity.url)
    detail = _identity_values(identity)
    if row is not None:
        old = _identity_values(_node_of(row).identity)
        detail[OLD_KEY] = changed_from(old, _identity_values(identity))
    action = "node.update" if row is not None else "node.register"
    audit.record(conn, reg.actor, action, reg.node_id, detail)


class FleetStore:
    def __init__(self, store: Store) -> None:
        self._store = store

    async def read_drains(self) -> list[DrainSequence]:
        return await self._store.read(load_drains)

    async def read_changed(
        self, kinds: set[str], beats_since: float, unhealthy_after_s: float
    ) -> tuple[Fleet | None, list[DrainSequence] | None, SavedBeats]:
        """What another replica changed, in one read: the fleet (for "regions" or "nodes"), the
        drains, and the beats saved from `beats_since` on; None (no beats) for a kind not named."""

        def read(conn: Connection) -> tuple[Fleet | None, list[DrainSequence] | None, SavedBeats]:
            fresh = load_fleet(conn, unhealthy_after_s) if kinds & {"regions", "nodes"} else None
            drains = load_drains(conn) if "drains" in kinds else None
            beats = load_health(conn, beats_since) if "beats" in kinds else []
            return fresh, drains, beats

        return await self._store.read(read)

    async def create_region(self, actor: Actor, region: Region, detail: audit.AuditDetail) -> None:
        def change(conn: Connection) -> None:
            # ON CONFLICT, not a caught IntegrityError: a race between replicas is a 409 too.
            cursor = conn.execute(
                "INSERT INTO regions (name, lat, lon, ingress_url, weight, state, picker, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (name) DO NOTHING",
                (
                    region.name,
                    region.lat,
                    region.lon,
                    region.ingress_url,
                    region.weight,
                    region.state,
                    region.picker,
                    region.created_at,
                    region.updated_at,
                ),
            )
            if cursor.rowcount != 1:
                raise ConflictError(f"region {region.name!r} exists", "region_exists")
            audit.record(conn, actor, "region.create", region.name, detail)

        await self._store.write(change, ("regions",))

    async def update_region(
        self, actor: Actor, region: Region, action: str, detail: audit.AuditDetail
    ) -> None:
        def change(conn: Connection) -> None:
            old = _update_region(conn, region)
            audit.record(conn, actor, action, region.name, detail | {OLD_KEY: old})

        await self._store.write(change, ("regions",))

    async def delete_region(
        self, actor: Actor, name: str, action: str, node_ids: Sequence[str] = ()
    ) -> None:
        """Delete a region; with it `node_ids` (the nodes drained out of it) and their drains."""

        def change(conn: Connection) -> None:
            old = _region_values(_stored_region(conn, name))
            conn.execute("DELETE FROM regions WHERE name = ?", (name,))
            for node_id in node_ids:
                conn.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
                conn.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))
            detail: audit.AuditDetail = {"num_nodes_removed": len(node_ids)} if node_ids else {}
            audit.record(conn, actor, action, name, detail | {OLD_KEY: old})

        changes = ("regions", "nodes", "drains") if node_ids else ("regions",)
        await self._store.write(change, changes)

    async def register_nodes(self, batch: Sequence[Registration], now: float) -> None:
        """Registrations (new nodes or new identities) and their credentials' bindings."""

        def change(conn: Connection) -> None:
            for reg in batch:
                _register(conn, reg, now)

        node_ids = [reg.node_id for reg in batch]
        await self._store.write(change, ("nodes", naming("credentials", node_ids)))

    async def set_drain_requested(
        self, actor: Actor, node_id: str, drain: bool, now: float
    ) -> None:
        def change(conn: Connection) -> None:
            was_requested = _stored_node(conn, node_id).drain_requested
            conn.execute(
                "UPDATE nodes SET drain_requested = ?, updated_at = ? WHERE node_id = ?",
                (int(drain), now, node_id),
            )
            detail: audit.AuditDetail = {OLD_KEY: {"drain_requested": was_requested}}
            audit.record(conn, actor, "node.drain" if drain else "node.undrain", node_id, detail)

        await self._store.write(change, ("nodes",))

    async def move_node(
        self, actor: Actor, node_id: str, identity: NodeIdentity, now: float
    ) -> None:
        """An operator's move: the registration and the credential's binding change together."""

        def change(conn: Connection) -> None:
            old = _stored_node(conn, node_id).identity
            conn.execute(
                "UPDATE nodes SET region = ?, url = ?, updated_at = ? WHERE node_id = ?",
                (identity.region, identity.url, now, node_id),
            )
            write_binding(conn, node_id, identity.region, identity.url)
            detail: audit.AuditDetail = {"region": identity.region, "url": identity.url}
            detail[OLD_KEY] = changed_from(_identity_values(old), detail)
            audit.record(conn, actor, "node.move", node_id, detail)

        await self._store.write(change, ("nodes", "credentials"))

    async def delete_node(self, actor: Actor, node_id: str) -> None:
        def change(conn: Connection) -> None:
            old = _stored_node(conn, node_id)
            conn.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
            conn.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))
            values = _identity_values(old.identity) | {"drain_requested": old.drain_requested}
            audit.record(conn, actor, "node.delete", node_id, {OLD_KEY: values})

        await self._store.write(change, ("nodes", "drains"))

    async def write_drains(
        self,
        rows: dict[str, DrainSequence | None],
        entries: Sequence[tuple[str, str, audit.AuditDetail]],
        now: float,
        epoch: int | None,
    ) -> None:
        """The sequences that moved (None: delete its row) and the drain's audit entries, from
        the leader of `epoch` (None: the only control plane)."""
        values = {n: None if s is None else _drain_row(s, now) for n, s in rows.items()}

        def change(conn: Connection) -> None:
            check_epoch(conn, epoch)
            for node_id, row in values.items():
                if row is None:
                    conn.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))
                else:
                    conn.execute(
                        "INSERT INTO drains (node_id, region, reason, phase, started_at, steps, "
                        "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE "
                        "SET region = excluded.region, reason = excluded.reason, "
                        "phase = excluded.phase, started_at = excluded.started_at, "
                        "steps = excluded.steps, updated_at = excluded.updated_at",
                        row,
                    )
            for node_id, action, detail in entries:
                audit.record(conn, DRAIN_ACTOR, action, node_id, detail)

        await self._store.write(change, ("drains",))

    async def save_health(self, saved: SavedBeats) -> None:
        """The latest beats this replica received (each row kept if it is the newest). The
        change announced names the oldest of them, `beats=<seen_at>`: the other replicas read
        the rows from there on (`control_plane.replicas.following`), not the whole table."""
        oldest = min((seen_at for _, _, seen_at in saved), default=0.0)

        def change(conn: Connection) -> None:
            conn.executemany(
                "INSERT INTO node_health (node_id, beat, seen_at) VALUES (?, ?, ?) "
                "ON CONFLICT (node_id) DO UPDATE SET beat = excluded.beat, "
                "seen_at = excluded.seen_at WHERE excluded.seen_at > node_health.seen_at",
                [(node_id, beat.model_dump_json(), seen_at) for node_id, beat, seen_at in saved],
            )

        await self._store.write(change, (f"beats={oldest!r}",))

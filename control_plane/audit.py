"""The audit log: who changed what, and when, written inside the change's own transaction."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from pydantic import BaseModel

from control_plane.store import Connection

JsonScalar = str | int | float | bool | None
AuditDetail = dict[str, JsonScalar]


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a change: the kind of token presented, and the client it came from."""

    kind: str
    client: str


class AuditEntry(BaseModel):
    id: int
    at: float  # Unix seconds
    actor: str  # token kind: admin, node or gateway
    client: str  # address (and User-Agent) of the caller
    action: str  # e.g. "region.create", "key.revoke", "node.drain"
    target: str  # the name or id of what changed
    detail: AuditDetail


def record(conn: Connection, actor: Actor, action: str, target: str, detail: AuditDetail) -> None:
    """Append one entry; call it inside the transaction that makes the change."""
    conn.execute(
        "INSERT INTO audit_log (at, actor, client, action, target, detail) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (time.time(), actor.kind, actor.client, action, target, json.dumps(detail)),
    )


def list_entries(conn: Connection, after_id: int, limit: int) -> list[AuditEntry]:
    """Entries with id > after_id, oldest first (page with the last id seen)."""
    rows = conn.execute(
        "SELECT * FROM audit_log WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit)
    ).fetchall()
    return [
        AuditEntry(
            id=row["id"],
            at=row["at"],
            actor=row["actor"],
            client=row["client"],
            action=row["action"],
            target=row["target"],
            detail=json.loads(row["detail"]),
        )
        for row in rows
    ]

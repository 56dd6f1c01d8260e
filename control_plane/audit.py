"""The audit log: who changed what, and when, written inside the change's own transaction.

An entry's detail holds the new values and, under `old`, what they were before the change (read
inside the same transaction, so it is what the change replaced even between replicas). Calls
that were refused (401, 403) are entries too (`control_plane.refusals`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, JsonValue

from control_plane.store.base import Connection

AuditDetail = dict[str, JsonValue]
OLD_KEY = "old"


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


def changed_from(old: Mapping[str, JsonValue], new: Mapping[str, JsonValue]) -> AuditDetail:
    """The previous values (in `old`) of the fields `new` gives that differ from them."""
    return {name: old.get(name) for name, value in new.items() if old.get(name) != value}


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
    return [AuditEntry.model_validate({**row, "detail": json.loads(row["detail"])}) for row in rows]

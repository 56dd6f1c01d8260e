"""API keys: created with a secret shown once, stored only as a hash, patched (the models a key
may use, its limits per model, its token budget), revoked; and the versioned snapshot of active
keys that gateways cache.

Secrets are 256 random bits, so a plain SHA-256 is enough to store them safely: a slow password
hash (bcrypt, scrypt) protects low-entropy human passwords from guessing, which cannot succeed
against 2^256 possibilities. A fast hash also lets every gateway check a key per request with one
dictionary lookup.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from control_plane import audit
from control_plane.audit import Actor
from control_plane.changes import ChangeFeed
from control_plane.errors import ConflictError, NotFoundError
from control_plane.hashed_secrets import hash_secret
from control_plane.key_schemas import (
    KeyAccess,
    KeyCreate,
    KeyCreated,
    KeyPatch,
    KeySpend,
    KeyView,
)
from control_plane.spend import spend_of
from control_plane.store.base import Connection, Row, Store, get_meta
from wire.key_snapshot import KeyGrant, KeySnapshot

SECRET_PREFIX = "mer-"
KEYS_INDEX = "keys_index"


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


# The access columns, as `_access_columns` writes them and `_access_of` reads them back.
_ACCESS = ("models", "model_limits", "max_budget_tokens", "budget_period_s")
_FIELD_OF = {"budget_period_s": "budget_period"}


def _access_columns(access: KeyAccess, fields: set[str]) -> dict[str, object]:
    """The columns of `fields` (KeyAccess's) as stored: lists and maps as JSON text."""
    dumped = access.model_dump(include=fields)
    columns: dict[str, object] = {}
    for column in _ACCESS:
        field = _FIELD_OF.get(column, column)
        if field in dumped:
            value = getattr(access, field)
            is_json = column in ("models", "model_limits") and value is not None
            columns[column] = json.dumps(dumped[field]) if is_json else value
    return columns


def _access_of(row: Row) -> dict[str, Any]:
    """A row's access columns as KeyView's and KeyGrant's fields (old rows: no limit)."""
    models, limits = row["models"], row["model_limits"]
    return {
        "models": None if models is None else json.loads(models),
        "model_limits": {} if limits is None else json.loads(limits),
        "max_budget_tokens": row["max_budget_tokens"],
    }


def _view_of(row: Row) -> KeyView:
    # The other columns (the secret's hash) are ignored.
    return KeyView.model_validate(
        {**dict(row), **_access_of(row), "budget_period": row["budget_period_s"]}
    )


def _audited(view: KeyView, fields: set[str]) -> audit.AuditDetail:
    detail: audit.AuditDetail = view.model_dump(mode="json", include=fields)
    return detail


def _bump_index(conn: Connection) -> int:
    # One statement, so that replicas writing keys at once never take the same index.
    row = conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, '2') ON CONFLICT (key) DO UPDATE "
        "SET value = CAST(CAST(meta.value AS INTEGER) + 1 AS TEXT) RETURNING value",
        (KEYS_INDEX,),
    ).fetchone()
    return int(row["value"])


def read_index(conn: Connection) -> int:
    return int(get_meta(conn, KEYS_INDEX) or "1")


def _row_of(conn: Connection, key_id: str) -> Row:
    row = conn.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
    if row is None:
        raise NotFoundError(f"key {key_id!r} not found", "key_not_found")
    return row


def _active_row_of(conn: Connection, key_id: str) -> Row:
    row = _row_of(conn, key_id)
    if row["revoked_at"] is not None:
        raise ConflictError(f"key {key_id!r} is revoked", "key_revoked")
    return row


class KeyRegistry:
    def __init__(self, store: Store, feed: ChangeFeed) -> None:
        self.feed = feed
        self._store = store
        self._snapshot: KeySnapshot | None = None

    async def create(self, actor: Actor, body: KeyCreate) -> KeyCreated:
        secret = new_secret()
        created = KeyCreated(
            id="key_" + secrets.token_hex(8),
            secret=secret,
            created_at=time.time(),
            revoked_at=None,
            **{
                name: getattr(body, name)
                for name in KeyCreate.model_fields
                if name != "model_limits"
            },
            model_limits=body.model_limits or {},
        )

        def change(conn: Connection) -> int:
            columns = {
                "id": created.id,
                "name": created.name,
                "tenant": created.tenant,
                "secret_sha256": hash_secret(secret),
                "rpm": created.rpm,
                "tpm": created.tpm,
                "created_at": created.created_at,
                **_access_columns(body, set(KeyAccess.model_fields)),
            }
            marks = ", ".join("?" for _ in columns)
            conn.execute(
                f"INSERT INTO api_keys ({', '.join(columns)}) VALUES ({marks})",
                list(columns.values()),
            )
            audit.record(conn, actor, "key.create", created.id, body.model_dump(mode="json"))
            return _bump_index(conn)

        self._publish(await self._store.write(change, ("keys",)))
        return created

    async def list(self) -> list[KeyView]:
        def query(conn: Connection) -> list[KeyView]:
            return [
                _view_of(row)
                for row in conn.execute("SELECT * FROM api_keys ORDER BY created_at, id")
            ]

        return await self._store.read(query)

    async def spend(self, key_id: str) -> KeySpend:
        """The key's spend in its current period, per model (a revoked key's too)."""
        now = time.time()

        def query(conn: Connection) -> KeySpend:
            row = _row_of(conn, key_id)
            budget, period_s = row["max_budget_tokens"], row["budget_period_s"]
            return spend_of(conn, key_id, budget, period_s, now)

        return await self._store.read(query)

    async def patch(self, actor: Actor, key_id: str, body: KeyPatch) -> KeyView:
        """Change the models a key may use, its limits per model or its budget; gateways have
        it with the next snapshot."""
        fields = set(body.model_fields_set)

        def change(conn: Connection) -> tuple[KeyView, int]:
            old = _view_of(_active_row_of(conn, key_id))
            columns = _access_columns(body, fields)
            updates = ", ".join(f"{column} = ?" for column in columns)
            conn.execute(f"UPDATE api_keys SET {updates} WHERE id = ?", [*columns.values(), key_id])
            view = _view_of(_row_of(conn, key_id))
            detail = _audited(view, fields)
            detail[audit.OLD_KEY] = audit.changed_from(_audited(old, fields), detail)
            audit.record(conn, actor, "key.update", key_id, detail)
            return view, _bump_index(conn)

        view, index = await self._store.write(change, ("keys",))
        self._publish(index)
        return view

    async def revoke(self, actor: Actor, key_id: str) -> KeyView:
        def change(conn: Connection) -> tuple[KeyView, int]:
            _active_row_of(conn, key_id)
            now = time.time()
            conn.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (now, key_id))
            detail: audit.AuditDetail = {"revoked_at": now, audit.OLD_KEY: {"revoked_at": None}}
            audit.record(conn, actor, "key.revoke", key_id, detail)
            updated = conn.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
            return _view_of(updated), _bump_index(conn)

        view, index = await self._store.write(change, ("keys",))
        self._publish(index)
        return view

    async def snapshot(self) -> KeySnapshot:
        """Active keys at the current index (cached until the next change)."""
        cached = self._snapshot
        if cached is not None and cached.index == self.feed.index:
            return cached

        def query(conn: Connection) -> KeySnapshot:
            rows = conn.execute(
                "SELECT * FROM api_keys WHERE revoked_at IS NULL ORDER BY created_at, id"
            ).fetchall()
            grants = [
                KeyGrant(
                    id=row["id"],
                    tenant=row["tenant"],
                    secret_sha256=row["secret_sha256"],
                    rpm=row["rpm"],
                    tpm=row["tpm"],
                    budget_period_s=row["budget_period_s"],
                    **_access_of(row),
                )
                for row in rows
            ]
            return KeySnapshot(index=read_index(conn), keys=grants)

        snapshot = await self._store.read(query)
        if snapshot.index == self.feed.index:
            self._snapshot = snapshot
        return snapshot

    def follow(self, index: int) -> None:
        """Another replica changed the keys: the next snapshot is read again."""
        if index > self.feed.index:
            self._publish(index)

    def _publish(self, index: int) -> None:
        self._snapshot = None
        self.feed.advance_to(index)

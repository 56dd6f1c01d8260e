"""API keys: created with a secret shown once, stored only as a hash, revoked; and the versioned
snapshot of active keys that gateways cache.

Secrets are 256 random bits, so a plain SHA-256 is enough to store them safely: a slow password
hash (bcrypt, scrypt) protects low-entropy human passwords from guessing, which cannot succeed
against 2^256 possibilities. A fast hash also lets every gateway check a key per request with one
dictionary lookup.
"""

from __future__ import annotations

import secrets
import time

from control_plane import audit
from control_plane.audit import Actor
from control_plane.changes import ChangeFeed
from control_plane.errors import ConflictError, NotFoundError
from control_plane.hashed_secrets import hash_secret
from control_plane.schemas import KeyCreate, KeyCreated, KeyView
from control_plane.store.base import Connection, Row, Store, get_meta
from wire.key_snapshot import KeyGrant, KeySnapshot

SECRET_PREFIX = "mer-"
KEYS_INDEX = "keys_index"


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def _view_of(row: Row) -> KeyView:
    return KeyView.model_validate(dict(row))  # the other columns (the secret's hash) are ignored


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
            **body.model_dump(),
        )

        def change(conn: Connection) -> int:
            conn.execute(
                "INSERT INTO api_keys (id, name, tenant, secret_sha256, rpm, tpm, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    created.id,
                    created.name,
                    created.tenant,
                    hash_secret(secret),
                    created.rpm,
                    created.tpm,
                    created.created_at,
                ),
            )
            audit.record(conn, actor, "key.create", created.id, body.model_dump())
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

    async def revoke(self, actor: Actor, key_id: str) -> KeyView:
        def change(conn: Connection) -> tuple[KeyView, int]:
            row = conn.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"key {key_id!r} not found", "key_not_found")
            if row["revoked_at"] is not None:
                raise ConflictError(f"key {key_id!r} is already revoked", "key_revoked")
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
                "SELECT id, tenant, secret_sha256, rpm, tpm FROM api_keys "
                "WHERE revoked_at IS NULL ORDER BY created_at, id"
            ).fetchall()
            grants = [KeyGrant(**dict(row)) for row in rows]
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

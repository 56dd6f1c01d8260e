"""Envoys' xDS credentials: who may open an ADS stream, and for which snapshot.

An operator mints one per Envoy, or per group of Envoys that share a snapshot
(`POST /v1/xds/credentials/{name} {role, region?}`): a bearer token bound to a role (ingress or
edge) and, for an ingress, its region; shown in that answer only, stored as a SHA-256 (256 random
bits: see `control_plane.keys`). `envoy-bootstrap` puts it in the bootstrap, as the ADS stream's
`authorization: Bearer ...` metadata. The ADS server (`control_plane.xds.server`) looks a stream's
token up by its hash in the store, once per stream (streams are few and long: no copy in memory
to keep in step between replicas), and refuses a missing or unknown one before reading anything,
and a stream whose node asks for another role or region than its credential's. Minting again
replaces the token, deleting revokes it; either closes the streams that hold the old one, on every
replica (the write announces `envoy_credentials`; each replica checks its open streams again).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

from control_plane import audit
from control_plane.audit import Actor
from control_plane.errors import NotFoundError
from control_plane.hashed_secrets import hash_secret
from control_plane.store.base import Connection, Row, Store, of_row
from control_plane.xds.groups import EnvoyGroup, Role

TOKEN_PREFIX: Final = "mxds-"
KIND: Final = "envoy_credentials"  # the change replicas are told of


@dataclass(frozen=True, slots=True)
class EnvoyCredential:
    name: str
    role: Role
    region: str | None  # an ingress credential's region; None for the edge
    secret_sha256: str
    created_at: float

    @property
    def label(self) -> str:
        return f"{self.role}/{self.region}" if self.region else str(self.role)

    def refusal(self, group: EnvoyGroup) -> str | None:
        """Why this credential may not ask for `group`'s snapshot, or None if it may."""
        if group.role is self.role and group.region == self.region:
            return None
        return f"xDS credential {self.name!r} is for {self.label}, not {group.label}"

    def audit_values(self) -> audit.AuditDetail:
        return {"role": str(self.role), "region": self.region, "created_at": self.created_at}


def _of_row(row: Row) -> EnvoyCredential:
    return of_row(EnvoyCredential, row, role=Role(row["role"]))


def _stored(conn: Connection, name: str) -> EnvoyCredential | None:
    row = conn.execute("SELECT * FROM envoy_credentials WHERE name = ?", (name,)).fetchone()
    return None if row is None else _of_row(row)


class EnvoyCredentials:
    """Envoys' credentials, in the store only."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def find(self, token: str) -> EnvoyCredential | None:
        """The credential whose token this is (looked up by hash: timing reveals no token)."""
        digest = hash_secret(token)

        def query(conn: Connection) -> EnvoyCredential | None:
            sql = "SELECT * FROM envoy_credentials WHERE secret_sha256 = ?"
            row = conn.execute(sql, (digest,)).fetchone()
            return None if row is None else _of_row(row)

        return await self._store.read(query)

    async def still_valid(self, digests: Collection[str]) -> set[str]:
        """Which of these token hashes still belong to a credential."""
        if not digests:
            return set()
        marks = ", ".join("?" * len(digests))
        sql = f"SELECT secret_sha256 FROM envoy_credentials WHERE secret_sha256 IN ({marks})"

        def query(conn: Connection) -> set[str]:
            return {row["secret_sha256"] for row in conn.execute(sql, list(digests))}

        return await self._store.read(query)

    async def list(self) -> list[EnvoyCredential]:
        def query(conn: Connection) -> list[EnvoyCredential]:
            rows = conn.execute("SELECT * FROM envoy_credentials ORDER BY name")
            return [_of_row(row) for row in rows]

        return await self._store.read(query)

    async def mint(
        self, actor: Actor, name: str, role: Role, region: str | None
    ) -> tuple[EnvoyCredential, str]:
        """A new token named `name` for `role` (and `region`); replaces any earlier one."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        credential = EnvoyCredential(name, role, region, hash_secret(token), time.time())

        def change(conn: Connection) -> None:
            replaced = _stored(conn, name)
            conn.execute(
                "INSERT INTO envoy_credentials (name, role, region, secret_sha256, created_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET role = excluded.role, "
                "region = excluded.region, secret_sha256 = excluded.secret_sha256, "
                "created_at = excluded.created_at",
                (name, str(role), region, credential.secret_sha256, credential.created_at),
            )
            detail = credential.audit_values()
            if replaced is not None:  # its token stops working now
                detail[audit.OLD_KEY] = replaced.audit_values()
            audit.record(conn, actor, "xds.credential", name, detail)

        await self._store.write(change, (KIND,))
        return credential, token

    async def delete(self, actor: Actor, name: str) -> None:
        def change(conn: Connection) -> None:
            old = _stored(conn, name)
            if old is None:
                raise NotFoundError(f"xDS credential {name!r} not found", "credential_not_found")
            conn.execute("DELETE FROM envoy_credentials WHERE name = ?", (name,))
            detail: audit.AuditDetail = {audit.OLD_KEY: old.audit_values()}
            audit.record(conn, actor, "xds.credential.delete", name, detail)

        await self._store.write(change, (KIND,))

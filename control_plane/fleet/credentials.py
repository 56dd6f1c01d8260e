"""Per-node credentials: each node agent's own bearer token, bound to its node id and region.

An operator mints one (`POST /v1/nodes/{id}/credential {region, url?}`); the token is in that
answer only and stored as a SHA-256 (256 random bits: see `control_plane.keys` for why a fast hash
is enough). A heartbeat is accepted only for the node id, region and URL its credential is bound
to, so the holder of one node's token can neither register another node, nor move its node to
another region, nor point Envoy at another URL. A URL left out at minting is bound by the node's
first accepted beat. Changing the region or URL afterwards is an operator's act
(`PATCH /v1/nodes/{id}`, written by the registry); minting again replaces the token (and the old
one stops working at once), which is also how a leaked token is revoked.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

from control_plane import audit
from control_plane.audit import Actor
from control_plane.errors import PermissionDeniedError
from control_plane.hashed_secrets import hash_secret
from control_plane.store.base import Connection, Row, Store, naming, of_row
from wire.heartbeat import Heartbeat

TOKEN_PREFIX = "mnode-"


@dataclass(frozen=True, slots=True)
class NodeCredential:
    node_id: str
    region: str
    url: str | None  # None until the node's first beat binds it
    secret_sha256: str
    created_at: float

    def refusal(self, beat: Heartbeat) -> PermissionDeniedError | None:
        """Why this credential may not send `beat`, or None if it may."""
        if beat.node_id != self.node_id:
            return PermissionDeniedError(
                f"this credential belongs to node {self.node_id!r}, not {beat.node_id!r}",
                "node_id_mismatch",
                "node",
            )
        if beat.region != self.region:
            return PermissionDeniedError(
                f"node {self.node_id!r} is registered in region {self.region!r}, not "
                f"{beat.region!r}; an operator can move it (PATCH /v1/nodes/{self.node_id})",
                "region_mismatch",
                "node",
            )
        if self.url is not None and beat.url != self.url:
            return PermissionDeniedError(
                f"node {self.node_id!r} is registered at {self.url}, not {beat.url}; an "
                f"operator can change it (PATCH /v1/nodes/{self.node_id})",
                "url_mismatch",
                "node",
            )
        return None


def _of_row(row: Row) -> NodeCredential:
    return of_row(NodeCredential, row)


def load_credentials(conn: Connection) -> list[NodeCredential]:
    return [_of_row(row) for row in conn.execute("SELECT * FROM node_credentials")]


def load_credentials_of(node_ids: Sequence[str], conn: Connection) -> list[NodeCredential]:
    marks = ", ".join("?" * len(node_ids))
    sql = f"SELECT * FROM node_credentials WHERE node_id IN ({marks})"
    return [_of_row(row) for row in conn.execute(sql, node_ids)]


def write_binding(conn: Connection, node_id: str, region: str, url: str | None) -> bool:
    """Rebind a node's credential (inside the caller's transaction); False if it has none."""
    cursor = conn.execute(
        "UPDATE node_credentials SET region = ?, url = ?, updated_at = ? WHERE node_id = ?",
        (region, url, time.time(), node_id),
    )
    return cursor.rowcount == 1


class CredentialRegistry:
    """Every node's credential, in memory (looked up on each heartbeat) and in the store."""

    def __init__(self, store: Store, credentials: list[NodeCredential]) -> None:
        self._store = store
        self._reset(credentials)
        self._num_local_changes = 0

    async def follow(self, node_ids: set[str] | None = None) -> None:
        """Another replica minted or rebound the credentials of `node_ids` (None: any): memory
        follows the store. A read overtaken by a change made here (committed after the read's
        snapshot, put in memory before the read came back) would undo that change, so it is
        read again."""
        while True:
            before = self._num_local_changes
            if node_ids is None:
                credentials = await self._store.read(load_credentials)
            else:
                credentials = await self._store.read(partial(load_credentials_of, sorted(node_ids)))
            if self._num_local_changes != before:
                continue
            if node_ids is None:
                self._reset(credentials)
            for credential in credentials if node_ids is not None else ():
                self._replace(credential)  # credentials are replaced, never deleted
            return

    def _reset(self, credentials: list[NodeCredential]) -> None:
        self._by_node = {c.node_id: c for c in credentials}
        self._by_hash = {c.secret_sha256: c for c in credentials}

    def find(self, token: str) -> NodeCredential | None:
        """The credential whose token this is (a lookup by hash: timing reveals no token)."""
        return self._by_hash.get(hash_secret(token))

    def of_node(self, node_id: str) -> NodeCredential | None:
        return self._by_node.get(node_id)

    async def mint(
        self, actor: Actor, node_id: str, region: str, url: str | None
    ) -> tuple[NodeCredential, str]:
        """A new token for `node_id`, bound to `region` (and `url`); replaces any earlier one."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        credential = NodeCredential(node_id, region, url, hash_secret(token), now)

        def change(conn: Connection) -> None:
            replaced = conn.execute(
                "SELECT region, url, created_at FROM node_credentials WHERE node_id = ?",
                (node_id,),
            ).fetchone()
            conn.execute(
                "INSERT INTO node_credentials (node_id, region, url, secret_sha256, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET "
                "region = excluded.region, url = excluded.url, "
                "secret_sha256 = excluded.secret_sha256, created_at = excluded.created_at, "
                "updated_at = excluded.updated_at",
                (node_id, region, url, credential.secret_sha256, now, now),
            )
            detail: audit.AuditDetail = {"region": region, "url": url}
            if replaced is not None:  # its token stops working now
                detail[audit.OLD_KEY] = {k: replaced[k] for k in ("region", "url", "created_at")}
            audit.record(conn, actor, "node.credential", node_id, detail)

        await self._store.write(change, (naming("credentials", [node_id]),))
        self._put(credential)
        return credential, token

    def rebind(self, node_id: str, region: str, url: str | None) -> None:
        """Memory follows a committed `write_binding`."""
        old = self._by_node.get(node_id)
        if old is not None:
            self._put(replace(old, region=region, url=url))

    def _put(self, credential: NodeCredential) -> None:
        self._num_local_changes += 1
        self._replace(credential)

    def _replace(self, credential: NodeCredential) -> None:
        old = self._by_node.get(credential.node_id)
        if old is not None:
            self._by_hash.pop(old.secret_sha256, None)
        self._by_node[credential.node_id] = credential
        self._by_hash[credential.secret_sha256] = credential

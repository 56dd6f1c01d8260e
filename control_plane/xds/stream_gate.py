"""Who may open an ADS stream, and for which snapshot: an Envoy's credential in the stream's
metadata (`authorization: Bearer <token>`, see `control_plane.xds.credentials`).

A stream without a token, or with an unknown one, is refused with UNAUTHENTICATED before any of
its requests is read, so it is sent nothing; a stream whose node metadata names another role or
region than its credential's is refused with PERMISSION_DENIED. Both are recorded as refusals
(`control_plane.refusals`: the log and the audit log, at a bounded rate); other refusals (a node
without our metadata, no valid configuration) are the stream's own business, not an intrusion.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

import grpc

from control_plane.audit import Actor
from control_plane.refusals import Refusal, RefusalAudit
from control_plane.xds.credentials import EnvoyCredential, EnvoyCredentials
from control_plane.xds.groups import EnvoyGroup
from wire.errors import INVALID_CREDENTIAL, MISSING_CREDENTIAL

logger = logging.getLogger(__name__)

# A refused stream's gRPC code, as the HTTP status its audit entry shows.
REFUSAL_STATUS: Final = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
}
MINT_HINT: Final = "mint one (POST /v1/xds/credentials/NAME) and bootstrap Envoy with it"


@dataclass(frozen=True, slots=True)
class StreamRefusal:
    code: grpc.StatusCode
    error_code: str  # as in the HTTP services' error bodies
    message: str


def bearer_token(metadata: Collection[tuple[str, str | bytes]]) -> str | None:
    """The `authorization: Bearer <token>` of a stream's metadata ("" for another form, None for
    no such header)."""
    for key, value in metadata:
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def address_of(peer: str) -> str:
    """A gRPC peer (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`) → its IP."""
    address = peer.partition(":")[2]
    host = address.rpartition(":")[0] or address
    return host.removeprefix("[").removesuffix("]")


def group_refusal(credential: EnvoyCredential, group: EnvoyGroup) -> StreamRefusal | None:
    """Why a stream with `credential` may not ask for `group`'s snapshot, or None."""
    mismatch = credential.refusal(group)
    if mismatch is None:
        return None
    return StreamRefusal(grpc.StatusCode.PERMISSION_DENIED, "credential_mismatch", mismatch)


class StreamGate:
    def __init__(self, credentials: EnvoyCredentials, refusals: RefusalAudit) -> None:
        self._credentials = credentials
        self._refusals = refusals

    async def admit(
        self, metadata: Collection[tuple[str, str | bytes]]
    ) -> EnvoyCredential | StreamRefusal:
        """The stream's credential, or why it has none."""
        token = bearer_token(metadata)
        if not token:
            problem, code = (
                ("no xDS credential", MISSING_CREDENTIAL)
                if token is None
                else ("not a bearer credential", INVALID_CREDENTIAL)
            )
            return StreamRefusal(grpc.StatusCode.UNAUTHENTICATED, code, f"{problem}: {MINT_HINT}")
        try:
            credential = await self._credentials.find(token)
        except Exception as exc:  # the store is away: Envoy retries, and keeps what it has
            logger.warning("cannot look up an xDS credential: %s", exc)
            message = "the control plane cannot check credentials now; retry"
            return StreamRefusal(grpc.StatusCode.UNAVAILABLE, "store_unavailable", message)
        if credential is None:
            message = f"unknown xDS credential: {MINT_HINT}"
            return StreamRefusal(grpc.StatusCode.UNAUTHENTICATED, INVALID_CREDENTIAL, message)
        return credential

    async def revoked(self, held: Collection[EnvoyCredential]) -> set[str]:
        """The names of the credentials in `held` that were replaced or deleted since."""
        valid = await self._credentials.still_valid({c.secret_sha256 for c in held})
        return {c.name for c in held if c.secret_sha256 not in valid}

    async def record(
        self, peer: str, node_id: str, credential: EnvoyCredential | None, refusal: StreamRefusal
    ) -> None:
        """Log and audit a refusal about credentials; other refusals are not recorded."""
        status = REFUSAL_STATUS.get(refusal.code)
        if status is None:
            return
        kind = "envoy" if credential is not None else "anonymous"
        actor = Actor(kind=kind, client=f"{peer} ({node_id or 'before its first request'})")
        await self._refusals.record(
            Refusal(address_of(peer), actor, status, refusal.error_code, "xds", refusal.message)
        )

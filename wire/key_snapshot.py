"""API-key snapshot: control plane → gateways (`GET /v1/keys/snapshot?index=N&wait=30s`).

Gateways cache the active keys and watch this document with a blocking query (same semantics as
the region summaries), so a revoked key disappears from every gateway within a second or two. Only
the SHA-256 of each secret travels: a gateway hashes the presented key and looks the hash up.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

KEY_SNAPSHOT_SCHEMA_VERSION: Final = 1


class KeyGrant(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    tenant: str | None
    secret_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    rpm: int = Field(ge=1)  # requests per minute
    tpm: int = Field(ge=1)  # tokens per minute (prompt + completion)
    # The models and aliases this key may use (None: all). A fallback to a name not here is
    # skipped.
    models: tuple[str, ...] | None = None


class KeySnapshot(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = KEY_SNAPSHOT_SCHEMA_VERSION
    index: int = Field(ge=0)
    keys: list[KeyGrant]  # active keys only: a key missing here is revoked

"""API-key snapshot: control plane → gateways (`GET /v1/keys/snapshot?index=N&wait=30s`).

Gateways cache the active keys and watch this document with a blocking query (same semantics as
the region summaries), so a revoked key disappears from every gateway within a second or two. Only
the SHA-256 of each secret travels: a gateway hashes the presented key and looks the hash up.

A key may carry, beside its overall limits, limits per model (`model_limits`, on the model a
request resolves to, aliases followed) and a token budget per period (`max_budget_tokens` over
`budget_period_s`, periods counted from 1970-01-01 UTC). Older gateways ignore the fields.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.model_catalog import ModelName

KEY_SNAPSHOT_SCHEMA_VERSION: Final = 1
MAX_RPM: Final = 10**9
MAX_TPM: Final = 10**12
MAX_MODEL_LIMITS: Final = 1000  # per key
# A spend period: a second to a year (periods start at multiples of it since the epoch).
MAX_BUDGET_PERIOD_S: Final = 366 * 86_400
# The period spend is counted over for a key without a budget (a UTC day).
DEFAULT_SPEND_PERIOD_S: Final = 86_400


class ModelLimit(BaseModel):
    """A key's limits on one model, on top of its overall ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int = Field(ge=1, le=MAX_RPM, description="requests per minute")
    tpm: int = Field(ge=1, le=MAX_TPM, description="tokens per minute")


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
    # Model -> its limits for this key (a model, not an alias: what the request resolves to).
    model_limits: dict[ModelName, ModelLimit] = Field(
        default_factory=dict, max_length=MAX_MODEL_LIMITS
    )
    max_budget_tokens: int | None = Field(default=None, ge=1)  # per period (None: no budget)
    budget_period_s: int | None = Field(default=None, ge=1, le=MAX_BUDGET_PERIOD_S)


class KeySnapshot(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = KEY_SNAPSHOT_SCHEMA_VERSION
    index: int = Field(ge=0)
    keys: list[KeyGrant]  # active keys only: a key missing here is revoked


def period_start(now: float, period_s: int) -> int:
    """The start of the spend period holding `now` (periods of `period_s` from the epoch)."""
    return int(now // period_s) * period_s


# A period's units, as operators write periods (`"30d"`, `"12h"`), largest first.
PERIOD_UNITS_S: Final = {"d": 86_400, "h": 3600, "m": 60, "s": 1}


def period_text(seconds: int) -> str:
    """2,592,000 -> `"30d"`: in the largest unit that divides it."""
    for unit, size in PERIOD_UNITS_S.items():
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    raise AssertionError("every period is a whole number of seconds")

"""Usage reports and limit shares: gateway PoP → control plane → gateway PoP
(`POST /v1/limits/report`, every `limit_report_interval_s`).

Each PoP admits from its own buckets (its Redis, or its process), sized to its share of each
key's limits: `share × rpm` requests and `share × tpm` tokens, refilled at `share` of the key's
rate. A PoP reports, per key it touched since its last report, what was asked of it and its
buckets' levels; the answer is its shares (every key not listed has `default_share`), and, when
the report asks (`wants_levels`: its buckets are new or were lost), the levels it last reported
per key that has not refilled since, so that it starts from them rather than from full buckets.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.heartbeat import Name

LIMIT_REPORT_SCHEMA_VERSION: Final = 1
# Keys in one report or one answer (a PoP that touched more in one interval reports the rest
# next time).
MAX_REPORTED_KEYS: Final = 10_000
KeyId = str  # as in the key snapshot
_KEY_ID = Field(min_length=1, max_length=128)


class KeyLevels(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    key_id: KeyId = _KEY_ID
    request_level: float  # below zero: in debt
    token_level: float


class KeyUse(KeyLevels):
    """One key at one PoP since its last report; the levels are its buckets' latest."""

    num_requests: int = Field(ge=0)  # asked: admitted and refused (not those over the key's TPM)
    num_tokens: int = Field(ge=0)  # their reservations
    # The largest reservation refused for want of room here (None: none was): the PoP's share
    # must grow to hold it.
    largest_refused_tokens: int | None = Field(default=None, ge=0)


class UsageReport(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = LIMIT_REPORT_SCHEMA_VERSION
    pop: Name
    wants_levels: bool = False
    keys: list[KeyUse] = Field(default_factory=list, max_length=MAX_REPORTED_KEYS)


class KeyShare(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    key_id: KeyId = _KEY_ID
    share: float = Field(ge=0.0, le=1.0)


class ShareAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = LIMIT_REPORT_SCHEMA_VERSION
    default_share: float = Field(gt=0.0, le=1.0)
    shares: list[KeyShare] = Field(default_factory=list)
    levels: list[KeyLevels] = Field(default_factory=list)  # only when the report asked

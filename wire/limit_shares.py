"""Usage reports and limit shares: gateway PoP → control plane → gateway PoP
(`POST /v1/limits/report`, every `limit_report_interval_s`).

Each PoP admits from its own buckets (its Redis, or its process), sized to its share of each
key's limits: `share × rpm` requests and `share × tpm` tokens, refilled at `share` of the key's
rate. A PoP reports, per key it touched since its last report, what was asked of it and its
buckets' levels; the answer is its shares (every key not listed has `default_share`), and, when
the report asks (`wants_levels`: its buckets are new or were lost), the levels it last reported
per key that has not refilled since, so that it starts from them rather than from full buckets.

A key's limits on one model (`KeyGrant.model_limits`) are a limit entry of their own, shared the
same way: its id is `model_entry(key_id, model)` wherever a key id goes here.

Spend: a report also carries the tokens each key used per model since the last one (`spend`,
settled from the nodes' usage), under a `spend_batch` id and the sending process's `reporter`
id; a report sent again after its answer was lost repeats the batch, which the control plane
then skips (spend counts once, however many processes the PoP runs). The answer
lists, per key with a budget, what it spent in its current period (`spent`), so that each PoP
refuses a key whose budget is gone.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from wire.heartbeat import Name
from wire.model_catalog import ModelName

LIMIT_REPORT_SCHEMA_VERSION: Final = 1
# Keys in one report or one answer (a PoP that touched more in one interval reports the rest
# next time).
MAX_REPORTED_KEYS: Final = 10_000
KeyId = str  # as in the key snapshot, or a key's limit entry on a model (`model_entry`)
_KEY_ID = Field(min_length=1, max_length=300)
MODEL_SEPARATOR: Final = "#"  # in no key id and no model name


def model_entry(key_id: str, model: str) -> str:
    """The limit entry of a key's limits on `model`."""
    return f"{key_id}{MODEL_SEPARATOR}{model}"


def split_entry(entry: str) -> tuple[str, str | None]:
    """A limit entry's key id and model (None: the key's overall limits)."""
    key_id, separator, model = entry.partition(MODEL_SEPARATOR)
    return key_id, model if separator else None


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


class ModelSpend(BaseModel):
    """Tokens (prompt + completion, as the nodes reported them) one key used on one model."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    key_id: KeyId = _KEY_ID
    model: ModelName  # what the request resolved to (the one whose limits admitted it)
    num_tokens: int = Field(ge=0)


class UsageReport(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: Literal[1] = LIMIT_REPORT_SCHEMA_VERSION
    pop: Name
    wants_levels: bool = False
    keys: list[KeyUse] = Field(default_factory=list, max_length=MAX_REPORTED_KEYS)
    spend: list[ModelSpend] = Field(default_factory=list, max_length=MAX_REPORTED_KEYS)
    # The spend's id (None with no spend): a batch the control plane has applied is not again.
    spend_batch: str | None = Field(default=None, min_length=1, max_length=64)
    # The gateway process sending it (fresh at each start): a PoP may run several, and each
    # one's batch sent again is told from another's new one (None: the PoP is one process).
    reporter: str | None = Field(default=None, min_length=1, max_length=64)


class KeySpent(BaseModel):
    """What a key with a budget spent in its current period, every PoP's reports together."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    key_id: KeyId = _KEY_ID
    period_start: int  # unix seconds (`wire.key_snapshot.period_start`)
    spent_tokens: int = Field(ge=0)


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
    # Every active key with a budget that spent in its current period (not listed: nothing).
    spent: list[KeySpent] = Field(default_factory=list)

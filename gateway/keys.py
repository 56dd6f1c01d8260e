"""API keys: the cached snapshot of active keys, and checking a request's bearer key against it.

Only SHA-256 hashes travel from the control plane; a presented key is hashed and looked up in a
dictionary. Secrets are 256 random bits, so the lookup's timing reveals nothing worth having. A
key missing from the latest snapshot is revoked: the watch loop replaces the whole table as soon
as the control plane publishes a change (within about a second).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.errors import AuthenticationError, NotReadyError
from wire.errors import INVALID_CREDENTIAL, MISSING_CREDENTIAL
from wire.key_snapshot import KeyGrant, KeySnapshot
from wire.limit_shares import model_entry

MAX_KEY_LEN = 512


@dataclass(frozen=True, slots=True)
class KeyBudget:
    max_tokens: int  # per period
    period_s: int  # periods start at its multiples since the epoch


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key's limits: its id and limits are those of one limit entry (the key's own, or a
    `model_limits` entry: `key#model`, that model's limits)."""

    id: str
    rpm: int
    tpm: int
    models: frozenset[str] | None = None  # the model and alias names it may use (None: all)
    # Model -> the key's limits on it (on top of these), as an entry of their own.
    model_limits: Mapping[str, ApiKey] = field(default_factory=dict)
    budget: KeyBudget | None = None

    def may_use(self, name: str) -> bool:
        return self.models is None or name in self.models

    @classmethod
    def of(cls, grant: KeyGrant) -> ApiKey:
        model_limits = {
            model: ApiKey(model_entry(grant.id, model), limit.rpm, limit.tpm)
            for model, limit in grant.model_limits.items()
        }
        budget = None
        if grant.max_budget_tokens is not None and grant.budget_period_s is not None:
            budget = KeyBudget(grant.max_budget_tokens, grant.budget_period_s)
        models = None if grant.models is None else frozenset(grant.models)
        return cls(grant.id, grant.rpm, grant.tpm, models, model_limits, budget)


class KeyTable:
    def __init__(self) -> None:
        self._by_hash: dict[str, ApiKey] | None = None
        self.index = 0

    @property
    def is_loaded(self) -> bool:
        return self._by_hash is not None

    def __len__(self) -> int:
        return len(self._by_hash or {})

    def replace(self, snapshot: KeySnapshot) -> None:
        self._by_hash = {grant.secret_sha256: ApiKey.of(grant) for grant in snapshot.keys}
        self.index = snapshot.index

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key of a request's `Authorization` header, or AuthenticationError (401)."""
        by_hash = self._by_hash
        if by_hash is None:
            raise NotReadyError("the gateway has not loaded API keys yet", "not_ready")
        if not authorization:
            raise AuthenticationError(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                MISSING_CREDENTIAL,
            )
        scheme, _, secret = authorization.partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret or len(secret) > MAX_KEY_LEN:
            raise AuthenticationError(
                "Malformed Authorization header: expected 'Bearer <key>'.", INVALID_CREDENTIAL
            )
        key = by_hash.get(hashlib.sha256(secret.encode("utf-8", "replace")).hexdigest())
        if key is None:
            raise AuthenticationError("Incorrect API key provided.", INVALID_CREDENTIAL)
        return key

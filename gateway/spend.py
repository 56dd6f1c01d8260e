"""What this gateway process spent per key and model, reported to the control plane with its
usage reports (`gateway/limit_reports.py`), and each budgeted key's spend as this process knows
it, for refusing a key whose budget is gone (`PopLimiter.admit`).

A key's spend here is what the control plane's latest answer says the key spent in its current
period (every PoP's reports together), plus what this process spent since that was not in it,
plus the reservations of its requests in flight. A request is admitted while that is below the
budget: the last one admitted may take the spend past it by its own size, and between two
reports the PoPs together by what they admit in one interval. A period that has started since
the answer counts from zero. A stream running when the budget runs out is not cut: it was
admitted.

Spend goes to the control plane in batches with an id: a report whose answer was lost sends the
same batch again (the control plane skips a batch it has applied), and new spend waits for the
next batch meanwhile.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.keys import ApiKey
from wire.key_snapshot import period_start
from wire.limit_shares import MAX_REPORTED_KEYS, KeySpent, ModelSpend
from wire.model_catalog import MODEL_NAME_PATTERN

_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)
UNKNOWN_MODEL = "unknown"  # a model-blind request's name that is no model name


@dataclass(frozen=True, slots=True)
class SpendBatch:
    id: str
    tokens: dict[tuple[str, str], int]  # (key id, model) -> tokens

    def spend(self) -> list[ModelSpend]:
        """The batch as reported: a name that is no model name (a model-blind request's) as
        `UNKNOWN_MODEL`."""
        totals: dict[tuple[str, str], int] = defaultdict(int)
        for (key_id, model), num_tokens in self.tokens.items():
            totals[key_id, model if _MODEL_NAME.match(model) else UNKNOWN_MODEL] += num_tokens
        return [
            ModelSpend(key_id=key_id, model=model, num_tokens=num_tokens)
            for (key_id, model), num_tokens in totals.items()
        ]


@dataclass(frozen=True, slots=True)
class Exhausted:
    """A key whose budget is spent for the period ending at `resets_at` (unix seconds)."""

    max_tokens: int
    period_s: int
    resets_at: float


class SpendBook:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._fresh: dict[tuple[str, str], int] = defaultdict(int)  # not in a batch yet
        self._sending: SpendBatch | None = None  # in a report not yet answered
        # Budgeted keys: tokens spent here not in an answer yet, and reservations in flight.
        self._unanswered: dict[str, int] = defaultdict(int)
        self._held: dict[str, int] = defaultdict(int)
        self._spent: dict[str, KeySpent] = {}  # the latest answer's

    def reserve(self, key: ApiKey, num_tokens: int) -> Exhausted | None:
        """Hold `num_tokens` of the key's budget for a request, or say why not (None: no budget
        or room left)."""
        budget = key.budget
        if budget is None:
            return None
        now = self._clock()
        start = period_start(now, budget.period_s)
        answered = self._spent.get(key.id)
        spent = answered.spent_tokens if answered and answered.period_start == start else 0
        if spent + self._unanswered[key.id] + self._held[key.id] >= budget.max_tokens:
            return Exhausted(budget.max_tokens, budget.period_s, start + budget.period_s)
        self._held[key.id] += num_tokens
        return None

    def spent_of(self, key_id: str) -> int:
        """What the control plane's latest answer says the key spent in its period (0: none)."""
        answered = self._spent.get(key_id)
        return 0 if answered is None else answered.spent_tokens

    def release(self, key: ApiKey, num_tokens: int) -> None:
        """A reservation given back unused (the request was refused)."""
        if key.budget is not None:
            self._held[key.id] -= num_tokens

    def settle(self, key: ApiKey, model: str, num_reserved: int, num_used: int) -> None:
        """A finished request's reservation replaced by what it used."""
        if key.budget is not None:
            self._held[key.id] -= num_reserved
            self._unanswered[key.id] += num_used
        if num_used > 0:
            self._fresh[key.id, model] += num_used

    def take(self) -> SpendBatch | None:
        """The batch for the next report: the unanswered one again, or a new one."""
        if self._sending is None and self._fresh:
            entries = list(self._fresh.items())[:MAX_REPORTED_KEYS]
            for entry, _ in entries:
                del self._fresh[entry]
            self._sending = SpendBatch(secrets.token_hex(8), dict(entries))
        return self._sending

    def answered(self, batch: SpendBatch | None, spent: list[KeySpent]) -> None:
        """A report's answer: `batch` is in the control plane's totals, `spent` its news."""
        if batch is not None and batch is self._sending:
            self._sending = None
            for (key_id, _), num_tokens in batch.tokens.items():
                if key_id in self._unanswered:
                    self._unanswered[key_id] -= num_tokens
        self._spent = {key_spent.key_id: key_spent for key_spent in spent}
        for key_id in [k for k, n in self._unanswered.items() if n <= 0 and not self._held[k]]:
            del self._unanswered[key_id]

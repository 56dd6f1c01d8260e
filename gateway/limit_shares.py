"""This PoP's shares of the keys' limits, what was asked of it since its last report, and the
limiter that admits from buckets sized to those shares (`gateway/limits.py`).

The shares come from the control plane in the answer to each usage report
(`gateway/limit_reports.py`); until the first answer the PoP knows none and answers 503, as it
does until it has keys. Counting what was asked is a dictionary update per request: the report
leaves the request path.

The limiter admits a request against the key's budget (`gateway/spend.py`), then its own
buckets, then its buckets on the request's model if it has limits there; the spend of what a
finished request used is counted per key and model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.errors import NotReadyError
from gateway.keys import ApiKey
from gateway.limits import Admission, Buckets
from gateway.spend import Exhausted, SpendBook
from wire.limit_shares import ShareAnswer


class ShareTable:
    def __init__(self) -> None:
        self._shares: dict[str, float] = {}
        self._default: float | None = None

    @property
    def is_loaded(self) -> bool:
        return self._default is not None

    @property
    def default_share(self) -> float | None:
        return self._default

    def share_of(self, key_id: str) -> float:
        default = self._default
        if default is None:
            raise NotReadyError(
                "the gateway has not heard its share of the keys' limits yet", "not_ready"
            )
        return self._shares.get(key_id, default)

    def replace(self, answer: ShareAnswer) -> None:
        self._shares = {share.key_id: share.share for share in answer.shares}
        self._default = answer.default_share


@dataclass(slots=True)
class Asked:
    """What one key asked of this PoP since the last report."""

    num_requests: int = 0
    num_tokens: int = 0
    largest_refused_tokens: int | None = None  # refused for want of room here

    def add(self, other: Asked) -> None:
        self.num_requests += other.num_requests
        self.num_tokens += other.num_tokens
        if other.largest_refused_tokens is not None:
            self.largest_refused_tokens = max(
                self.largest_refused_tokens or 0, other.largest_refused_tokens
            )


class UsageMeter:
    def __init__(self) -> None:
        self._asked: dict[str, Asked] = {}

    def count(self, key_id: str, num_tokens: int, admission: Admission) -> None:
        if admission.is_too_large:  # never admissible anywhere: no demand for a share
            return
        asked = self._asked.get(key_id)
        if asked is None:
            asked = self._asked[key_id] = Asked()
        asked.num_requests += 1
        asked.num_tokens += num_tokens
        if not admission.is_allowed:
            asked.largest_refused_tokens = max(asked.largest_refused_tokens or 0, num_tokens)

    def touch(self, key_id: str) -> None:
        """The key's levels changed without a request (a settlement): report them."""
        self._asked.setdefault(key_id, Asked())

    def take(self) -> dict[str, Asked]:
        taken, self._asked = self._asked, {}
        return taken

    def give_back(self, taken: dict[str, Asked]) -> None:
        """A report that failed: its counts go into the next one."""
        for key_id, asked in taken.items():
            self._asked.setdefault(key_id, Asked()).add(asked)


@dataclass(frozen=True, slots=True)
class Ticket:
    """A request's admission on its key and model: what the handlers hold and settle."""

    admission: Admission  # the key's own (refused: the limit's that refused)
    model: str  # what the request resolved to
    on_model: Admission | None = None  # taken from the key's limits on `model` (None: none)
    refused_on_model: bool = False  # refused by the key's limits on `model`, not its own
    limits_on_model: ApiKey | None = None  # those limits (keyed by `model` or an alias of it)

    @property
    def is_allowed(self) -> bool:
        return self.admission.is_allowed

    def headers(self) -> dict[str, str]:
        return self.admission.headers()


class PopLimiter:
    """What the handlers admit from and settle to: this PoP's buckets at its current shares,
    and the keys' budgets."""

    def __init__(
        self,
        buckets: Buckets,
        shares: ShareTable,
        meter: UsageMeter,
        spend: SpendBook | None = None,
    ) -> None:
        self.buckets = buckets
        self.shares = shares
        self.meter = meter
        self.spend = spend if spend is not None else SpendBook()

    async def admit(
        self, key: ApiKey, model: str, num_tokens: int, on_model: ApiKey | None
    ) -> Ticket:
        """Take one request and `num_tokens` from the key's budget, its buckets and its
        limits `on_model` (`ModelChoice.limits`: the key's on `model`, None if none), or
        nothing."""
        share = self.shares.share_of(key.id)  # before anything is taken: not ready is a 503
        exhausted = self.spend.reserve(key, num_tokens)
        if exhausted is not None:
            return Ticket(_over_budget(key, num_tokens, exhausted), model)
        admission = await self._take(key, share, num_tokens)
        if not admission.is_allowed or on_model is None:
            if not admission.is_allowed:
                self.spend.release(key, num_tokens)
            return Ticket(admission, model)
        by_model = await self._take(on_model, self.shares.share_of(on_model.id), num_tokens)
        if by_model.is_allowed:
            return Ticket(admission, model, by_model, limits_on_model=on_model)
        await self.buckets.refund(key, share, admission)
        self.spend.release(key, num_tokens)
        return Ticket(by_model, model, refused_on_model=True, limits_on_model=on_model)

    async def _take(self, key: ApiKey, share: float, num_tokens: int) -> Admission:
        admission = await self.buckets.admit(key, share, num_tokens)
        self.meter.count(key.id, num_tokens, admission)
        return admission

    async def settle(
        self, key: ApiKey, ticket: Ticket, num_unused_tokens: int, answered: str | None = None
    ) -> None:
        """Give back what a finished request did not use (negative: charge the excess), to the
        buckets that `ticket` was taken from, and count what it used as the key's spend on
        `answered`, the model that answered (a fallback's; None: the one it resolved to)."""
        admission = ticket.admission
        await self._give_back(key, admission, num_unused_tokens)
        on_model = ticket.limits_on_model
        if ticket.on_model is not None and on_model is not None:
            await self._give_back(on_model, ticket.on_model, num_unused_tokens)
        num_used = admission.num_tokens - num_unused_tokens
        spent_on = ticket.model if answered is None else answered
        self.spend.settle(key, spent_on, admission.num_tokens, num_used)

    async def _give_back(self, key: ApiKey, admission: Admission, num_unused_tokens: int) -> None:
        share = self.shares.share_of(key.id)
        await self.buckets.settle(key, share, admission, num_unused_tokens)
        self.meter.touch(key.id)

    async def close(self) -> None:
        await self.buckets.close()


def _over_budget(key: ApiKey, num_tokens: int, exhausted: Exhausted) -> Admission:
    return Admission(
        is_allowed=False,
        limited_by="budget",
        is_too_large=False,
        rpm=key.rpm,
        tpm=key.tpm,
        request_level=0.0,
        token_level=0.0,
        retry_after_s=max(0.0, exhausted.resets_at - time.time()),
        num_tokens=num_tokens,
    )

"""Per-key rate limits: requests per minute and tokens per minute, as two token buckets per key
at each PoP, holding the PoP's share of the key.

A PoP's share `s` of a key (`gateway/limit_shares.py`, from the control plane) sizes its buckets:
capacity `s × rpm` and `s × tpm`, refilled at `s` of the key's rate, so that PoPs whose shares
add up to 1 never admit more together than the key allows. Between two touches a bucket refills
at the lower of the share it was last touched with and the share now (a share that shrank counts
at once, one that grew from the next touch), and it never holds more than its share now.

Admission takes one request and the request's whole reservation (prompt estimate + max_tokens)
at once, or nothing; when the response ends, the reservation is settled against the usage the
node reported (the unused part goes back; an underestimated prompt is charged, possibly into
debt). A stream therefore never needs to be cut off for its budget: it was paid for before it
started. A refusal's Retry-After is when the request would fit at the key's whole rate (the
soonest it can, as shares follow demand).

A key with limits on a model (`ApiKey.model_limits`) has buckets for them too, as a key of its
own (`key#model`): a request for the model takes from both or from neither.

Two backends keep the buckets (`Buckets`): `LocalBuckets` (one process) here, and `RedisBuckets`
(every gateway process of a PoP, `gateway/redis_limits.py`). An admission says which backend
took it, so that it is settled where it was paid for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.keys import ApiKey
from wire.limit_shares import KeyLevels

SECONDS_PER_MINUTE = 60.0
LimitKind = Literal["requests", "tokens", "budget"]


@dataclass(frozen=True, slots=True)
class Admission:
    is_allowed: bool
    limited_by: LimitKind | None  # which bucket refused (None if allowed)
    is_too_large: bool  # the reservation exceeds the key's whole TPM: waiting cannot help
    rpm: int  # the key's limits
    tpm: int
    request_level: float  # this PoP's bucket levels after the decision
    token_level: float
    retry_after_s: float  # when this request would fit (0 if allowed)
    share: float = 1.0  # this PoP's share of the key: its buckets hold `share × rpm`, `× tpm`
    is_shared: bool = False  # taken from the PoP's shared buckets (Redis), not this process's
    num_tokens: int = 0  # the reservation asked for

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers (and `retry-after` when refused): the key's limits,
        and what remains of them at this PoP (a budget's refusal: when it resets, alone)."""
        if self.limited_by == "budget":
            return self._retry_headers()
        headers = {
            "x-ratelimit-limit-requests": str(self.rpm),
            "x-ratelimit-remaining-requests": str(max(0, math.floor(self.request_level))),
            "x-ratelimit-reset-requests": format_duration(
                _refill_s(self.request_level, self.rpm * self.share)
            ),
            "x-ratelimit-limit-tokens": str(self.tpm),
            "x-ratelimit-remaining-tokens": str(max(0, math.floor(self.token_level))),
            "x-ratelimit-reset-tokens": format_duration(
                _refill_s(self.token_level, self.tpm * self.share)
            ),
        }
        if not self.is_allowed:
            headers.update(self._retry_headers())
        return headers

    def _retry_headers(self) -> dict[str, str]:
        return {
            "retry-after": str(max(1, math.ceil(self.retry_after_s))),
            "retry-after-ms": str(max(1, math.ceil(self.retry_after_s * 1000))),
        }


class Buckets(Protocol):
    """A PoP's buckets, sized to its `share` of each key."""

    @property
    def needs_levels(self) -> bool:
        """The buckets are new or were lost: they want the levels the control plane knows."""
        ...

    async def admit(self, key: ApiKey, share: float, num_tokens: int) -> Admission: ...

    async def settle(
        self, key: ApiKey, share: float, admission: Admission, num_unused_tokens: int
    ) -> None: ...

    async def refund(self, key: ApiKey, share: float, admission: Admission) -> None:
        """Give back all of an admission: its request and its reservation."""
        ...

    def levels_of(self, key_id: str) -> KeyLevels | None:
        """The key's latest levels here, as last seen (None: never touched)."""
        ...

    async def seed(self, levels: list[KeyLevels]) -> None:
        """Start from `levels` (the control plane's last known ones) where they are lower."""
        ...

    async def close(self) -> None: ...


def _refill_s(level: float, capacity: float) -> float:
    if capacity <= 0.0:
        return 0.0
    return max(0.0, capacity - level) / (capacity / SECONDS_PER_MINUTE)


def format_duration(seconds: float) -> str:
    """Go-style durations as OpenAI sends them: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1.0:
        return f"{round(seconds * 1000)}ms"
    if seconds < SECONDS_PER_MINUTE:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest_s = divmod(seconds, SECONDS_PER_MINUTE)
    return f"{int(minutes)}m{rest_s:.0f}s"


def refill(level: float, capacity: float, rate_per_s: float, elapsed_s: float) -> float:
    return min(capacity, level + max(0.0, elapsed_s) * rate_per_s)


def decide(
    key: ApiKey, share: float, request_level: float, token_level: float, num_tokens: int
) -> tuple[Admission, float, float]:
    """The admission for refilled levels, and the levels to store after it."""
    is_too_large = num_tokens > key.tpm
    limited_by: LimitKind | None = None
    retry_after_s = 0.0
    if request_level >= 1.0 and token_level >= num_tokens and not is_too_large:
        request_level, token_level = request_level - 1.0, token_level - num_tokens
    else:
        wait_requests_s = max(0.0, 1.0 - request_level) * SECONDS_PER_MINUTE / key.rpm
        if is_too_large:
            wait_tokens_s = SECONDS_PER_MINUTE
        else:
            wait_tokens_s = max(0.0, num_tokens - token_level) * SECONDS_PER_MINUTE / key.tpm
        limited_by = "requests" if wait_requests_s >= wait_tokens_s else "tokens"
        retry_after_s = max(wait_requests_s, wait_tokens_s)
    admission = Admission(
        is_allowed=limited_by is None,
        limited_by=limited_by,
        is_too_large=is_too_large,
        rpm=key.rpm,
        tpm=key.tpm,
        request_level=request_level,
        token_level=token_level,
        retry_after_s=retry_after_s,
        share=share,
        num_tokens=num_tokens,
    )
    return admission, request_level, token_level


@dataclass(slots=True)
class _Buckets:
    request_level: float
    token_level: float
    share: float  # the share it was last touched with
    updated_s: float

    def refill_to(self, key: ApiKey, share: float, now_s: float) -> None:
        elapsed_s = now_s - self.updated_s
        per_s = min(self.share, share) / SECONDS_PER_MINUTE
        self.request_level = refill(self.request_level, key.rpm * share, key.rpm * per_s, elapsed_s)
        self.token_level = refill(self.token_level, key.tpm * share, key.tpm * per_s, elapsed_s)
        self.share, self.updated_s = share, max(self.updated_s, now_s)


class LocalBuckets:
    """Buckets in this process's memory (a PoP of one gateway process, or Redis's fallback)."""

    def __init__(self) -> None:
        self._buckets: dict[str, _Buckets] = {}
        self._needs_levels = True  # until the first report's answer is in

    @property
    def needs_levels(self) -> bool:
        return self._needs_levels

    def __contains__(self, key_id: str) -> bool:
        return key_id in self._buckets

    def __len__(self) -> int:
        return len(self._buckets)

    def _buckets_of(self, key: ApiKey, share: float, now_s: float) -> _Buckets:
        buckets = self._buckets.get(key.id)
        if buckets is None:
            buckets = _Buckets(key.rpm * share, key.tpm * share, share, now_s)
            self._buckets[key.id] = buckets
        buckets.refill_to(key, share, now_s)
        return buckets

    def start_from(self, levels: KeyLevels, share: float, at_s: float) -> None:
        """Start the key's buckets from `levels` as they were at `at_s` with `share` (lower
        than now only)."""
        current = self._buckets.get(levels.key_id)
        if current is None:
            self._buckets[levels.key_id] = _Buckets(
                levels.request_level, levels.token_level, share, at_s
            )
            return
        current.request_level = min(current.request_level, levels.request_level)
        current.token_level = min(current.token_level, levels.token_level)

    def admit_now(self, key: ApiKey, share: float, num_tokens: int) -> Admission:
        buckets = self._buckets_of(key, share, time.monotonic())
        admission, buckets.request_level, buckets.token_level = decide(
            key, share, buckets.request_level, buckets.token_level, num_tokens
        )
        return admission

    def settle_now(
        self, key: ApiKey, share: float, num_unused_tokens: int, num_unused_requests: int = 0
    ) -> None:
        buckets = self._buckets_of(key, share, time.monotonic())
        buckets.token_level = min(key.tpm * share, buckets.token_level + num_unused_tokens)
        buckets.request_level = min(key.rpm * share, buckets.request_level + num_unused_requests)

    def levels_of(self, key_id: str) -> KeyLevels | None:
        buckets = self._buckets.get(key_id)
        if buckets is None:
            return None
        return KeyLevels(
            key_id=key_id, request_level=buckets.request_level, token_level=buckets.token_level
        )

    def take_levels(self) -> list[KeyLevels]:
        """Every key's levels as last touched (not refilled since), emptying these buckets."""
        taken = [
            KeyLevels(key_id=key_id, request_level=b.request_level, token_level=b.token_level)
            for key_id, b in self._buckets.items()
        ]
        self._buckets.clear()
        return taken

    async def admit(self, key: ApiKey, share: float, num_tokens: int) -> Admission:
        return self.admit_now(key, share, num_tokens)

    async def settle(
        self, key: ApiKey, share: float, admission: Admission, num_unused_tokens: int
    ) -> None:
        self.settle_now(key, share, num_unused_tokens)

    async def refund(self, key: ApiKey, share: float, admission: Admission) -> None:
        self.settle_now(key, share, admission.num_tokens, 1)

    async def seed(self, levels: list[KeyLevels]) -> None:
        now_s = time.monotonic()
        for key_levels in levels:
            # The control plane's levels are as of now, at whatever share: refill at the next.
            self.start_from(key_levels, 1.0, now_s)
        self._needs_levels = False

    async def close(self) -> None:
        self._buckets.clear()

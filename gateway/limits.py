"""Per-key rate limits: requests per minute and tokens per minute, as two token buckets.

Each key has a request bucket (capacity `rpm`, refilled at rpm/60 per second) and a token bucket
(capacity `tpm`, refilled at tpm/60 per second). Admission takes one request and the request's
whole reservation (prompt estimate + max_tokens) at once, or nothing; when the response ends, the
reservation is settled against the usage the node reported (the unused part goes back; an
underestimated prompt is charged, possibly into debt). A stream therefore never needs to be cut
off for its budget: it was paid for before it started.

Two backends share this math and the `Limiter` interface: `LocalLimiter` (one process) here, and
`RedisLimiter` (every gateway process of a PoP, `gateway/redis_limits.py`). An admission says
which backend took it, so that it is settled where it was paid for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.keys import ApiKey

SECONDS_PER_MINUTE = 60.0
LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class Admission:
    is_allowed: bool
    limited_by: LimitKind | None  # which bucket refused (None if allowed)
    is_too_large: bool  # the reservation exceeds the key's whole TPM: waiting cannot help
    rpm: int
    tpm: int
    request_level: float  # bucket levels after the decision
    token_level: float
    retry_after_s: float  # when this request would fit (0 if allowed)
    is_shared: bool = False  # taken from the PoP's shared buckets (Redis), not this process's

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers (and `retry-after` when refused)."""
        headers = {
            "x-ratelimit-limit-requests": str(self.rpm),
            "x-ratelimit-remaining-requests": str(max(0, math.floor(self.request_level))),
            "x-ratelimit-reset-requests": format_duration(_refill_s(self.request_level, self.rpm)),
            "x-ratelimit-limit-tokens": str(self.tpm),
            "x-ratelimit-remaining-tokens": str(max(0, math.floor(self.token_level))),
            "x-ratelimit-reset-tokens": format_duration(_refill_s(self.token_level, self.tpm)),
        }
        if not self.is_allowed:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return headers


class Limiter(Protocol):
    async def admit(self, key: ApiKey, num_tokens: int) -> Admission:
        """Take one request and `num_tokens` from the key's buckets, or nothing."""
        ...

    async def settle(self, key: ApiKey, admission: Admission, num_unused_tokens: int) -> None:
        """Give back what a finished request did not use (negative: charge the excess), to the
        buckets that `admission` was taken from."""
        ...

    async def close(self) -> None: ...


def _rate_per_s(per_minute: int) -> float:
    return per_minute / SECONDS_PER_MINUTE


def _refill_s(level: float, capacity: int) -> float:
    return max(0.0, capacity - level) / _rate_per_s(capacity)


def format_duration(seconds: float) -> str:
    """Go-style durations as OpenAI sends them: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1.0:
        return f"{round(seconds * 1000)}ms"
    if seconds < SECONDS_PER_MINUTE:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest_s = divmod(seconds, SECONDS_PER_MINUTE)
    return f"{int(minutes)}m{rest_s:.0f}s"


def refill(level: float, capacity: int, elapsed_s: float) -> float:
    return min(float(capacity), level + max(0.0, elapsed_s) * _rate_per_s(capacity))


def decide(
    key: ApiKey, request_level: float, token_level: float, num_tokens: int
) -> tuple[Admission, float, float]:
    """The admission for refilled levels, and the levels to store after it."""
    is_too_large = num_tokens > key.tpm
    if request_level >= 1.0 and token_level >= num_tokens and not is_too_large:
        after_requests, after_tokens = request_level - 1.0, token_level - num_tokens
        admission = Admission(
            is_allowed=True,
            limited_by=None,
            is_too_large=False,
            rpm=key.rpm,
            tpm=key.tpm,
            request_level=after_requests,
            token_level=after_tokens,
            retry_after_s=0.0,
        )
        return admission, after_requests, after_tokens
    wait_requests_s = max(0.0, 1.0 - request_level) / _rate_per_s(key.rpm)
    if is_too_large:
        wait_tokens_s = SECONDS_PER_MINUTE
    else:
        wait_tokens_s = max(0.0, num_tokens - token_level) / _rate_per_s(key.tpm)
    limited_by: LimitKind = "requests" if wait_requests_s >= wait_tokens_s else "tokens"
    retry_after_s = max(wait_requests_s, wait_tokens_s)
    admission = Admission(
        is_allowed=False,
        limited_by=limited_by,
        is_too_large=is_too_large,
        rpm=key.rpm,
        tpm=key.tpm,
        request_level=request_level,
        token_level=token_level,
        retry_after_s=retry_after_s,
    )
    return admission, request_level, token_level


@dataclass(slots=True)
class _Buckets:
    request_level: float
    token_level: float
    updated_s: float

    def refill_to(self, key: ApiKey, now_s: float) -> None:
        elapsed_s = now_s - self.updated_s
        self.request_level = refill(self.request_level, key.rpm, elapsed_s)
        self.token_level = refill(self.token_level, key.tpm, elapsed_s)
        self.updated_s = now_s


class LocalLimiter:
    """Buckets in this process's memory (one gateway process per PoP, or Redis as a fallback)."""

    def __init__(self) -> None:
        self._buckets: dict[str, _Buckets] = {}

    def _buckets_of(self, key: ApiKey, now_s: float) -> _Buckets:
        buckets = self._buckets.get(key.id)
        if buckets is None:
            buckets = _Buckets(float(key.rpm), float(key.tpm), now_s)
            self._buckets[key.id] = buckets
        buckets.refill_to(key, now_s)
        return buckets

    def admit_now(self, key: ApiKey, num_tokens: int) -> Admission:
        buckets = self._buckets_of(key, time.monotonic())
        admission, buckets.request_level, buckets.token_level = decide(
            key, buckets.request_level, buckets.token_level, num_tokens
        )
        return admission

    def settle_now(self, key: ApiKey, num_unused_tokens: int) -> None:
        buckets = self._buckets_of(key, time.monotonic())
        buckets.token_level = min(float(key.tpm), buckets.token_level + num_unused_tokens)

    async def admit(self, key: ApiKey, num_tokens: int) -> Admission:
        return self.admit_now(key, num_tokens)

    async def settle(self, key: ApiKey, admission: Admission, num_unused_tokens: int) -> None:
        self.settle_now(key, num_unused_tokens)

    async def close(self) -> None:
        self._buckets.clear()

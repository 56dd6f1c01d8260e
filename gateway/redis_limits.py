"""A PoP's buckets shared by all its gateway processes, kept in Redis (scripts and the hash
layout in `gateway/redis_scripts.py`).

Every answer from Redis leaves the key's levels in this process's memory (the levels last seen).
If Redis cannot be reached, the process admits from buckets of its own that start from those
levels, debt included, never from full ones (limits then hold per process rather than per PoP,
from where the PoP stood). A circuit breaker keeps it there for `cooldown_s` after a failure, so
that requests do not each wait for Redis's timeouts, then lets one request probe Redis. Once
Redis answers again, what the process took meanwhile is written back (each level lowered to the
process's where that is lower) and the process admits from Redis again.

Redis that has lost its data (restarted without persistence) or is new answers every script
with "not seeded" (see `redis_scripts`): the process then admits from its own buckets as above
and asks the control plane, in its next usage report, for the levels it knows for this PoP;
`seed` writes them (and sets the marker) unless another process did first. The first report of
every process asks too, so a process and its Redis restarted together also start from them.

Import this module only when shared limits are configured: `redis` is an optional dependency
(`pip install 'meridian[redis]'`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.keys import ApiKey
from gateway.limits import Admission, LocalBuckets, decide
from gateway.redis_scripts import (
    ADMIT_SCRIPT,
    EXPIRY_MARGIN_MS,
    KEY_PREFIX,
    MAX_KEEP_MS,
    SEED_SCRIPT,
    SEEDED_KEY,
    SETTLE_SCRIPT,
)
from wire.limit_shares import KeyLevels

logger = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class _Seen:
    """A key's levels in Redis as last seen by this process."""

    levels: KeyLevels
    share: float
    at_s: float  # monotonic


class RedisBuckets:
    def __init__(self, url: str, cooldown_s: float, timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._admit = self._redis.register_script(ADMIT_SCRIPT)
        self._settle = self._redis.register_script(SETTLE_SCRIPT)
        self._seed = self._redis.register_script(SEED_SCRIPT)
        self._fallback = LocalBuckets()
        self._breaker = CircuitBreaker("redis", max_failures=1, open_s=cooldown_s)
        self._seen: dict[str, _Seen] = {}
        self._needs_levels = True  # until the first report's answer is written
        self._write_back: asyncio.Task[None] | None = None

    @property
    def needs_levels(self) -> bool:
        return self._needs_levels

    async def admit(self, key: ApiKey, share: float, num_tokens: int) -> Admission:
        answer = await self._run(self._admit, key, share, num_tokens)
        if answer is None:
            return self._fallback_for(key, share).admit_now(key, share, num_tokens)
        allowed, request_level, token_level = answer
        levels = float(request_level), float(token_level)
        if allowed:
            before = levels[0] + 1.0, levels[1] + num_tokens
            admission, _, _ = decide(key, share, *before, num_tokens)
        else:
            admission, _, _ = decide(key, share, *levels, num_tokens)
        return replace(admission, is_shared=True)

    async def settle(
        self, key: ApiKey, share: float, admission: Admission, num_unused_tokens: int
    ) -> None:
        await self._give_back(key, share, num_unused_tokens, 0)

    async def refund(self, key: ApiKey, share: float, admission: Admission) -> None:
        await self._give_back(key, share, admission.num_tokens, 1)

    async def _give_back(
        self, key: ApiKey, share: float, num_tokens: int, num_requests: int
    ) -> None:
        if num_tokens == 0 and num_requests == 0:
            return
        if key.id in self._fallback:  # on it now, or not yet written back
            self._fallback.settle_now(key, share, num_tokens, num_requests)
            return
        if await self._run(self._settle, key, share, num_tokens, num_requests) is None:
            # Redis is away: settled in the buckets that start from the levels last seen,
            # which hold this admission's reservation already.
            self._fallback_for(key, share).settle_now(key, share, num_tokens, num_requests)

    def levels_of(self, key_id: str) -> KeyLevels | None:
        own = self._fallback.levels_of(key_id)
        if own is not None:
            return own
        seen = self._seen.get(key_id)
        return seen.levels if seen is not None else None

    async def seed(self, levels: list[KeyLevels]) -> None:
        now_s = time.monotonic()
        for key_levels in levels:
            if key_levels.key_id not in self._seen:  # buckets of our own would start from them
                self._seen[key_levels.key_id] = _Seen(key_levels, 1.0, now_s)
        try:
            await self._lower(levels, only_if_unseeded=True)
        except (RedisError, OSError) as exc:
            logger.warning("could not seed redis with the control plane's levels: %s", exc)
            return  # the next report asks again
        self._needs_levels = False
        self._start_write_back()

    async def close(self) -> None:
        if self._write_back is not None:
            self._write_back.cancel()
        await self._redis.aclose()

    def _fallback_for(self, key: ApiKey, share: float) -> LocalBuckets:
        """This process's buckets, the key's started from its levels last seen (if any)."""
        seen = self._seen.get(key.id)
        if key.id not in self._fallback and seen is not None:
            self._fallback.start_from(seen.levels, seen.share, seen.at_s)
        return self._fallback

    async def _lower(self, levels: list[KeyLevels], only_if_unseeded: bool) -> None:
        args: list[str | int] = ["1" if only_if_unseeded else "0", MAX_KEEP_MS]
        for key_levels in levels:
            args += [repr(key_levels.request_level), repr(key_levels.token_level)]
        hashes = [KEY_PREFIX + key_levels.key_id for key_levels in levels]
        await self._seed(keys=[SEEDED_KEY, *hashes], args=args)

    def _start_write_back(self) -> None:
        if self._write_back is None or self._write_back.done():
            self._write_back = asyncio.create_task(self._write_back_now())

    async def _write_back_now(self) -> None:
        """What this process took from its own buckets, into Redis (lowering only)."""
        taken = self._fallback.take_levels()
        if not taken:
            return
        try:
            await self._lower(taken, only_if_unseeded=False)
        except (RedisError, OSError):
            now_s = time.monotonic()
            for key_levels in taken:  # kept for the next time Redis answers
                self._fallback.start_from(key_levels, 1.0, now_s)
            return
        logger.info("wrote %d keys' levels taken while redis was away back to it", len(taken))

    async def _run(
        self, script: AsyncScript, key: ApiKey, share: float, num_tokens: int, num_requests: int = 0
    ) -> Any | None:
        """The script's answer, or None if Redis failed, is cooling down after a failure, or has
        lost its data."""
        now_s = time.monotonic()
        if not self._breaker.is_available(now_s):
            return None
        self._breaker.on_attempt(now_s)
        bucket: list[str | int] = [key.rpm, key.tpm, repr(share), num_tokens]
        args = [*bucket, EXPIRY_MARGIN_MS, MAX_KEEP_MS, num_requests]
        try:
            answer = await script(keys=[KEY_PREFIX + key.id, SEEDED_KEY], args=args)
        except (RedisError, OSError) as exc:
            self._on_error(exc)
            return None
        except BaseException:  # cancelled: no verdict on Redis
            self._breaker.on_abandon()
            raise
        self._on_success()
        if int(answer[0]) < 0:
            self._on_unseeded()
            return None
        self._seen[key.id] = _Seen(
            KeyLevels(key_id=key.id, request_level=float(answer[1]), token_level=float(answer[2])),
            share,
            time.monotonic(),
        )
        if len(self._fallback):  # Redis is back: what was taken meanwhile goes into it
            self._start_write_back()
        return answer

    def _on_unseeded(self) -> None:
        if not self._needs_levels:
            logger.warning(
                "redis has lost its buckets: limiting from the levels last seen until the "
                "control plane's are in"
            )
        self._needs_levels = True

    def _on_error(self, exc: Exception) -> None:
        if self._breaker.state is BreakerState.CLOSED:
            logger.warning(
                "redis unavailable: limiting in this process, from the levels last seen, until "
                "it is back: %s",
                exc,
            )
        self._breaker.on_failure(time.monotonic())

    def _on_success(self) -> None:
        if self._breaker.state is not BreakerState.CLOSED:
            logger.info("redis is back: limits are shared across the PoP again")
        self._breaker.on_success()

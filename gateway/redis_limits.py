"""Rate limits shared by every gateway process of a PoP, kept in Redis.

The same two buckets as `LocalLimiter` (see `gateway/limits.py`), one Redis hash per key, changed
only by Lua scripts: Redis runs a script atomically, so concurrent admissions from many processes
can never both take the last request or token. The scripts read Redis's own clock (`TIME`), so
the processes' clocks do not have to agree. A hash expires once both its buckets would be full
again (a missing hash reads as full buckets), so a key in debt stays in debt until it has
refilled past it, however long that takes.

If Redis cannot be reached, each process falls back to its own in-memory buckets (limits then
hold per process rather than per PoP) and says so in its log, rather than refusing all traffic.
A circuit breaker keeps it there for `cooldown_s` after a failure, so that requests do not each
wait for Redis's timeouts, then lets one request probe Redis. A request is settled in the
buckets it was admitted from, never in the other backend's.

Import this module only when shared limits are configured: `redis` is an optional dependency
(`pip install 'meridian[redis]'`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.keys import ApiKey
from gateway.limits import Admission, LocalLimiter, decide

logger = logging.getLogger(__name__)

KEY_PREFIX = "meridian:ratelimit:"
# Kept this long past the moment both buckets are full again (Redis and Lua round times).
EXPIRY_MARGIN_MS = 1000
SOCKET_TIMEOUT_S = 0.5

# Refill both buckets to Redis's clock; returns (request_level, token_level) as strings (Lua
# numbers returned to Redis are truncated to integers).
_REFILL = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local stored = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local r = tonumber(stored[1]) or rpm
local t = tonumber(stored[2]) or tpm
local elapsed = math.max(0, now - (tonumber(stored[3]) or now))
r = math.min(rpm, r + elapsed * rpm / 60)
t = math.min(tpm, t + elapsed * tpm / 60)
"""

_STORE = """
redis.call('HSET', KEYS[1], 'r', r, 't', t, 'ts', now)
local full_in = math.max((rpm - r) * 60 / rpm, (tpm - t) * 60 / tpm)
redis.call('PEXPIRE', KEYS[1], math.ceil(full_in * 1000) + tonumber(ARGV[4]))
"""

# ARGV: rpm, tpm, tokens to reserve, expiry margin ms. Returns {allowed, request_level, token_level}
# after the decision (levels before it when refused).
ADMIT_SCRIPT = (
    _REFILL
    + """
local cost = tonumber(ARGV[3])
local allowed = 0
if r >= 1 and t >= cost and cost <= tpm then
  r = r - 1
  t = t - cost
  allowed = 1
end
"""
    + _STORE
    + "return {allowed, tostring(r), tostring(t)}\n"
)

# ARGV: rpm, tpm, tokens to give back (negative: charge), expiry margin ms.
SETTLE_SCRIPT = _REFILL + "t = math.min(tpm, t + tonumber(ARGV[3]))\n" + _STORE + "return 1\n"


class RedisLimiter:
    def __init__(self, url: str, cooldown_s: float) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
        )
        self._admit = self._redis.register_script(ADMIT_SCRIPT)
        self._settle = self._redis.register_script(SETTLE_SCRIPT)
        self._fallback = LocalLimiter()
        self._breaker = CircuitBreaker("redis", max_failures=1, open_s=cooldown_s)

    async def admit(self, key: ApiKey, num_tokens: int) -> Admission:
        answer = await self._run(self._admit, key, num_tokens)
        if answer is None:
            return self._fallback.admit_now(key, num_tokens)
        allowed, request_level, token_level = answer
        levels = float(request_level), float(token_level)
        if allowed:
            admission, _, _ = decide(key, levels[0] + 1.0, levels[1] + num_tokens, num_tokens)
        else:
            admission, _, _ = decide(key, levels[0], levels[1], num_tokens)
        return replace(admission, is_shared=True)

    async def settle(self, key: ApiKey, admission: Admission, num_unused_tokens: int) -> None:
        if num_unused_tokens == 0:
            return
        if not admission.is_shared:
            self._fallback.settle_now(key, num_unused_tokens)
            return
        # While Redis is away a shared admission's settlement is lost (one request's worth):
        # settling it in this process's buckets would credit them with tokens they never gave.
        await self._run(self._settle, key, num_unused_tokens)

    async def _run(self, script: AsyncScript, key: ApiKey, num_tokens: int) -> Any | None:
        """The script's answer, or None if Redis failed or is cooling down after a failure."""
        now_s = time.monotonic()
        if not self._breaker.is_available(now_s):
            return None
        self._breaker.on_attempt(now_s)
        args = [key.rpm, key.tpm, num_tokens, EXPIRY_MARGIN_MS]
        try:
            answer = await script(keys=[KEY_PREFIX + key.id], args=args)
        except (RedisError, OSError) as exc:
            self._on_error(exc)
            return None
        except BaseException:  # cancelled: no verdict on Redis
            self._breaker.on_abandon()
            raise
        self._on_success()
        return answer

    async def close(self) -> None:
        await self._redis.aclose()

    def _on_error(self, exc: Exception) -> None:
        if self._breaker.state is BreakerState.CLOSED:
            logger.warning("redis unavailable, limiting per process until it is back: %s", exc)
        self._breaker.on_failure(time.monotonic())

    def _on_success(self) -> None:
        if self._breaker.state is not BreakerState.CLOSED:
            logger.info("redis is back: limits are shared across the PoP again")
        self._breaker.on_success()

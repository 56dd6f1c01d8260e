"""Rate limits shared by every gateway process of a PoP, kept in Redis.

The same two buckets as `LocalLimiter` (see `gateway/limits.py`), one Redis hash per key, changed
only by Lua scripts: Redis runs a script atomically, so concurrent admissions from many processes
can never both take the last request or token. The scripts read Redis's own clock (`TIME`), so
the processes' clocks do not have to agree. Hashes expire after two idle minutes (by then both
buckets are full again and need not be stored).

If Redis cannot be reached, each process falls back to its own in-memory buckets (limits then
hold per process rather than per PoP) and says so in its log, rather than refusing all traffic.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.keys import ApiKey
from gateway.limits import Admission, LocalLimiter, decide

logger = logging.getLogger(__name__)

KEY_PREFIX = "meridian:ratelimit:"
IDLE_EXPIRY_MS = 120_000
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
redis.call('PEXPIRE', KEYS[1], ARGV[4])
"""

# ARGV: rpm, tpm, tokens to reserve, expiry ms. Returns {allowed, request_level, token_level}
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

# ARGV: rpm, tpm, tokens to give back (negative: charge), expiry ms.
SETTLE_SCRIPT = _REFILL + "t = math.min(tpm, t + tonumber(ARGV[3]))\n" + _STORE + "return 1\n"


class RedisLimiter:
    def __init__(self, url: str) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
        )
        self._admit = self._redis.register_script(ADMIT_SCRIPT)
        self._settle = self._redis.register_script(SETTLE_SCRIPT)
        self._fallback = LocalLimiter()
        self._is_degraded = False

    async def admit(self, key: ApiKey, num_tokens: int) -> Admission:
        args = [key.rpm, key.tpm, num_tokens, IDLE_EXPIRY_MS]
        try:
            allowed, request_level, token_level = await self._admit(
                keys=[KEY_PREFIX + key.id], args=args
            )
        except (RedisError, OSError) as exc:
            self._on_error(exc)
            return self._fallback.admit_now(key, num_tokens)
        self._on_success()
        levels = float(request_level), float(token_level)
        if allowed:
            admission, _, _ = decide(key, levels[0] + 1.0, levels[1] + num_tokens, num_tokens)
        else:
            admission, _, _ = decide(key, levels[0], levels[1], num_tokens)
        return admission

    async def settle(self, key: ApiKey, num_unused_tokens: int) -> None:
        if num_unused_tokens == 0:
            return
        args = [key.rpm, key.tpm, num_unused_tokens, IDLE_EXPIRY_MS]
        try:
            await self._settle(keys=[KEY_PREFIX + key.id], args=args)
        except (RedisError, OSError) as exc:
            self._on_error(exc)
            self._fallback.settle_now(key, num_unused_tokens)
            return
        self._on_success()

    async def close(self) -> None:
        await self._redis.aclose()

    def _on_error(self, exc: Exception) -> None:
        if not self._is_degraded:
            logger.warning("redis unavailable, limiting per process until it is back: %s", exc)
            self._is_degraded = True

    def _on_success(self) -> None:
        if self._is_degraded:
            logger.info("redis is back: limits are shared across the PoP again")
            self._is_degraded = False

"""The Lua scripts that change a PoP's buckets in Redis (`gateway/redis_limits.py`).

One hash per key: `r` and `t` (the request and token levels), `ts` (Redis's clock when last
changed, so that the gateways' clocks need not agree) and `s` (the PoP's share of the key it was
last changed with). Redis runs a script atomically, so concurrent admissions from many processes
can never both take the last request or token. A missing hash reads as full buckets; a hash
expires only once it would be full even at the key's whole limits (at its share's rate), so a
bucket in debt stays in debt until it has refilled past it, and a share that grows while a key
is idle never turns an old level into a full bucket.

Every bucket script first checks the marker key (`SEEDED_KEY`): Redis without it has lost its
data (a restart without persistence) or is new, and its missing hashes would read as full
buckets, forgiving every debt. The script then answers `{-1}` and changes nothing, until the
gateway has written the levels the control plane knows (`SEED_SCRIPT`), which sets the marker.
"""

from __future__ import annotations

from typing import Final

KEY_PREFIX: Final = "meridian:ratelimit:"
SEEDED_KEY: Final = "meridian:ratelimits-seeded"
# Kept this long past the moment the buckets are full again (Redis and Lua round times).
EXPIRY_MARGIN_MS: Final = 1000
# A bucket's hash is never kept longer than this (a tiny share refills very slowly).
MAX_KEEP_MS: Final = 24 * 3600 * 1000

# `levels(hash, rpm, tpm, share, now)`: both buckets refilled to `now`, at the lower of the
# stored share and `share`, and capped at `share` of the key. `store(...)`: write them back.
# Levels go back to Redis as strings (Lua numbers returned to Redis are truncated to integers).
_FUNCTIONS = """
local function clock()
  local time = redis.call('TIME')
  return tonumber(time[1]) + tonumber(time[2]) / 1000000
end
local function levels(hash, rpm, tpm, share, now)
  local stored = redis.call('HMGET', hash, 'r', 't', 'ts', 's')
  local r = tonumber(stored[1]) or rpm * share
  local t = tonumber(stored[2]) or tpm * share
  local elapsed = math.max(0, now - (tonumber(stored[3]) or now))
  local grown = elapsed * math.min(share, tonumber(stored[4]) or share) / 60
  return math.min(rpm * share, r + grown * rpm), math.min(tpm * share, t + grown * tpm)
end
local function store(hash, r, t, rpm, tpm, share, now, margin_ms, max_keep_ms)
  redis.call('HSET', hash, 'r', r, 't', t, 'ts', now, 's', share)
  local keep_ms = max_keep_ms
  if share > 0 then
    local full_in = math.max((rpm - r) / rpm, (tpm - t) / tpm) * 60 / share
    keep_ms = math.min(max_keep_ms, math.ceil(full_in * 1000) + margin_ms)
  end
  redis.call('PEXPIRE', hash, keep_ms)
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  return {-1}
end
local now = clock()
local rpm, tpm, share = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r, t = levels(KEYS[1], rpm, tpm, share, now)
"""

_STORE = "store(KEYS[1], r, t, rpm, tpm, share, now, tonumber(ARGV[5]), tonumber(ARGV[6]))\n"

# KEYS: the key's hash, SEEDED_KEY. ARGV: rpm, tpm, share, tokens to reserve, expiry margin ms,
# longest keep ms. Returns {allowed, request_level, token_level} after the decision (levels
# before it when refused), or {-1}.
ADMIT_SCRIPT: Final = (
    _FUNCTIONS
    + """
local cost = tonumber(ARGV[4])
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

# As ADMIT_SCRIPT, ARGV[4] the tokens to give back (negative: charge), ARGV[7] the requests (an
# admission undone: 1). Returns {1, r, t} or {-1}.
SETTLE_SCRIPT: Final = (
    _FUNCTIONS
    + "t = math.min(tpm * share, t + tonumber(ARGV[4]))\n"
    + "r = math.min(rpm * share, r + tonumber(ARGV[7]))\n"
    + _STORE
    + "return {1, tostring(r), tostring(t)}\n"
)

# Lower keys' levels to the ones given (as of now), where they are lower. KEYS: SEEDED_KEY, then
# the keys' hashes. ARGV: "1" to do it only if Redis has no marker (and then set it), "0" to do
# it anyway (the marker untouched); the longest keep ms; then a request level and a token
# level per hash. A hash's refill since it was last changed is not counted (it restarts from
# now): the lower choice. Returns 1 if written, 0 if the marker was there.
SEED_SCRIPT: Final = """
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
for i = 2, #KEYS do
  local r = tonumber(ARGV[2 * i - 1])
  local t = tonumber(ARGV[2 * i])
  local stored = redis.call('HMGET', KEYS[i], 'r', 't')
  r = math.min(r, tonumber(stored[1]) or r)
  t = math.min(t, tonumber(stored[2]) or t)
  redis.call('HSET', KEYS[i], 'r', tostring(r), 't', tostring(t), 'ts', now)
  redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[2]))
end
if ARGV[1] == '1' then
  redis.call('SET', KEYS[1], '1')
end
return 1
"""

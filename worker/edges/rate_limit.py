"""A rate limit per backend shared by every worker of the fleet: at most N requests and T
tokens in any window of W seconds (a sliding log in Redis, checked and taken atomically). The
window's token total is kept as a running sum, added to as entries come and taken from as they
leave, so an acquire costs the same with 10 or 10,000 calls in the window.

A round that finds no room is not run: its task is retried when room is expected, so a
waiting session holds no worker slot (the caller raises RetryLater). Token use is reserved
from an estimate before the call and corrected to the real usage after it.
"""

from __future__ import annotations

import uuid
from typing import Any

import redis

from schemas import fleet_keys
from worker.config import BackendConfig
from worker.edges.redis_errors import store_error
from worker.session.ports import Permit

# KEYS: requests zset (member -> time), tokens hash (member -> tokens), tokens total
# ARGV: window, max_requests (0 = none), max_tokens (0 = none), member, tokens, ttl
# The time is Redis's own, so workers on machines with skewed clocks agree on the window.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
local max_req, max_tok = tonumber(ARGV[2]), tonumber(ARGV[3])
local member, tokens, ttl = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
if #old > 0 then  -- each entry leaves once: amortised O(1)
  local gone = 0
  for _, v in ipairs(redis.call('HMGET', KEYS[2], unpack(old))) do
    gone = gone + (tonumber(v) or 0)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  redis.call('HDEL', KEYS[2], unpack(old))
  redis.call('DECRBY', KEYS[3], gone)
end
local count = redis.call('ZCARD', KEYS[1])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local full = (max_req > 0 and count >= max_req)
  or (max_tok > 0 and count > 0 and used + tokens > max_tok)
if full then
  -- room comes back when the oldest entry leaves the window
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(tonumber(first[2]) + window - now)
end
redis.call('ZADD', KEYS[1], now, member)
redis.call('HSET', KEYS[2], member, tokens)
redis.call('INCRBY', KEYS[3], tokens)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return 'ok'
"""

# KEYS: tokens hash, tokens total; ARGV: member, the tokens it really used
_SETTLE = """
local before = redis.call('HGET', KEYS[1], ARGV[1])
if not before then return 0 end  -- it has left the window already
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCRBY', KEYS[2], tonumber(ARGV[2]) - tonumber(before))
return 1
"""


class RedisRateLimiter:
    def __init__(self, client: redis.Redis) -> None:
        self.client: Any = client
        self._acquire = self.client.register_script(_ACQUIRE)
        self._settle = self.client.register_script(_SETTLE)

    def acquire(self, backend: BackendConfig, estimated_tokens: int) -> Permit | float:
        """A permit, or the seconds to wait before there may be room."""
        if not backend.requests_per_minute and not backend.tokens_per_minute:
            return Permit(backend.name, "")
        member = uuid.uuid4().hex
        try:
            answer = self._acquire(
                keys=[
                    fleet_keys.rate_requests(backend.name),
                    fleet_keys.rate_tokens(backend.name),
                    fleet_keys.rate_total(backend.name),
                ],
                args=[
                    backend.rate_window_s,
                    backend.requests_per_minute or 0,
                    backend.tokens_per_minute or 0,
                    member,
                    max(estimated_tokens, 0),
                    int(backend.rate_window_s) + 60,
                ],
            )
        except redis.RedisError as exc:
            raise store_error(exc, "rate limit") from exc
        text = answer.decode() if isinstance(answer, bytes) else str(answer)
        return Permit(backend.name, member) if text == "ok" else max(float(text), 0.05)

    def settle(self, permit: Permit, used_tokens: int) -> None:
        """Replace the estimate with what the call really used."""
        if not permit.member:
            return
        try:
            self._settle(
                keys=[
                    fleet_keys.rate_tokens(permit.backend),
                    fleet_keys.rate_total(permit.backend),
                ],
                args=[permit.member, max(used_tokens, 0)],
            )
        except redis.RedisError as exc:
            raise store_error(exc, "rate limit") from exc

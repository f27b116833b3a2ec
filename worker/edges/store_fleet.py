"""What the fleet asks of Redis beside a session's steps, a part of RedisStore: the reconciler's
queries (its turn, the sessions showing no progress, when they were submitted, now on Redis's
clock), background tasks' state, the bookkeeping of calls waiting under max_parallel, and
modules' bytes."""

from __future__ import annotations

import os
from typing import Any

from schemas import fleet_keys, keys
from schemas.fleet_clock import FleetClock
from schemas.redis_memory import RedisMemory
from worker.edges.step_leases import translated
from worker.errors import StoreError


class FleetQueries:
    """A part of RedisStore (which sets `client` and `ttl_s`)."""

    client: Any
    ttl_s: int
    clock: FleetClock

    @translated
    def memory(self) -> RedisMemory:
        """Redis's memory limit, use and eviction policy (INFO: allowed where CONFIG is not)."""
        return RedisMemory.of(self.client)

    # the reconciler ------------------------------------------------------------------------

    def now_ms(self) -> int:
        """Now on Redis's clock (the one every mark of progress and submit is stamped on)."""
        return self.clock.now_ms()

    @translated
    def take_reconciler_turn(self, hold_ms: int) -> bool:
        """Whether this process reconciles now: one in the fleet at a time, for `hold_ms`."""
        return bool(self.client.set(fleet_keys.RECONCILER_LOCK, os.getpid(), nx=True, px=hold_ms))

    @translated
    def stalled(self, quiet_ms: int, most: int) -> list[str]:
        """Unfinished sessions with no sign of progress for `quiet_ms`, oldest first; each is
        marked as just seen, so the next turns look at others first."""
        now = self.clock.now_ms()
        found = [
            sk.decode() for sk in self.client.zrangebyscore(keys.ACTIVE, 0, now - quiet_ms, 0, most)
        ]
        if found:
            self.client.zadd(keys.ACTIVE, dict.fromkeys(found, now), xx=True)
        return found

    @translated
    def submitted_ms(self, sks: list[str]) -> list[int | None]:
        pipe = self.client.pipeline(transaction=False)
        for sk in sks:
            pipe.hget(keys.meta(sk), "submitted_ms")
        return [None if raw is None else int(raw) for raw in pipe.execute()]

    @translated
    def forget_session(self, sk: str) -> None:
        """Not to be watched any more (its spec expired: nothing left to recover); its trace
        stream, which gets its TTL when its session ends, gets it now."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(keys.ACTIVE, sk)
        pipe.expire(keys.trace(sk), self.ttl_s)
        pipe.execute()

    @translated
    def trim_results(self, keep: int) -> int:
        """The results (record, response fd) of the finished sessions beyond the latest `keep`
        deleted: how many."""
        beyond = int(self.client.zcard(keys.FINISHED)) - keep
        if beyond <= 0:
            return 0
        oldest = [sk.decode() for sk in self.client.zrange(keys.FINISHED, 0, beyond - 1)]
        pipe = self.client.pipeline(transaction=False)
        for sk in oldest:
            pipe.delete(keys.record(sk))
            pipe.delete(keys.response(sk))
        pipe.zrem(keys.FINISHED, *oldest)
        pipe.execute()
        return len(oldest)

    # background tasks ----------------------------------------------------------------------

    @translated
    def task_state(self, sk: str, task_id: str) -> dict[str, str] | None:
        raw = self.client.hgetall(keys.task(sk, task_id))
        return {k.decode(): v.decode() for k, v in raw.items()} or None

    @translated
    def update_task(self, sk: str, task_id: str, fields: dict[str, str]) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.task(sk, task_id), mapping=fields)
        pipe.expire(keys.task(sk, task_id), self.ttl_s)
        pipe.execute()

    # calls waiting under max_parallel ------------------------------------------------------

    @translated
    def unstarted_calls(self, sk: str, round_no: int, calls: int) -> tuple[list[int], int]:
        # one MGET: every call's outcome key, its queued mark, its step's state
        names = [
            name
            for i in range(calls)
            for name in (
                keys.tool_out(sk, round_no, i),
                keys.tool_queued(sk, round_no, i),
                keys.step_state(keys.tool_step(sk, round_no, i)),
            )
        ]
        values = self.client.mget(names)
        waiting, placed = [], 0
        for i in range(calls):
            out, queued, state = values[3 * i : 3 * i + 3]
            if out is not None:
                continue
            if queued is None and state is None:
                waiting.append(i)
            else:
                placed += 1
        return waiting, placed

    @translated
    def queue_calls(self, sk: str, round_no: int, indexes: list[int], claim: bool) -> list[int]:
        if not indexes:
            return []
        pipe = self.client.pipeline(transaction=False)
        for i in indexes:
            pipe.set(keys.tool_queued(sk, round_no, i), 1, nx=claim, ex=self.ttl_s)
        return [i for i, won in zip(indexes, pipe.execute(), strict=True) if won]

    # modules -------------------------------------------------------------------------------

    @translated
    def module_bytes(self, sha256: str) -> bytes:
        data = self.client.get(keys.module(sha256))
        if data is None:
            raise StoreError(f"module {sha256[:12]} not in Redis (expired or never uploaded)")
        return bytes(data)

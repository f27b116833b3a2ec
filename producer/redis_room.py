"""Room in Redis for a submission: `cchatq submit` reads Redis's memory (`INFO memory`, which
a managed Redis answers where it forbids CONFIG GET) before it enqueues, and enqueues only the
sessions whose keys fit until they end. A Redis whose maxmemory-policy may evict cchatq's keys
is refused (schemas/redis_memory.py). Without a maxmemory nothing more is checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import redis

from schemas.redis_memory import (
    RedisMemory,
    allow_eviction,
    eviction_refused,
    eviction_warning,
    mb,
)

# What one session needs in Redis until it ends: nothing of it expires before the result TTL,
# so that is what it leaves when it ended. Measured (a private Redis, the replay server, 500
# sessions a run; used_memory after MEMORY PURGE before the submit and once all had ended):
#   no tool, one round:     spec line 151 B -> 8.2 KB; 2.1 KB -> 22.5 KB; 8.3 KB -> 66 KB
#   a tool, two rounds:     spec line 452 B -> 12.5 KB; 2.45 KB -> 37.6 KB
# A fixed part (meta, watchers, step markers and tries, the trace stream's entries, the
# broker's messages while they wait) and a part proportional to the spec: the spec itself,
# then the record's transcript and each round's reply, tool outcome and response, which on
# the replay server echo the prompt (conservative: a model rarely answers with the whole
# prompt again). Per spec byte: 7.1 for one round, 12.6 for a tool's two rounds.
# The broker's messages are gone once a session ended, but every session of a submit has one
# waiting at once (its chunk's start task publishes all their first rounds): ~1.3 KB each.
SESSION_FIXED_BYTES = 7_200 + 1_500
SPEC_BYTES_FIXED = 1.5  # per spec byte: the spec, its meta's copy, the record's transcript
SPEC_BYTES_PER_ROUND = 5.6  # per spec byte and round: reply, outcome, response, trace
JOINED_BYTES = 300  # a session joining a run that exists: one watcher entry
# Left free for what the fleet writes beside the sessions (its trace stream, rate control,
# consumers' bookkeeping) and for sessions running more rounds than estimated.
RESERVE_BYTES = 2 * 1024 * 1024
RESERVE_SHARE = 0.05  # of maxmemory, when more than RESERVE_BYTES


def session_bytes(spec_bytes: int, tools: bool) -> int:
    """What a session whose stored spec is `spec_bytes` long needs until it ends: one round
    without tools, two with."""
    rounds = 2 if tools else 1
    return int(
        SESSION_FIXED_BYTES + spec_bytes * (SPEC_BYTES_FIXED + SPEC_BYTES_PER_ROUND * rounds)
    )


def reserve_bytes(memory: RedisMemory) -> int:
    return max(RESERVE_BYTES, int(memory.maxmemory_bytes * RESERVE_SHARE))


def read_memory(client: Any) -> RedisMemory:
    """Redis's memory; a Redis whose ACL forbids even INFO is taken as one without a limit
    (nothing can be checked: its own refusals still end the submit in one line)."""
    try:
        return RedisMemory.of(client)
    except redis.exceptions.NoPermissionError:
        return RedisMemory(0, 0, "noeviction")


class EvictingRedisError(Exception):
    """Redis's maxmemory-policy may evict cchatq's keys: nothing was enqueued."""


@dataclass
class RedisFullError(Exception):
    """Only `enqueued` of `total` sessions went in: Redis had no room for the rest (`midway`:
    it refused a write while they were enqueued). `submission` is what went in (None when
    nothing did): those sessions run, and join their runs when the same file is submitted
    again."""

    where: str
    memory: RedisMemory
    enqueued: int
    total: int
    midway: bool = False
    submission: Any = field(default=None, repr=False)

    def __str__(self) -> str:
        m = self.memory
        if self.midway:
            why = f"Redis at {self.where} refused writes while enqueuing ({mb(m.used_bytes)} used"
            why += f" of maxmemory {mb(m.maxmemory_bytes)})" if m.limited else ")"
        else:
            why = (
                f"Redis at {self.where} has {mb(m.free_bytes)} free of maxmemory"
                f" {mb(m.maxmemory_bytes)} ({mb(m.used_bytes)} used)"
            )
        then = f" (the {self.enqueued:,} join their runs)" if self.enqueued else ""
        return (
            f"cchatq: {why}: enqueued {self.enqueued:,} of {self.total:,} sessions; free memory"
            f" or raise maxmemory, then submit the same file again{then}"
        )


def check_policy(memory: RedisMemory, where: str, env: dict[str, str]) -> str | None:
    """EvictingRedisError for an evicting Redis, unless the override is set: then the warning
    to show (None: nothing to say)."""
    if not memory.evicts:
        return None
    if not allow_eviction(env):
        raise EvictingRedisError(eviction_refused(memory, where, "cchatq"))
    return eviction_warning(memory, where)


def fitting(memory: RedisMemory, costs: list[int], pipeline_bytes: int = 0) -> int:
    """How many of the sessions, in input order, fit in what Redis has free, less its
    reserve and `pipeline_bytes`: what the submit's largest round trip holds in Redis's
    query buffer while it runs (twice its specs' bytes: measured, a 2 KB-prompt submit at
    24 MB peaked 5 MB over what its sessions left). All of them without a maxmemory."""
    if not memory.limited:
        return len(costs)
    room = memory.free_bytes - reserve_bytes(memory) - pipeline_bytes
    for count, cost in enumerate(costs):
        room -= cost
        if room < 0:
            return count
    return len(costs)


MISCONF = re.compile(r"(?:^|caused error: )MISCONF\b")


def refused_write(exc: redis.RedisError) -> bool:
    """Redis refused a write for now: OOM (full under noeviction), MISCONF (it cannot persist),
    READONLY (a replica), LOADING."""
    word = "LOADING" if isinstance(exc, redis.exceptions.BusyLoadingError) else ""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        word = "OOM"
    elif isinstance(exc, redis.exceptions.ReadOnlyError):
        word = "READONLY"
    elif isinstance(exc, redis.ResponseError) and MISCONF.search(str(exc)):
        word = "MISCONF"  # at its start, or after redis-py's "... of pipeline caused error: "
    return bool(word)

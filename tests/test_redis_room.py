"""What `cchatq submit` lets into a Redis with a memory limit (producer/redis_room.py), and
the eviction-policy rule the producer and the workers share (schemas/redis_memory.py): pure,
no Redis."""

from __future__ import annotations

import pytest

from producer.redis_room import (
    EvictingRedisError,
    RedisFullError,
    check_policy,
    fitting,
    reserve_bytes,
    session_bytes,
)
from schemas.redis_memory import MB, RedisMemory

FULL_24 = RedisMemory(24 * MB, 2 * MB, "noeviction")


def test_without_a_maxmemory_everything_fits_and_nothing_is_said() -> None:
    unlimited = RedisMemory(0, 900 * MB, "allkeys-lru")
    assert fitting(unlimited, [10**9] * 5) == 5
    assert not unlimited.evicts
    assert check_policy(unlimited, "redis://h", {}) is None


def test_only_the_sessions_that_fit_with_the_reserve_go_in_in_input_order() -> None:
    cost = session_bytes(2150, tools=False)
    room = FULL_24.free_bytes - reserve_bytes(FULL_24)
    assert fitting(FULL_24, [cost] * 3000) == room // cost
    assert fitting(FULL_24, [cost] * 3000, pipeline_bytes=4 * MB) == (room - 4 * MB) // cost
    assert fitting(FULL_24, [room + 1, 1, 1]) == 0  # a prefix: the first that does not fit ends it


def test_a_session_with_tools_needs_more_than_one_without() -> None:
    assert session_bytes(2000, tools=True) > session_bytes(2000, tools=False) > 2000 * 7


def test_the_one_line_names_the_limit_what_is_used_and_free_and_what_to_do() -> None:
    line = str(RedisFullError("redis://127.0.0.1:6390/0", FULL_24, 412, 3000))
    assert line == (
        "cchatq: Redis at redis://127.0.0.1:6390/0 has 22 MB free of maxmemory 24 MB (2 MB"
        " used): enqueued 412 of 3,000 sessions; free memory or raise maxmemory, then submit"
        " the same file again (the 412 join their runs)"
    )
    assert "\n" not in str(RedisFullError("r", FULL_24, 0, 3000, midway=True))


@pytest.mark.parametrize(
    "policy", ["volatile-lru", "volatile-ttl", "allkeys-lru", "allkeys-random"]
)
def test_a_policy_that_may_evict_is_refused_unless_allowed(policy: str) -> None:
    memory = RedisMemory(24 * MB, MB, policy)
    with pytest.raises(EvictingRedisError) as refused:
        check_policy(memory, "redis://h:1/0", {})
    assert policy in str(refused.value)
    assert "CONFIG SET maxmemory-policy noeviction" in str(refused.value)
    warning = check_policy(memory, "redis://h:1/0", {"CCHATQ_ALLOW_EVICTION": "1"})
    assert warning is not None and warning.startswith("WARNING") and policy in warning

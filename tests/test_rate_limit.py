"""A backend's static rate limit (`adaptive: false`) is shared by every worker of the fleet (in
Redis): with two llm worker processes the provider never sees more than N requests in any
window, and sessions waiting for room hold no worker slot."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.replay import ReplayServer
from producer.fleet import Fleet, replay_backends
from schemas import fleet_keys, keys
from tests.conftest import Running, _workers
from tests.test_pipeline import submit_specs

pytestmark = pytest.mark.fleet

LIMIT = 4
WINDOW_S = 2.0
JITTER_S = 0.1  # between the limiter admitting a call and the server seeing it


@pytest.fixture()
def limited(base_fleet: Fleet) -> Iterator[tuple[Running, ReplayServer]]:
    replay = ReplayServer().start()
    backends = {
        **replay_backends(base_fleet.replay_url),
        "limited": {
            "base_url": replay.url,
            "adaptive": False,
            "requests_per_minute": LIMIT,
            "rate_window_s": WINDOW_S,
        },
    }
    env = {"CCHATQ_BACKENDS": json.dumps({"backends": backends})}
    fleet = _workers(base_fleet, db=5, extra_env=env)
    try:
        running = next(fleet)
        # a second llm worker process, with few slots: waiting sessions must not fill them
        running.fleet.start_worker("llm", concurrency=2, extra_env=env)
        yield running, replay
    finally:
        fleet.close()
        replay.stop()


def test_shared_limit_holds_across_two_worker_processes(
    limited: tuple[Running, ReplayServer], tmp_path: Path, fresh_id: str
) -> None:
    running, replay = limited
    specs = [
        {"id": f"{fresh_id}/lim/{n}", "provider": "limited", "model": "replay/plain",
         "messages": [{"role": "user", "content": f"limited {n}"}]}
        for n in range(14)
    ]  # fmt: skip
    free = {"id": f"{fresh_id}/free", "provider": "replay-openai", "model": "replay/plain",
            "messages": [{"role": "user", "content": "not limited"}]}  # fmt: skip
    sub = submit_specs(running.client, specs, tmp_path, "limited.jsonl")
    free_sub = submit_specs(running.client, [free], tmp_path, "free.jsonl")
    (free_record,) = dict(running.client.wait(free_sub, timeout_s=30)).values()
    pending = running.client.records(sub.order)
    records = dict(running.client.wait(sub, timeout_s=60))
    assert all(r["status"] == "ok" for r in records.values()), records
    assert free_record["status"] == "ok"
    # waiting sessions gave their worker slots back: the free one did not queue behind them
    assert sum(r is None for r in pending) >= len(specs) - 2 * LIMIT
    arrivals = sorted(replay.stats()["arrivals"])
    assert len(arrivals) == len(specs)
    busiest = max(sum(1 for t in arrivals if a <= t < a + WINDOW_S - JITTER_S) for a in arrivals)
    assert busiest <= LIMIT, arrivals
    # the limit really bit: 14 calls at 4 per window cannot all fit in the first ones
    assert arrivals[-1] - arrivals[0] >= 3 * WINDOW_S - JITTER_S
    # each put-off round is a rate_limit.waited event (ids and times only), in the fleet's
    # stream (the metrics) and its session's, which has its TTL
    redis = running.client.redis
    events = [e for _, fields in redis.xrange(keys.TRACE) for e in keys.trace_events(fields)]
    waits = [e for e in events if e["event"] == "rate_limit.waited"]
    assert len(waits) >= len(specs) - 2 * LIMIT, waits
    assert {(e["backend"], e["kind"]) for e in waits} == {("limited", "round")}
    assert all(0 < e["wait_ms"] <= WINDOW_S * 1000 for e in waits)
    assert {e["session"] for e in waits} <= {s["id"] for s in specs}
    # ids, codes and times only: with how the put-off step ran (its worker, its delivery and,
    # when its sender stamped it, how long its message waited)
    plain = {"event", "session", "ts_ms", "kind", "backend", "wait_ms"}
    ran = {"worker", "delivery", "queue_ms"}
    assert all(plain <= set(e) <= plain | ran for e in waits), waits
    assert all(e["worker"] and e["delivery"] >= 1 for e in waits)
    sk = str(running.client.session_key(waits[0]["session"]))  # retired: its trace in its record
    assert redis.ttl(keys.record(sk)) > 0 and not redis.exists(keys.trace(sk))


def test_the_token_window_is_a_running_total(base_fleet: Fleet) -> None:
    """Issue 10, point 8: the window's tokens are summed as entries come, are settled and
    leave, not by reading every entry on each acquire."""
    import redis

    from tests.test_pipeline import wait_for
    from worker.config import BackendConfig
    from worker.edges.rate_limit import RedisRateLimiter
    from worker.session.ports import Permit

    client = redis.Redis.from_url(base_fleet.redis_url.rsplit("/", 1)[0] + "/11")
    client.flushdb()
    limiter = RedisRateLimiter(client)
    backend = BackendConfig(name="rt", tokens_per_minute=100, rate_window_s=1.0)
    first, second = limiter.acquire(backend, 40), limiter.acquire(backend, 40)
    assert isinstance(first, Permit) and isinstance(second, Permit)
    assert not isinstance(limiter.acquire(backend, 40), Permit)  # 120 > 100: wait
    limiter.settle(first, 10)  # it used less than estimated
    assert int(client.get(fleet_keys.rate_total("rt")) or 0) == 50
    assert isinstance(limiter.acquire(backend, 40), Permit)  # 90 <= 100
    # once the window has passed, every entry has left it and taken its tokens along (the
    # probes themselves ask for 0 tokens)
    wait_for(
        lambda: (
            isinstance(limiter.acquire(backend, 0), Permit)
            and int(client.get(fleet_keys.rate_total("rt")) or 0) == 0
        )
    )
    client.flushdb()

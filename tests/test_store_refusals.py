"""A Redis that refuses writes for now (full, failing to persist, a replica, loading), on the
twins: a step waits in its worker and runs again as the same try, however long it lasts;
a failure of another kind still spends its tries (tests/test_steps.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from schemas import keys
from tests.test_engine import WEATHER_FN
from tests.test_steps import SK, WEATHER_SCRIPT, Pipeline, pipeline, spec, submit
from worker.edges.redis_errors import refusal, store_error
from worker.errors import StoreError, StoreUnavailableError
from worker.session.refusals import STOPPING
from worker.session.twins.failing import RefusingStore
from worker.session.twins.store import MemoryStore

MAX_ATTEMPTS = 3  # test_steps.pipeline's settings


def refusing(method: str, times: int, reason: str = "OOM", budget_s: float = 180.0) -> Pipeline:
    """A weather session whose store refuses `method` its first `times` calls; the guard's
    pauses are recorded, not slept."""
    failing: list[RefusingStore] = []

    def wrap(memory: MemoryStore) -> RefusingStore:
        failing.append(RefusingStore(memory, reason, **{method: times}))
        return failing[0]

    p = pipeline(WEATHER_SCRIPT * 5, store=wrap)  # a model call again for each run of a round
    guard = p.runner.guard
    guard.settings = replace(guard.settings, store_wait_s=budget_s)
    p.paused = []  # type: ignore[attr-defined]
    guard.sleep = p.paused.append  # type: ignore[attr-defined]
    p.failing = failing[0]  # type: ignore[attr-defined]
    submit(p, spec(WEATHER_FN))
    return p


def assert_ended_ok(p: Pipeline) -> None:
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert p.store.deadletters == []
    assert list(p.store.done["b"]) == [SK]


@pytest.mark.parametrize("reason", ["OOM", "MISCONF", "READONLY", "LOADING"])
def test_a_refused_commit_waits_in_the_worker_and_is_written_again_as_the_same_try(
    reason: str,
) -> None:
    """More refusals than the step has tries: it waits, with growing pauses, then writes
    its commit again; its tool ran once, no try was spent, no retry went through the queue."""
    times = MAX_ATTEMPTS + 3
    p = refusing("store_tool_outcomes", times, reason)
    p.drain()
    assert_ended_ok(p)
    assert p.failing.raised == ["store_tool_outcomes"] * times  # type: ignore[attr-defined]
    assert len(p.tools.calls) == 1  # the body is not run again for a refused commit
    assert p.queue.retries == 0
    assert p.store.tries[keys.tool_step(SK, 0, 0)] == 1
    paused = p.paused  # type: ignore[attr-defined]
    assert len(paused) == times and paused == sorted(paused) and paused[-1] <= 4.0


def test_a_refused_write_in_the_body_runs_the_body_again_without_spending_a_try() -> None:
    """The round's reply could not be stored: the round runs again (its model call too: the
    reply was never stored), as the same try."""
    times = MAX_ATTEMPTS + 2
    p = refusing("store_round", times)
    p.drain()
    assert_ended_ok(p)
    assert p.queue.retries == 0
    assert p.store.tries[keys.round_step(SK, 0)] == 1
    assert len(p.provider.requests) == 2 + times


def test_a_refused_start_waits_for_its_lease_and_counts_one_try() -> None:
    p = refusing("begin_step", MAX_ATTEMPTS + 2)
    p.drain()
    assert_ended_ok(p)
    assert p.queue.retries == 0
    assert p.store.tries[keys.round_step(SK, 0)] == 1


def test_a_refusal_outlasting_the_wait_hands_the_step_back_uncounted() -> None:
    """Past settings.store_wait_s the delivery goes back to the queue (Celery's retry), its
    try given back: refused on more deliveries than the step has tries, it still is not
    dead-lettered, and the session ends ok once Redis takes writes."""
    p = refusing("store_tool_outcomes", 4 * MAX_ATTEMPTS, budget_s=1.0)
    p.drain()
    assert_ended_ok(p)
    assert p.queue.retries >= MAX_ATTEMPTS
    assert p.store.tries[keys.tool_step(SK, 0, 0)] == 1
    assert len(p.tools.calls) == p.queue.retries + 1  # each delivery ran it, none counted


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
         "OOM"),
        (redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device"),
         "MISCONF"),
        (redis.ResponseError("Command # 1 (SET k v EX 15) of pipeline caused error: MISCONF "
                             "Errors writing to the AOF file"), "MISCONF"),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
         "READONLY"),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), "LOADING"),
        (redis.ResponseError("WRONGTYPE Operation against a key"), None),
        (redis.ConnectionError("Connection refused"), None),
    ],
)  # fmt: skip
def test_redis_refusals_are_translated_once_into_store_unavailable(
    error: redis.RedisError, reason: str | None
) -> None:
    assert refusal(error) == reason
    translated = store_error(error, "store")
    assert isinstance(translated, StoreError)
    assert isinstance(translated, StoreUnavailableError) == (reason is not None)
    if isinstance(translated, StoreUnavailableError):
        assert translated.reason == reason


def test_a_stopping_worker_hands_a_refused_step_back_at_once() -> None:
    """A warm shutdown does not wait out the refusal: the step goes back uncounted."""
    p = refusing("store_tool_outcomes", 1)
    STOPPING.set()
    try:
        p.drain()
    finally:
        STOPPING.clear()
    assert_ended_ok(p)
    assert p.paused == []  # type: ignore[attr-defined]
    assert p.queue.retries == 1
    assert p.store.tries[keys.tool_step(SK, 0, 0)] == 1

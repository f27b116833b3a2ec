"""A Redis that refuses writes for now (full, failing to persist, a replica, loading), on the
twins: a step waits in its worker and runs again as the same try, however long it lasts;
a failure of another kind still spends its tries (tests/test_steps.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import redis

from schemas import keys
from tests.test_engine import WEATHER_FN
from tests.test_steps import SK, WEATHER_SCRIPT, Pipeline, pipeline, spec, submit
from worker.edges.redis_errors import refusal, store_error
from worker.errors import (
    ProviderRetryableError,
    StoreError,
    StoreUnavailableError,
    StoreUnreachableError,
)
from worker.session.refusals import STOPPING
from worker.session.twins.failing import FailingStore, RefusingStore, UnreachableStore
from worker.session.twins.store import MemoryStore

MAX_ATTEMPTS = 3  # test_steps.pipeline's settings


def refusing(
    method: str,
    times: int,
    reason: str = "OOM",
    budget_s: float = 180.0,
    store: type[FailingStore] = RefusingStore,
    script: list[Any] | None = None,
) -> Pipeline:
    """A weather session whose store refuses `method` its first `times` calls (or, with
    `store=UnreachableStore`, does not answer them); the pauses are recorded, not slept."""
    failing: list[FailingStore] = []

    def wrap(memory: MemoryStore) -> FailingStore:
        made = (
            RefusingStore(memory, reason, **{method: times})
            if store is RefusingStore
            else store(memory, **{method: times})
        )
        failing.append(made)
        return made

    # a model call again for each run of a round
    p = pipeline(script if script is not None else WEATHER_SCRIPT * 5, store=wrap)
    guard = p.runner.guard
    guard.settings = replace(guard.settings, store_wait_s=budget_s)
    p.runner.settings = guard.settings  # the round's own wait for its reply's write
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


def test_a_refused_reply_is_kept_and_written_again_without_a_second_model_call() -> None:
    """The round's reply could not be stored: it is written again in place, as the same try,
    and its model call is not made twice."""
    times = MAX_ATTEMPTS + 2
    p = refusing("store_round", times)
    p.drain()
    assert_ended_ok(p)
    assert p.queue.retries == 0
    assert p.store.tries[keys.round_step(SK, 0)] == 1
    assert len(p.provider.requests) == 2
    assert len(p.paused) == times  # type: ignore[attr-defined]


def test_a_reply_redis_does_not_answer_for_is_kept_and_written_again() -> None:
    """A cut network or a paused primary (the write times out): the reply is written again
    once Redis answers, and its model call is not made twice."""
    p = refusing("store_round", MAX_ATTEMPTS + 2, store=UnreachableStore)
    p.drain()
    assert_ended_ok(p)
    assert p.store.tries[keys.round_step(SK, 0)] == 1
    assert len(p.provider.requests) == 2


def test_an_error_reply_redis_does_not_answer_for_gives_the_call_another_chance() -> None:
    """The provider could not be reached (nor could Redis: the worker was cut off): the error
    is not kept; the round's step fails, runs again once Redis answers, and its call gets
    another chance instead of ending the session provider_unavailable."""
    cut_off = ProviderRetryableError("connect timeout calling backend replay")
    p = refusing("store_round", 1, store=UnreachableStore, script=[cut_off, *WEATHER_SCRIPT * 2])
    p.drain()
    assert_ended_ok(p)
    assert p.store.tries[keys.round_step(SK, 0)] == 2
    assert len(p.provider.requests) == 3


def test_a_reply_unwritten_past_the_wait_is_bought_again_by_the_next_run() -> None:
    """Past settings.store_wait_s the write gives up: the round runs again, its call too."""
    p = refusing("store_round", 3, budget_s=1.0, store=UnreachableStore)
    p.drain()
    assert_ended_ok(p)
    assert len(p.provider.requests) > 2


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
        (redis.TimeoutError("Timeout reading from socket"), None),
    ],
)  # fmt: skip
def test_redis_refusals_are_translated_once_into_store_unavailable(
    error: redis.RedisError, reason: str | None
) -> None:
    assert refusal(error) == reason
    translated = store_error(error, "store")
    assert isinstance(translated, StoreError)
    assert isinstance(translated, StoreUnavailableError) == (reason is not None)
    unanswered = isinstance(error, (redis.ConnectionError, redis.TimeoutError)) and not reason
    assert isinstance(translated, StoreUnreachableError) == unanswered
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

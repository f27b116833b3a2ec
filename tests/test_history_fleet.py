"""A normal batch on a real fleet judged as a whole history (bench/history.py): weather
sessions (a tool call round, then the answer) and sessions whose first model call the replay
server answers 500 once, read back from Redis and the replay server's request log. The
verdict is valid with its exact counts: every session ended once, every tool call id answered
once, one model call a round but the one after each injected 500, and the usage in each
record what the server billed. Redis database 12."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.chaos_fleet import weather_objects
from bench.history import Verdict
from bench.history_read import check_run, mark_run
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from schemas import keys
from tests.conftest import Running, _workers

pytestmark = pytest.mark.fleet

REDIS_DB = 12
WEATHER = 6
FLAKY = 2


@pytest.fixture(scope="module")
def fleet12(base_fleet: Fleet) -> Iterator[Running]:
    yield from _workers(base_fleet, db=REDIS_DB)


def flaky_objects(run: str, n: int) -> list[dict[str, Any]]:
    """Plain sessions whose first model call the replay server answers 500 (once each)."""
    return [
        {
            "id": f"{run}/flaky-{i}",
            "model": "replay/flaky",
            "messages": [{"role": "user", "content": f"[{run} flaky {i}] hello"}],
        }
        for i in range(n)
    ]


def test_a_normal_batch_is_a_valid_history_with_exact_counts(
    fleet12: Running, fresh_id: str
) -> None:
    client = fleet12.client
    run = f"history-{fresh_id}"
    objects = weather_objects(run, WEATHER) + flaky_objects(run, FLAKY)
    mark = mark_run(fleet12.fleet.replay_url)
    sub = client.enqueue(load_spec_from_objects(objects))
    finished = list(client.wait(sub, timeout_s=120, poll_s=0.05))
    assert all(record["status"] == "ok" for _, record in finished), finished
    delivered = [str(record["id"]) for _, record in finished]

    verdict = check_run("fleet", client, objects, mark, delivered)

    sessions = WEATHER + FLAKY
    assert verdict == Verdict(
        "fleet", submitted=sessions, ended=sessions, lost=0, unexpected=0, double_endings=0,
        tool_calls=WEATHER, tool_answered_twice=0, tool_unanswered=0, log_judged=True,
        conversations=sessions,
        model_calls=2 * WEATHER + 2 * FLAKY,  # weather: two rounds; flaky: its 500, then ok
        rounds=2 * WEATHER + FLAKY, extra_explained=FLAKY, extra_unexplained=0,
        usage_checked=sessions, usage_mismatches=0, examples={},
    )  # fmt: skip
    assert verdict.valid


def test_a_session_whose_record_is_gone_is_lost(fleet12: Running, fresh_id: str) -> None:
    """The checker reads what Redis holds: a record removed after the batch is a loss."""
    client = fleet12.client
    objects = weather_objects(f"history-lost-{fresh_id}", 2)
    mark = mark_run(fleet12.fleet.replay_url)
    sub = client.enqueue(load_spec_from_objects(objects))
    list(client.wait(sub, timeout_s=120, poll_s=0.05))
    claim = client.claims([objects[1]["id"]])[0]
    assert claim is not None
    client.redis.delete(keys.record(claim.sk))

    verdict = check_run("lost", client, objects, mark, delivered=None)

    assert (verdict.lost, verdict.ended, verdict.valid) == (1, 1, False)
    assert verdict.examples["lost"] == (objects[1]["id"],)

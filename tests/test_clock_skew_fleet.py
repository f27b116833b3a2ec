"""Workers on hosts whose wall clocks are off by 2 minutes (libfaketime: fixtures/clock_skew.py)
take no live lease and end no session early: an llm worker on one side, the control worker
(the reconciler) on the other, a stall after 2 s, a pass every 0.5 s and a fleet deadline of
100 s, so that comparing one host's stamps with another's wall clock would find live sessions
stalled and past the deadline. Real workers, Redis DB 14 of the base fleet, the replay server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.chaos_clock import count_skew
from bench.chaos_fleet import expected, weather_objects
from fixtures.clock_skew import missing_reason, skewed_env
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from schemas.fleet_clock import server_ms
from tests.conftest import Running, _workers

REASON = missing_reason()
pytestmark = [pytest.mark.fleet, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

REDIS_DB = 14
SESSIONS = 40
SKEW_S = 120
RECONCILER_ENV = {
    "CCHATQ_STALL_AFTER_S": "2",
    "CCHATQ_RECONCILE_EVERY_S": "0.5",
    "CCHATQ_SESSION_DEADLINE_S": "100",
}
HOSTS = {
    "llm-behind-control-ahead": (-SKEW_S, SKEW_S),
    "llm-ahead-control-behind": (SKEW_S, -SKEW_S),
}


@pytest.fixture(scope="module", params=sorted(HOSTS))
def skewed(base_fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[tuple[Running, int]]:
    llm_s, control_s = HOSTS[request.param]
    sites = base_fleet.workdir / f"db{REDIS_DB}"
    env_of = {
        "llm": skewed_env(llm_s, sites / "llm"),
        "control": skewed_env(control_s, sites / "control"),
    }
    for running in _workers(base_fleet, REDIS_DB, extra_env=RECONCILER_ENV, env_of=env_of):
        running.fleet.wait_served(("llm", "tools", "control"))
        yield running, llm_s


def test_skewed_hosts_end_no_session_early_and_call_no_model_twice(
    skewed: tuple[Running, int],
) -> None:
    running, llm_s = skewed
    client = running.client
    calls_before = running.replay_stats()["requests"]
    objects = weather_objects(f"skew{llm_s:+d}", SESSIONS, latency_ms=300)
    sub = client.enqueue(load_spec_from_objects(objects))
    for _ in client.wait(sub, timeout_s=120, poll_s=0.05):
        pass
    calls = running.replay_stats()["requests"] - calls_before
    counts = count_skew(client.redis, sub.order, calls, running.fleet.logs)
    records = [r for r in client.records(sub.order) if r is not None]
    answers = expected(objects)
    got = {
        r["id"]: r["body"]["choices"][0]["message"]["content"]
        for r in records
        if r["status"] == "ok"
    }
    assert (counts.ended_early, counts.overdue) == (0, 0), counts
    assert got == answers, counts  # every session ok, with its own answer
    assert (counts.rounds, counts.extra_calls) == (2 * SESSIONS, 0), counts
    assert (counts.take_overs, counts.swept) == (0, 0), counts
    assert_llm_clock_was_off(client, sub.order, llm_s)


def assert_llm_clock_was_off(client: Client, sks: list[str], skew_s: int) -> None:
    """The llm worker's events (stamped on its own wall clock, shown only) are `skew_s` off
    Redis's clock: the skew was in force."""
    now_ms = server_ms(client.redis.time())
    stamps = [
        int(event["ts_ms"])
        for sk in sks
        for event in client.run_trace(sk)
        if str(event.get("worker", "")).startswith("llm")
    ]
    assert stamps, "no event says which worker made it"
    offsets_s = [(stamp - now_ms) / 1000 for stamp in stamps]
    assert all(skew_s - 60 < offset < skew_s + 1 for offset in offsets_s), offsets_s[:5]

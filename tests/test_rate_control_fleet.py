"""The adaptive rate controller in a real fleet: two llm worker processes share one window (the
provider never sees more calls at once than the window holds), a SIGKILLed worker's slots come
back when their leases run out, and a session whose calls keep getting 429s finishes once the
limit allows it, no attempt spent."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fixtures.replay import ReplayServer
from fixtures.replay.rate_limit import RateLimits
from producer.fleet import Fleet, replay_backends
from producer.fleet_status import read_fleet_status
from producer.metrics import FleetGauges
from schemas import fleet_keys, keys
from tests.conftest import Running, _workers
from tests.test_pipeline import submit_specs, wait_for
from worker.edges.rate_control import SLOT_LEASE_MS
from worker.edges.rate_control_lua import W0
from worker.session.rate_control import ControlKey

pytestmark = pytest.mark.fleet

REDIS_DB = 6


def spec(fresh_id: str, n: int, backend: str = "ctl") -> dict[str, object]:
    return {"id": f"{fresh_id}/rc/{n}", "provider": backend, "model": "replay/plain",
            "messages": [{"role": "user", "content": f"controlled {n}"}]}  # fmt: skip


def controller(backend: str = "ctl") -> str:
    return ControlKey(backend, "-", "replay/plain").id


@pytest.fixture()
def fleet_on(base_fleet: Fleet) -> Iterator[tuple[Running, ReplayServer, ReplayServer]]:
    """Two llm worker processes of 32 threads against replay servers of their own."""
    replay = ReplayServer(latency_ms=2_000).start()
    # and one whose account allows 50 calls a second (its headers say so), where the
    # rate_limited scenario refuses a conversation [[refusals:N]] times first
    flaky = ReplayServer(latency_ms=50, rate_limits=RateLimits(rps=50)).start()
    backends = {
        **replay_backends(base_fleet.replay_url),
        "ctl": {"base_url": replay.url},
        "flaky": {"base_url": flaky.url},
    }
    env = {"CCHATQ_BACKENDS": json.dumps({"backends": backends})}
    fleet = _workers(base_fleet, db=REDIS_DB, extra_env=env)
    try:
        running = next(fleet)
        running.fleet.env.update(env)  # the workers a test starts later see these backends too
        running.fleet.start_worker("llm", concurrency=32)
        yield running, replay, flaky
    finally:
        fleet.close()
        replay.stop()
        flaky.stop()


def test_two_worker_processes_never_hold_more_calls_than_the_window(
    fleet_on: tuple[Running, ReplayServer, ReplayServer], tmp_path: Path, fresh_id: str
) -> None:
    running, replay, _ = fleet_on
    redis = running.client.redis
    widest, most_held = [0.0], [0]
    done = threading.Event()

    def watch() -> None:  # the window and the slots held, as the fleet changes them
        while not done.is_set():
            held = redis.zcard(fleet_keys.rate_slots(controller()))
            window = float(redis.hget(fleet_keys.rate_controller(controller()), "w") or 0)
            widest[0] = max(widest[0], window)
            most_held[0] = max(most_held[0], held)
            assert window == 0 or held <= int(window)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    sub = submit_specs(running.client, [spec(fresh_id, n) for n in range(48)], tmp_path)
    records = dict(running.client.wait(sub, timeout_s=120))
    done.set()
    watcher.join(timeout=5)
    assert all(r["status"] == "ok" for r in records.values()), records
    # the window started at 16 and doubled while used up, once a second: the provider never
    # saw more calls at once than the window held
    assert widest[0] > W0
    assert replay.stats()["max_in_flight"] <= widest[0]
    assert most_held[0] <= widest[0]
    # what `cchatq status` and the metrics exporter show of it, once the workers gave back
    # the slots they kept (far from the limit) and told the calls those served
    wait_for(lambda: redis.zcard(fleet_keys.rate_slots(controller())) == 0, timeout_s=30)
    (shown,) = [c for c in read_fleet_status(redis).rate_controllers if c.id == controller()]
    assert (shown.calls, shown.rate_limited, shown.window) == (48, 0, widest[0])
    assert shown.last_change == "slow start" and shown.in_flight == 0
    registry = CollectorRegistry()
    registry.register(FleetGauges(redis))
    scraped = generate_latest(registry).decode()
    assert f'cchatq_rate_window{{controller="{controller()}"}} {widest[0]}' in scraped


def test_a_killed_workers_slots_come_back_within_their_lease(
    fleet_on: tuple[Running, ReplayServer, ReplayServer], tmp_path: Path, fresh_id: str
) -> None:
    running, _, _ = fleet_on
    redis = running.client.redis
    slots = fleet_keys.rate_slots(controller())
    sub = submit_specs(running.client, [spec(fresh_id, n) for n in range(8)], tmp_path)
    wait_for(lambda: redis.zcard(slots) >= 8, timeout_s=60)  # every call is out
    held_before = set(redis.zrange(slots, 0, -1))
    for name, proc in list(running.fleet.workers.items()):
        if name.startswith("llm"):  # both: no one is left to release a slot
            running.fleet.kill(proc, signal.SIGKILL)
    killed_at = time.monotonic()

    def live() -> set[bytes]:  # slots whose lease has not run out (the next acquire drops the rest)
        seconds, micros = redis.time()
        return set(redis.zrangebyscore(slots, seconds * 1000 + micros // 1000, "+inf"))

    # the slots' leases run out on their own, within seconds
    wait_for(lambda: not held_before & live(), timeout_s=30)
    assert time.monotonic() - killed_at < SLOT_LEASE_MS / 1000 + 5
    running.fleet.start_worker("llm")
    records = dict(running.client.wait(sub, timeout_s=180))
    assert all(r["status"] == "ok" for r in records.values()), records


def test_a_session_refused_again_and_again_finishes_no_attempt_spent(
    fleet_on: tuple[Running, ReplayServer, ReplayServer], tmp_path: Path, fresh_id: str
) -> None:
    running, _, flaky = fleet_on
    refusals = 6  # a call retried in the HTTP client fails after its 4 attempts
    markers = f"[[refusals:{refusals}]] [[retry_after:0]]"
    specs = [
        {"id": f"{fresh_id}/rc/{n}", "provider": "flaky", "model": "replay/rate_limited",
         "messages": [{"role": "user", "content": f"hi {n} {markers}"}]}
        for n in range(4)
    ]  # fmt: skip
    records = dict(running.client.wait(submit_specs(running.client, specs, tmp_path), 120))
    assert all(r["status"] == "ok" for r in records.values()), records
    assert flaky.faults()["most_429_per_turn"] == refusals
    redis = running.client.redis
    events = [e for _, fields in redis.xrange(keys.TRACE) for e in keys.trace_events(fields)]
    put_off = Counter(e["session"] for e in events if e.get("reason") == "429")
    assert put_off == {s["id"]: refusals for s in specs}  # each 429 put its round off once
    for s in specs:  # and spent no attempt: each round ran in one counted try
        sk = str(running.client.session_key(str(s["id"])))
        ends = ("model.call.finished", "session.finished")  # a step's last event says its try
        steps = [e for e in running.client.run_trace(sk) if e["event"] in ends and "delivery" in e]
        assert [e["delivery"] for e in steps] == [1]

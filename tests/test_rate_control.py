"""The adaptive rate controller's law, on the private Redis with a fake clock (the scripts take
the caller's time when it passes one): slow start, growth only when the window is used up, one
cut per 429 episode, the pace the headers set, a spent budget holding the pace, a 429 delaying
only its own request, tokens corrected by usage, waiting rounds spaced, and slots that expire
with the worker that held them."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from producer.fleet import Fleet
from schemas import fleet_keys
from worker.codecs.rate_headers import RateSignal
from worker.config import BackendConfig
from worker.edges.rate_control import MAX_WAIT_MS, ROOM_MS, RedisRateControl
from worker.edges.rate_control_lua import PACE_CUT, TAU_MS, W0
from worker.session.rate_control import CallReport, ControlKey, Slot, Wait

pytestmark = pytest.mark.fleet  # the private Redis

REDIS_DB = 14
KEY = ControlKey("b", "-", "m")
BACKEND = BackendConfig(name="b")
T0 = 1_000_000_000.0


class Clock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> float:
        return self.ms


@pytest.fixture
def client(base_fleet: Fleet) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def control(client: redis.Redis, clock: Clock) -> RedisRateControl:
    # every call asks and reports in full here: the law is under test, not the sampling of
    # latencies or the blocks kept far from the limit (tests/test_rate_blocks.py)
    return RedisRateControl(client, clock_ms=clock, rand=lambda: 0.5, full_every=1, block=0)


def state(client: redis.Redis) -> dict[str, str]:
    raw: dict[bytes, bytes] = client.hgetall(fleet_keys.rate_controller(KEY.id))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


def take(control: RedisRateControl, n: int, tokens: int = 0, who: str = "r") -> list[Slot | Wait]:
    return [control.acquire(KEY, f"{who}{i}", tokens, BACKEND) for i in range(n)]


def ok(report_kind: str = "ok", latency_ms: int = 1000, **signal: float) -> CallReport:
    return CallReport(report_kind, latency_ms, 0, RateSignal(**signal) if signal else None)  # type: ignore[arg-type]


def test_slow_start_doubles_the_window_only_while_it_is_used_up(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    first = take(control, W0)
    assert all(isinstance(s, Slot) for s in first)
    assert float(state(client)["w"]) == W0
    # a window that is not used up never grows, however long it lasts
    for slot in first[: W0 // 2]:
        assert isinstance(slot, Slot)
        control.report(slot, ok(), BACKEND)
    clock.ms += control.lease_ms // 2
    assert all(isinstance(s, Slot) for s in take(control, W0 // 2, who="x"))
    assert float(state(client)["w"]) == W0
    # used up: it doubles (slow start), at most once an epoch (a call's latency)
    assert isinstance(control.acquire(KEY, "y0", 0, BACKEND), Slot)
    assert float(state(client)["w"]) == 2 * W0
    assert state(client)["why"] == "slow start"
    more = take(control, W0, who="z")
    assert isinstance(more[-1], Wait) and more[-1].reason == "window"
    assert float(state(client)["w"]) == 2 * W0  # the same epoch: no second doubling
    clock.ms += 1_000
    assert isinstance(control.acquire(KEY, "z-late", 0, BACKEND), Slot)
    assert float(state(client)["w"]) == 4 * W0


def test_one_cut_per_429_episode(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    slots = [s for s in take(control, W0) if isinstance(s, Slot)]
    for slot in slots[:3]:  # three 429s of one episode: one cut
        control.report(slot, ok("rate_limited"), BACKEND)
    # no pace known: one is learned, 0.8 of the rate calls went at (16 in flight over the
    # one second a call is taken to last while none has ended)
    learned = float(state(client)["lp"])
    assert learned == pytest.approx(W0 * PACE_CUT)
    assert state(client)["n429"] == "3" and state(client)["ss"] == "0"
    clock.ms += 2_000  # past the debounce: a new episode cuts again
    control.report(slots[3], ok("rate_limited"), BACKEND)
    assert float(state(client)["lp"]) == pytest.approx(learned * PACE_CUT)


def test_the_headers_set_the_pace_and_a_spent_budget_holds_it(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    slot = control.acquire(KEY, "first", 0, BACKEND)
    assert isinstance(slot, Slot)
    change = control.report(slot, ok(requests_per_min=1200, requests_left=19), BACKEND)
    assert change is not None and (change.reason, change.pace_rps) == ("header", 20.0)
    # 20 requests a second, a quarter second's burst: then one every 50 ms, in line
    got = take(control, 20)
    granted = [s for s in got if isinstance(s, Slot)]
    waits = [s for s in got if isinstance(s, Wait)]
    assert len(granted) == 1 + (2 * TAU_MS) // 50
    assert {w.reason for w in waits} == {"pace"}
    gaps = [round((b.wait_s - a.wait_s) * 1000) for a, b in itertools.pairwise(waits)]
    assert set(gaps) == {50}
    # a response saying the budget is spent: nothing goes before its reset (27 ms here)
    clock.ms += 10_000
    control.report(
        granted[0], ok(requests_per_min=1200, requests_left=0, requests_reset_s=0.027), BACKEND
    )
    held = control.acquire(KEY, "later", 0, BACKEND)
    assert isinstance(held, Wait) and held.reason == "pace"
    assert held.wait_s == pytest.approx(0.027)


def test_a_429_delays_only_its_own_request(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    slots = [s for s in take(control, 4) if isinstance(s, Slot)]
    # a 429 whose Retry-After says 30 s: that wait is its own round's (a Celery countdown);
    # the controller only spaces the next call by two of its pace's intervals
    control.report(slots[0], ok("rate_limited", requests_per_min=1200, requests_left=3), BACKEND)
    other = control.acquire(KEY, "other", 0, BACKEND)
    pace = float(state(client)["lp"])
    assert isinstance(other, Wait) and other.wait_s <= 2 / pace + 0.01
    clock.ms += 1000 * (2 / pace) + 1
    assert isinstance(control.acquire(KEY, "other", 0, BACKEND), Slot)


def test_a_learned_pace_follows_the_rate_granted_before_a_429_and_grows_back(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    running: list[Slot] = []
    for i in range(100):  # 10 calls a second for 10 s, a second each, no headers (Gemini)
        slot = control.acquire(KEY, f"r{i}", 0, BACKEND)
        assert isinstance(slot, Slot)
        running.append(slot)
        if len(running) > 10:
            control.report(running.pop(0), ok(latency_ms=1000), BACKEND)
        clock.ms += 100
    slot = control.acquire(KEY, "hit", 0, BACKEND)
    assert isinstance(slot, Slot)
    control.report(slot, ok("rate_limited"), BACKEND)
    for done in running:
        control.report(done, ok(latency_ms=1000), BACKEND)
    learned = float(state(client)["lp"])
    assert PACE_CUT * 9 <= learned <= PACE_CUT * 11  # Little: ~10 in flight over 1 s
    clock.ms += 2_000  # 429s stopped only two epochs ago: nothing grows yet
    take(control, 10, who="q")
    assert float(state(client)["lp"]) == learned
    # held back by that pace for a while after the 429s stopped, it grows by 5% an epoch
    clock.ms += 2_000
    take(control, 10, who="p")
    assert float(state(client)["lp"]) == pytest.approx(learned * 1.05)


def test_tokens_are_estimated_then_corrected_by_usage(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    slot = control.acquire(KEY, "a", 0, BACKEND)
    assert isinstance(slot, Slot)
    control.report(slot, ok(tokens_per_min=6000, tokens_left=5000), BACKEND)  # 100 tokens/s
    assert control.paces_tokens(KEY, BACKEND)
    clock.ms += 60_000
    estimated = control.acquire(KEY, "b", 100, BACKEND)  # a second's worth, estimated
    assert isinstance(estimated, Slot)
    ttat = float(state(client)["ttat"])
    assert ttat == pytest.approx(clock.ms - TAU_MS + 1000)
    control.report(estimated, CallReport("ok", 1000, 300), BACKEND)  # it really used 300
    assert float(state(client)["ttat"]) == pytest.approx(ttat + 2000)
    wait = control.acquire(KEY, "c", 100, BACKEND)
    assert isinstance(wait, Wait) and wait.reason == "tokens"


def test_a_full_waiting_room_sends_rounds_away_for_a_drawn_while(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    slot = control.acquire(KEY, "first", 0, BACKEND)
    assert isinstance(slot, Slot)
    control.report(slot, ok(requests_per_min=60, requests_left=59), BACKEND)  # one a second
    got = take(control, 20)
    waits = [s for s in got if isinstance(s, Wait)]
    in_room = [w for w in waits if w.wait_s * 1000 <= ROOM_MS]
    assert len(in_room) == ROOM_MS // 1000
    away = waits[len(in_room)]
    assert away.wait_s * 1000 == pytest.approx(ROOM_MS + 0.5 * (MAX_WAIT_MS - ROOM_MS))
    # a round coming back early to its ticket is told the rest of its wait
    again = control.acquire(KEY, "r1", 0, BACKEND)
    assert isinstance(again, Wait) and again.reason == "queued"


def test_the_slots_of_a_worker_that_died_come_back_when_their_lease_runs_out(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    held = take(control, W0)  # no call has ended: the window cannot grow yet
    assert all(isinstance(s, Slot) for s in held)
    assert isinstance(control.acquire(KEY, "blocked", 0, BACKEND), Wait)
    clock.ms += control.lease_ms + 1  # nobody renewed them: their worker is gone
    assert isinstance(control.acquire(KEY, "blocked", 0, BACKEND), Slot)
    assert client.zcard(fleet_keys.rate_slots(KEY.id)) == 1


def test_the_slots_of_a_controller_whose_calls_all_ended_are_made_again_with_a_ttl(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    """The last call to end empties the slots (Redis drops an empty set); the next call makes
    them again, with their TTL, even when nothing else of the controller changes: a worker
    killed while it held that slot must not leave a set that lives forever."""
    first = control.acquire(KEY, "r0", 0, BACKEND)
    assert isinstance(first, Slot)
    control.report(first, ok(), BACKEND)
    assert not client.exists(fleet_keys.rate_slots(KEY.id))
    clock.ms += 100
    assert isinstance(control.acquire(KEY, "r1", 0, BACKEND), Slot)
    assert client.ttl(fleet_keys.rate_slots(KEY.id)) > 0


def test_near_the_pace_429s_came_at_growth_probes_then_speeds_up_past_it(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    """Where 429s came at 10 a second, a pace of 9.95 grows by 1% of 10 an epoch; once past
    10 with no 429 (the limit moved), by 5% again."""
    client.hset(
        fleet_keys.rate_controller(KEY.id),
        mapping={"w": 64, "ss": 0, "lat": 1000, "lp": 9.95, "pmax": 10, "l429": T0 - 60_000},
    )
    take(control, 10)
    assert float(state(client)["lp"]) == pytest.approx(10.05)
    assert float(state(client)["pmax"]) == 0
    clock.ms += 1_000
    take(control, 10, who="s")
    assert float(state(client)["lp"]) == pytest.approx(10.05 * 1.05)


def test_in_slow_start_a_waiting_round_comes_back_by_the_epoch_the_window_will_have_room(
    control: RedisRateControl, client: redis.Redis, clock: Clock
) -> None:
    """Nothing known of a limit: the window doubles each epoch (1 s before a call has ended),
    so of 112 rounds asking at once, 16 go, 16 come back in one epoch, 32 in two, 48 in three."""
    got = take(control, 16 + 16 + 32 + 48)
    assert all(isinstance(s, Slot) for s in got[:16])
    waits = Counter(round(w.wait_s) for w in got[16:] if isinstance(w, Wait))
    assert waits == {1: 16, 2: 32, 3: 48}


def test_a_call_with_nothing_to_teach_mostly_just_gives_its_slot_back(
    client: redis.Redis, clock: Clock
) -> None:
    control = RedisRateControl(client, clock_ms=clock, full_every=4, block=0)
    slots = [s for s in take(control, 8) if isinstance(s, Slot)]
    for slot in slots:
        control.report(slot, ok(latency_ms=500), BACKEND)
    assert client.zcard(fleet_keys.rate_slots(KEY.id)) == 0  # every slot given back
    assert float(state(client)["lat"]) == pytest.approx(500)  # two of them said how long

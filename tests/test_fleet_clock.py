"""Redis's clock for every comparison one process makes of what another stamped
(schemas/fleet_clock.py): the offset a process measures and measures again; the reconciler's
decisions when the hosts that stamp and compare disagree by minutes (twins); the Redis store's
and the producer's stamps on a real Redis from processes whose clocks are off (fleet marker).
The whole fleet on skewed hosts: tests/test_clock_skew_fleet.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from producer.client import Client
from producer.fleet import Fleet
from schemas import keys
from schemas.fleet_clock import JUMP_MS, RETRY_S, SAMPLES, FleetClock, server_ms, wall_ms
from schemas.fleet_config import FleetConfig
from tests.test_engine import WEATHER_FN
from tests.test_steps import SK, pipeline, spec, submit, weather_model
from worker.edges.store import RedisStore
from worker.session.reconciler import Reconciler
from worker.session.twins.store import MemoryStore

SKEW_MS = 120_000
REDIS_DB = 14


@dataclass
class Hosts:
    """Time moved by hand: Redis's clock, a monotonic clock, and hosts whose wall clocks are
    off Redis's by a fixed skew (Redis's own may be moved against them too)."""

    real_ms: float = 1_800_000_000_000.0
    redis_skew_ms: float = 0.0
    mono_s: float = 1_000.0
    reads: int = 0
    down: bool = False

    @property
    def redis_ms(self) -> float:
        return self.real_ms + self.redis_skew_ms

    def read_redis(self) -> float:
        self.reads += 1
        if self.down:
            raise ConnectionError("redis away")
        return self.redis_ms

    def advance(self, seconds: float) -> None:
        self.real_ms += seconds * 1000
        self.mono_s += seconds

    def wall(self, skew_ms: float) -> Any:
        return lambda: self.real_ms + skew_ms

    def clock(self, skew_ms: float, measured: bool = True, refresh_s: float = 30.0) -> FleetClock:
        """A process on a host `skew_ms` off Redis's clock; `measured` False: one that takes its
        own wall clock for Redis's (what every process did before the fleet's clock)."""
        wall = self.wall(skew_ms)
        read = self.read_redis if measured else wall
        return FleetClock(read, refresh_s, wall=wall, monotonic_s=lambda: self.mono_s)


# --- the offset -----------------------------------------------------------------------------


def test_a_host_behind_redis_reads_redis_clock_with_one_command() -> None:
    hosts = Hosts()
    clock = hosts.clock(-SKEW_MS)
    assert clock.now_ms() == hosts.redis_ms
    hosts.advance(5)
    assert [clock.now_ms(), clock.now_ms()] == [hosts.redis_ms] * 2
    assert hosts.reads == clock.measures == 1  # at first use only: no command per call


def test_the_offset_is_measured_again_every_refresh() -> None:
    """Redis's clock moved against the host's (a failover to a Redis on another host): read
    right again once the offset is measured anew, after refresh_s."""
    hosts = Hosts()
    clock = hosts.clock(SKEW_MS, refresh_s=30.0)
    clock.now_ms()
    hosts.redis_skew_ms += 5_000  # Redis's clock alone moves (a failover to another host)
    hosts.advance(29)
    assert clock.now_ms() == hosts.redis_ms - 5_000  # the old offset, until the next measure
    hosts.advance(1)
    assert clock.now_ms() == hosts.redis_ms
    assert clock.measures == 2


def test_a_host_clock_set_by_hand_is_measured_again_at_once() -> None:
    hosts = Hosts()
    skew = [float(SKEW_MS)]
    clock = FleetClock(
        hosts.read_redis, wall=lambda: hosts.real_ms + skew[0], monotonic_s=lambda: hosts.mono_s
    )
    clock.now_ms()
    skew[0] -= JUMP_MS / 2  # a slew of half a second: the offset of the last measure holds
    assert abs(clock.now_ms() - hosts.redis_ms) <= JUMP_MS / 2
    assert clock.measures == 1
    skew[0] = -SKEW_MS  # stepped by 4 minutes (NTP, by hand), no monotonic time elapsed
    assert clock.now_ms() == hosts.redis_ms
    assert clock.measures == 2


def test_a_clock_that_cannot_reach_redis_keeps_its_offset_and_tries_again_later() -> None:
    hosts = Hosts()
    clock = hosts.clock(-SKEW_MS, refresh_s=30.0)
    clock.now_ms()
    hosts.down = True
    hosts.advance(30)
    assert clock.now_ms() == hosts.redis_ms  # the measure failed: the offset it had
    reads = hosts.reads
    hosts.advance(RETRY_S / 2)
    assert clock.now_ms() == hosts.redis_ms
    assert hosts.reads == reads  # not one try per call while Redis is away
    hosts.down = False
    hosts.advance(RETRY_S)
    clock.now_ms()
    assert hosts.reads == reads + 1 and clock.measures == 2


def test_a_clock_that_never_reached_redis_reads_the_host_clock_meanwhile() -> None:
    hosts = Hosts(down=True)
    clock = hosts.clock(SKEW_MS)
    assert clock.now_ms() == hosts.redis_ms + SKEW_MS
    assert clock.now_ms() == hosts.redis_ms + SKEW_MS
    assert hosts.reads == 1  # tried again after RETRY_S, not on every call


def test_threads_starting_together_measure_once() -> None:
    reads: list[str] = []  # the thread of each read

    def slow_read() -> float:
        reads.append(threading.current_thread().name)
        time.sleep(0.05)  # a slow round trip: the other threads arrive meanwhile
        return wall_ms() + SKEW_MS

    clock = FleetClock(slow_read)
    start = threading.Barrier(8)
    got: list[int] = []

    def read() -> None:
        start.wait(timeout=5)
        got.append(clock.now_ms())

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5)
    # one thread measured (its round trips slow: as many as a measure takes), once
    assert len(set(reads)) == 1 and len(reads) == SAMPLES and clock.measures == 1
    assert len(got) == 8
    assert all(abs(now - (wall_ms() + SKEW_MS)) < 1_000 for now in got)


def test_a_round_trip_stretched_by_a_busy_host_is_not_the_one_measured() -> None:
    """The first TIME's reply is made at once and reaches the process 20 ms later (a stall):
    taken alone it would put the offset 10 ms off. The quickest of the round trips counts."""
    hosts = Hosts()
    delays_ms = [20.0, 0.4, 0.2]

    def read() -> float:
        made = hosts.real_ms + SKEW_MS  # Redis's clock when it makes the reply
        hosts.real_ms += delays_ms.pop(0)
        return made

    clock = FleetClock(read, wall=lambda: hosts.real_ms, monotonic_s=lambda: hosts.mono_s)
    assert abs(clock.offset_ms() - SKEW_MS) <= 0.2  # the second, quick: no third one
    assert delays_ms == [0.2] and clock.measures == 1


# --- the reconciler on skewed hosts (twins) -------------------------------------------------


@dataclass
class ReconcileOnClock:
    """The reconciler's store port over the twin, its marks of progress (keys.ACTIVE) kept as
    the Redis store keeps them: each stamped by the clock of the process that made it, the
    stalled ones those older than quiet_ms on the reconciler's clock."""

    store: MemoryStore
    clock: FleetClock  # the reconciler's process's
    marks: dict[str, int] = field(default_factory=dict)

    def take_reconciler_turn(self, hold_ms: int) -> bool:
        return True

    def stalled(self, quiet_ms: int, most: int) -> list[str]:
        now = self.clock.now_ms()
        found = [sk for sk, at in sorted(self.marks.items(), key=lambda m: m[1])]
        found = [sk for sk in found if self.marks[sk] <= now - quiet_ms][:most]
        self.marks.update(dict.fromkeys(found, now))
        return found

    def forget_session(self, sk: str) -> None:
        self.marks.pop(sk, None)

    def submitted_ms(self, sks: list[str]) -> list[int | None]:
        return [int(self.store.meta_of[sk]["submitted_ms"]) for sk in sks]

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def trim_results(self, keep: int) -> int:
        return 0


@pytest.mark.parametrize("measured", [True, False], ids=["redis-clock", "host-clocks"])
def test_a_reconciler_ahead_of_redis_ends_no_session_early(measured: bool) -> None:
    """Its producer's host 2 minutes behind Redis, the reconciler's 2 minutes ahead, a fleet
    deadline of 100 s: a session submitted 10 s ago, which marked progress 1 s ago, is neither
    stalled nor overdue. On the hosts' own clocks (`host-clocks`, as before the fleet's clock)
    it looked 250 s old and was ended deadline_exceeded."""
    hosts = Hosts()
    producer = hosts.clock(-SKEW_MS, measured)
    p = pipeline([weather_model, weather_model])
    p.store.clock = producer.now_ms  # the submit's stamp: the producer's
    submit(p, spec(WEATHER_FN))
    twin = ReconcileOnClock(p.store, hosts.clock(SKEW_MS, measured))
    twin.marks[SK] = producer.now_ms()  # the producer's mark at submit
    p.queue.run_next(p.runner)  # round 0 ran, its tool step is queued
    hosts.advance(9)
    twin.marks[SK] = hosts.clock(-SKEW_MS, measured).now_ms()  # a step's mark, behind too
    hosts.advance(1)
    reconciler = Reconciler(p.runner, twin, quiet_ms=2_000, deadline_ms=100_000)
    reconciler.turn()
    if not measured:  # what a skewed host did: ended it early
        p.drain()
        assert p.body()["error"]["code"] == "deadline_exceeded"
        return
    assert list(p.queue.pending) == [("tool", SK, 0, 0)]  # neither nudged nor ended
    assert p.store.result(SK) is None
    hosts.advance(2)  # no progress for 2 s on Redis's clock: now it is stalled, nudged
    assert reconciler.turn() == 1
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: sunny"
    assert len(p.provider.requests) == 2  # the nudge's copy of the tool step called no model


# --- the Redis store and the producer on skewed hosts (a real Redis) ------------------------


@pytest.fixture()
def redis_url(base_fleet: Fleet) -> Iterator[str]:
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


def skewed_store(url: str, skew_ms: float, measured: bool = True) -> RedisStore:
    """A worker's store on a host `skew_ms` off Redis's clock (`measured` False: taking its own
    wall clock for Redis's)."""
    store = RedisStore(redis.Redis.from_url(url), ttl_s=600, progress_after_ms=0)
    wall = lambda: wall_ms() + skew_ms  # noqa: E731
    read = (lambda: server_ms(store.client.time())) if measured else wall
    store.clock = FleetClock(read, wall=wall)
    return store


def redis_now_ms(url: str) -> float:
    return server_ms(redis.Redis.from_url(url).time())


@pytest.mark.fleet
def test_stamps_of_skewed_hosts_are_on_redis_clock(redis_url: str) -> None:
    """The producer's host 2 minutes behind Redis, an llm worker's 2 minutes behind, the
    control worker's 2 minutes ahead: the submit, the marks of progress, a deferred step's
    mark and the session's end are all stamped on Redis's clock, and the control worker finds
    nothing stalled and nothing overdue in a session that just moved."""
    client = Client(redis_url, config=FleetConfig())
    client.clock = FleetClock(
        lambda: server_ms(client.redis.time()), wall=lambda: wall_ms() - SKEW_MS
    )
    from bench.chaos_fleet import weather_specs  # the bench's weather session, its module uploaded

    sub = client.enqueue(weather_specs("clock", 1))
    (sk,) = sub.order
    r = redis.Redis.from_url(redis_url)
    submitted = int(r.hget(keys.meta(sk), "submitted_ms") or 0)
    assert abs(submitted - redis_now_ms(redis_url)) < 1_000  # not 2 minutes behind
    assert abs(float(r.zscore(keys.ACTIVE, sk) or 0) - submitted) < 1
    worker = skewed_store(redis_url, -SKEW_MS)
    worker.load_spec(sk)
    worker.begin_step(keys.round_step(sk, 0), 15_000, {"round": 0}, sk)
    assert abs(float(r.zscore(keys.ACTIVE, sk) or 0) - redis_now_ms(redis_url)) < 1_000
    control = skewed_store(redis_url, SKEW_MS)
    assert control.stalled(quiet_ms=30_000, most=10) == []
    runner: Any = SimpleNamespace(settings=SimpleNamespace(trace=False))
    assert Reconciler(runner, control, quiet_ms=30_000, deadline_ms=100_000).turn() == 0
    worker.defer_step(keys.round_step(sk, 0), sk, True, wait_ms=5_000)
    deferred = float(r.zscore(keys.ACTIVE, sk) or 0)
    assert abs(deferred - (redis_now_ms(redis_url) + 5_000)) < 1_000
    assert 0 <= worker.ending_inputs(sk).latency_ms < 60_000
    worker.write_result(sk, b"{}", {"body": {}}, notify_later=[])
    finished = int(r.hget(keys.meta(sk), "finished_ms") or 0)
    assert abs(finished - redis_now_ms(redis_url)) < 1_000
    client.close()


@pytest.mark.fleet
def test_host_clocks_would_see_a_live_session_stalled(redis_url: str) -> None:
    """The same marks on the hosts' own clocks: the control worker 2 minutes ahead finds the
    session an llm worker 2 minutes behind just marked stalled (what the fleet's clock
    prevents; this test shows the one above can fail)."""
    worker = skewed_store(redis_url, -SKEW_MS, measured=False)
    sk = "clock-host"
    worker.client.zadd(keys.ACTIVE, {sk: 0})
    worker.client.set(keys.spec(sk), b'{"id": "x"}', ex=60)
    worker._specs[sk] = SimpleNamespace()  # type: ignore[assignment]  # spec read: marks due
    worker.begin_step(keys.round_step(sk, 0), 15_000, {"round": 0}, sk)
    control = skewed_store(redis_url, SKEW_MS, measured=False)
    assert control.stalled(quiet_ms=30_000, most=10) == [sk]

"""Far from its limit a controller grants a process a block of slots (worker/edges/rate_permits.py):
the block's calls spend no script, their slots go back into the block, and the window still
counts them. A block is at most half the window's free room, is given back as it ages, and is
dropped at the first 429, after which every call asks the controller again. A new controller
grants none until a call has told it how long calls take. A pace of any kind
(headers, a configured ceiling, one learned from 429s) grants no block. The private Redis with a
fake clock, as tests/test_rate_control.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from producer.fleet import Fleet
from schemas import fleet_keys
from tests.test_rate_control import BACKEND, KEY, Clock, ok, state
from worker.config import BackendConfig
from worker.edges.rate_control import RedisRateControl
from worker.edges.rate_control_lua import W0
from worker.edges.rate_permits import BLOCK_AGE_S, PermitBlocks
from worker.session.rate_control import CallReport, Slot

pytestmark = pytest.mark.fleet  # the private Redis

REDIS_DB = 14


class Counted:
    """A script of the controller, counting its calls."""

    def __init__(self, script: Callable[..., Any]) -> None:
        self.script, self.calls = script, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.script(*args, **kwargs)


class Setup:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.clock = Clock()
        self.block_s = [0.0]
        self.control = RedisRateControl(
            client, clock_ms=self.clock, full_every=4,
            blocks=PermitBlocks(clock_s=lambda: self.block_s[0]),
        )  # fmt: skip
        # a new controller grants no block until it knows how long a call takes: one call,
        # the controller's first in this process, tells it
        first = self.control.acquire(KEY, "w", 0, BACKEND)
        assert isinstance(first, Slot) and not first.kept
        self.control.report(first, ok(latency_ms=200), BACKEND)
        self.acquires = Counted(self.control._acquire)
        self.reports = Counted(self.control._report)
        self.control._acquire, self.control._report = self.acquires, self.reports  # type: ignore[assignment]

    def slot(self, backend: BackendConfig = BACKEND) -> Slot:
        got = self.control.acquire(KEY, "w", 0, backend)
        assert isinstance(got, Slot)
        return got

    def in_window(self) -> int:
        return int(self.client.zcard(fleet_keys.rate_slots(KEY.id)))


@pytest.fixture
def setup(base_fleet: Fleet) -> Iterator[Setup]:
    client = redis.Redis.from_url(base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    client.flushdb()
    yield Setup(client)
    client.flushdb()
    client.close()


def test_a_block_serves_calls_with_no_script_and_the_window_counts_it(setup: Setup) -> None:
    first = setup.slot()
    assert first.kept and setup.acquires.calls == 1
    assert setup.in_window() == W0 // 2  # half the window's room: the block
    others = [setup.slot() for _ in range(W0 // 2 - 1)]
    assert setup.acquires.calls == 1 and all(s.kept for s in others)
    for slot in [first, *others]:
        setup.control.report(slot, ok(latency_ms=200), BACKEND)
    assert setup.in_window() == W0 // 2  # back in the block, still counted
    assert setup.reports.calls == 3  # its first call, then one in four, say their latency
    assert float(state(setup.client)["lat"]) == pytest.approx(200)
    again = setup.slot()  # from the block: its slots went back into it
    assert again.kept and setup.acquires.calls == 1
    setup.control.report(again, ok(), BACKEND)
    # the teaching call and the block's first counted by their scripts, the block's next
    # seven told with its first report
    assert int(state(setup.client)["n"]) == 9


def test_an_aged_block_is_given_back_and_the_next_call_asks_again(setup: Setup) -> None:
    slot = setup.slot()
    setup.block_s[0] += BLOCK_AGE_S
    setup.control.report(slot, ok(), BACKEND)  # its block aged: given back, not kept
    assert setup.in_window() == W0 // 2 - 1
    setup.slot()
    assert setup.acquires.calls == 2
    assert setup.in_window() == W0 // 2  # the old block's free slots given back, a new one


def test_a_429_drops_the_block_and_calls_ask_one_by_one_after_it(setup: Setup) -> None:
    slot = setup.slot()
    setup.control.report(slot, CallReport("rate_limited", 100), BACKEND)
    assert setup.in_window() == 0  # the 429's slot and the block's free ones
    assert int(state(setup.client)["n429"]) == 1
    assert float(state(setup.client)["lp"]) > 0  # a pace learned from it: no block meanwhile
    setup.clock.ms += 10_000
    after = setup.slot()
    assert not after.kept and setup.in_window() == 1
    setup.control.report(after, ok(), BACKEND)
    assert setup.in_window() == 0


def test_a_pace_grants_no_block(setup: Setup) -> None:
    ceiling = BackendConfig(name="b", requests_per_minute=6000)
    slot = setup.slot(ceiling)
    assert not slot.kept and setup.in_window() == 1


def test_headers_drop_the_block_and_set_a_pace(setup: Setup) -> None:
    slot = setup.slot()
    setup.control.report(slot, ok(requests_per_min=600, requests_left=500), BACKEND)
    assert setup.in_window() == 0
    assert float(state(setup.client)["hrps"]) == pytest.approx(10)
    assert not setup.slot().kept

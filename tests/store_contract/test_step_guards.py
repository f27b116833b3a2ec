"""The StepGuards contract: each step's lease, published marker and try count;
run on the in-memory twin, one Redis and a 3-master cluster (conftest.py)."""

from __future__ import annotations

import contextlib

import pytest

from producer.fleet import Fleet
from schemas import keys
from tests.store_contract.conftest import Backend, _redis, completion, spec, store_reply
from worker.edges.store import RedisStore
from worker.session.outcomes import ToolOutcome
from worker.session.store_ports import RoundReads, StepGuards, ToolReads


def port(backend: Backend) -> StepGuards:
    """The store as this role's port: a test of it calls nothing else."""
    return backend.store


def test_a_step_reads_what_it_asks_for_with_its_lease(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    store = port(backend)
    store_reply(store, sk, 0, completion("a", "b"))
    backend.store.store_tool_outcomes(sk, 0, {1: ToolOutcome.success("one")}, 2)
    start = store.begin_step(keys.round_step(sk, 1), 1000, None, sk, RoundReads(1, "r"))
    assert start.leased and start.session == backend.store.load_session(sk, "r", upto_round=1)
    tool = store.begin_step(keys.tool_step(sk, 0, 1), 1000, None, sk, ToolReads(0, 1))
    assert tool.tool_inputs == backend.store.tool_inputs(sk, 0, 1)
    assert tool.tool_inputs is not None
    stored, outcome = tool.tool_inputs
    assert stored is not None and stored.completion == completion("a", "b")
    assert outcome == ToolOutcome.success("one")
    assert store.begin_step(keys.round_step(sk, 2), 1000, None, sk).session is None


def test_a_step_lease_is_held_once_and_its_tries_counted(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    store, step = port(backend), keys.round_step(sk, 0)
    first = store.begin_step(step, 60_000, {"state": "round 0"}, sk)
    assert (first.published, first.leased, first.tries, first.cancelled) == (
        False,
        True,
        1,
        False,
    )
    # a delivery that finds the step leased waits for the lease and spends no try
    second = store.begin_step(step, 60_000, None, sk)
    assert (second.leased, second.tries) == (False, 1)
    assert 0 < store.lease_left_ms(step) <= 60_000
    store.release_lease(step)
    third = store.begin_step(step, 60_000, None, sk)
    assert (third.leased, third.tries) == (True, 2)
    store.defer_step(step, sk, True, 1_000)  # rate limited: not a try
    fourth = store.begin_step(step, 60_000, None, sk)
    assert (fourth.leased, fourth.tries) == (True, 2)
    store.end_step(step)
    assert store.begin_step(step, 60_000, None, sk).published
    assert store.lease_left_ms(step) == 0
    assert backend.store.meta(sk)["state"] == "round 0"


def test_a_late_step_of_a_lost_session_does_not_make_its_meta_again(
    backend: Backend, sk: str
) -> None:
    """A step records its state in its session's meta only while the meta is there: one of a
    session whose keys expired (or were lost with Redis's data) would make a meta with no TTL,
    and a producer would take the lost session for a live one."""
    store = port(backend)
    store.begin_step(keys.round_step(sk, 1), 60_000, {"state": "round 1"}, sk)
    assert backend.store.meta(sk) == {}
    backend.submit(sk, spec(sk), "")
    store.begin_step(keys.round_step(sk, 2), 60_000, {"state": "round 2"}, sk)
    assert backend.store.meta(sk)["state"] == "round 2"


def test_tries_count_every_delivery_when_the_broker_vouches_for_the_first(
    backend: Backend, sk: str
) -> None:
    """A first delivery (`first=True`) is try 1 (the Redis store writes nothing for it); the
    redeliveries after it count on from 2; a rate-limited one gives its try back."""
    store = port(backend)
    step = keys.round_step(sk, 0)
    assert store.begin_step(step, 60_000, None, sk, first=True).tries == 1
    store.release_lease(step)
    assert store.begin_step(step, 60_000, None, sk, first=False).tries == 2
    store.release_lease(step)
    assert store.begin_step(step, 60_000, None, sk, first=False).tries == 3
    other = keys.round_step(sk, 1)
    start = store.begin_step(other, 60_000, None, sk, first=True)
    store.defer_step(other, sk, start.tries_stored, 1_000)  # rate limited: not a try
    assert store.begin_step(other, 60_000, None, sk, first=False).tries == 1


def test_a_step_is_active_while_leased_and_once_published(backend: Backend, sk: str) -> None:
    store = port(backend)
    leased, done, free = (keys.round_step(sk, r) for r in range(3))
    store.begin_step(leased, 60_000, None, sk)
    store.begin_step(done, 60_000, None, sk)
    store.end_step(done)
    assert store.active_steps([leased, done, free]) == {leased, done}
    assert store.published_steps([leased, done, free]) == {done}
    store.release_lease(leased)
    assert store.active_steps([leased, free]) == set()
    assert store.active_steps([]) == set()
    assert store.published_steps([]) == set()


def test_cancel_is_seen_at_the_step_boundary(backend: Backend, sk: str) -> None:
    backend.cancel(sk)
    assert backend.store.is_cancelled(sk)
    assert port(backend).begin_step(keys.finish_step(sk), 1000, None, sk).cancelled


def test_only_steps_a_delivery_works_on_are_leased(backend: Backend, sk: str) -> None:
    store = port(backend)
    leased, done, free = (keys.round_step(sk, r) for r in range(3))
    store.begin_step(leased, 60_000, None, sk)
    store.begin_step(done, 60_000, None, sk)
    store.end_step(done)
    running = store.leased_steps([leased, done, free])
    assert list(running) == [leased]
    assert 0 < running[leased] <= 60_000
    store.release_lease(leased)
    assert store.leased_steps([leased, done, free]) == {}
    assert store.leased_steps([]) == {}


@pytest.mark.fleet
def test_a_held_lease_is_renewed_and_a_dead_holders_runs_out(base_fleet: Fleet, sk: str) -> None:
    """Issue 10: leases are short and renewed while their worker lives. Here a lease of 600 ms,
    renewed every 200 ms: it outlives many of its lengths while held, and runs out once its
    holder stops renewing (a worker that died), so another delivery takes the step over."""
    from tests.test_pipeline import wait_for
    from worker.edges.step_leases import LeaseKeeper

    backend = _redis(base_fleet)
    store = port(backend)
    assert isinstance(store, RedisStore)
    store._keeper = LeaseKeeper(store.client, lease_ms=600)
    step, key = keys.round_step(sk, 0), keys.step_state(keys.round_step(sk, 0))
    start = store.begin_step(step, 600, None, sk)
    assert start.leased and start.lease
    with store.hold(step, start.lease):
        lowest = [600]

        def renewed() -> bool:  # the remaining time went down, then back up
            left = int(store.client.pttl(key))
            lowest[0] = min(lowest[0], left)
            return left > lowest[0] + 150

        for _ in range(3):
            lowest[0] = 600
            wait_for(renewed, timeout_s=5)
        assert store.begin_step(step, 600, None, sk).leased is False  # still held
    wait_for(lambda: store.begin_step(step, 600, None, sk).leased, timeout_s=5)


@pytest.mark.fleet
def test_a_lease_that_ran_out_in_an_outage_is_taken_back_unless_another_took_it(
    base_fleet: Fleet, sk: str
) -> None:
    """Its holder could not renew it (a cut network) and it ran out: still running the step,
    the holder takes it back, so a stand-in delivery waits instead of making the step's model
    call again. One another delivery took, and one its own delivery released, stay theirs;
    nor is one made again whose session retired (its record there, its steps' state deleted
    by the ending's commit, which a renewal may race)."""
    from tests.test_pipeline import wait_for
    from worker.edges.step_leases import LeaseKeeper

    backend = _redis(base_fleet)
    store = port(backend)
    assert isinstance(store, RedisStore)
    store._keeper = LeaseKeeper(store.client, lease_ms=600)
    ran_out, taken, released = (keys.round_step(sk, n) for n in range(3))
    starts = {step: store.begin_step(step, 600, None, sk) for step in (ran_out, taken, released)}
    with contextlib.ExitStack() as held:
        for step, start in starts.items():
            held.enter_context(store.hold(step, start.lease))
        retired = keys.round_step(f"{sk}-ended", 0)
        held.enter_context(store.hold(retired, "ending.1@here"))
        store.client.set(keys.record(f"{sk}-ended"), b"{}", ex=60)  # retired: its state gone
        store.client.delete(keys.step_state(ran_out))  # expired while cut off
        store.client.set(keys.step_state(taken), keys.step_lease("stand-in.1@elsewhere"))
        store.release_lease(released)
        mine = keys.step_lease(starts[ran_out].lease)
        wait_for(lambda: store.client.get(keys.step_state(ran_out)) == mine, timeout_s=5)
        wait_for(lambda: int(store.client.pttl(keys.step_state(ran_out))) > 0, timeout_s=5)
        assert store.client.get(keys.step_state(taken)) == keys.step_lease("stand-in.1@elsewhere")
        assert store.client.get(keys.step_state(released)) is None
        assert store.client.get(keys.step_state(retired)) is None  # renewed with ran_out

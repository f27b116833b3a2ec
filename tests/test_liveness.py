"""A killed worker's step leases and broker messages are taken over at once by a worker of
the same machine (worker/edges/liveness.py), not after their 15 s TTL: the lease names its
process, and so does a broker consumer. A process of another machine, or one alive, is
waited for as before."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import redis
from kombu.connection import Connection

from producer.fleet import Fleet
from schemas import keys
from tests.test_broker import _queued_ids, broker_connection, held_by_others
from worker.edges import broker_consumers, liveness
from worker.edges.store import RedisStore

REDIS_DB = 13
LEASE_MS = 15_000


def gone_pid() -> int:
    """The pid of a process of this machine that has ended (and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_process_that_ended_or_is_a_zombie_is_gone_and_a_live_one_is_not() -> None:
    assert liveness.pid_gone(gone_pid())
    zombie = subprocess.Popen(["true"])
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert liveness.pid_gone(zombie.pid)
    finally:
        zombie.wait()
    assert not liveness.pid_gone(os.getpid())
    assert not liveness.process_gone(f"{gone_pid()}@another-machine")  # not ours to judge
    assert not liveness.process_gone(liveness.this_process())


def test_a_token_of_this_process_is_abandoned_once_its_delivery_ended() -> None:
    token = liveness.new_token("t1")
    assert not liveness.token_abandoned(token)
    liveness.retire(token)
    assert liveness.token_abandoned(token)
    assert liveness.token_abandoned(f"t2.{gone_pid()}@{liveness.HOST}")
    assert not liveness.token_abandoned("t3")  # a lease of an older fleet names no process


@pytest.fixture
def store(base_fleet: Fleet) -> Iterator[RedisStore]:
    client = redis.Redis.from_url(base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    client.flushdb()
    yield RedisStore(client, ttl_s=600)
    client.flushdb()
    client.close()


def _leased_by(store: RedisStore, token: str) -> str:
    step = f"{uuid.uuid4().hex[:12]}.r0"
    store.client.set(keys.step_state(step), keys.step_lease(token), px=LEASE_MS)
    store.client.set(keys.tries(step), 1)
    return step


@pytest.mark.fleet
def test_a_lease_of_a_process_that_is_gone_is_taken_over_and_counted(store: RedisStore) -> None:
    step = _leased_by(store, f"dead.{gone_pid()}@{liveness.HOST}")
    start = store.begin_step(step, LEASE_MS)
    assert start.leased and start.tries == 2  # the killed delivery's try, and this one
    state = store.client.get(keys.step_state(step))
    assert state == keys.step_lease(start.lease)


@pytest.mark.fleet
def test_a_lease_left_behind_by_this_process_is_taken_over(store: RedisStore) -> None:
    """Its release could not reach Redis (an outage), and no delivery of it holds it."""
    abandoned = liveness.new_token("released-in-an-outage")
    liveness.retire(abandoned)
    assert store.begin_step(_leased_by(store, abandoned), LEASE_MS).leased
    held = liveness.new_token("held")  # a delivery of this process works on it
    try:
        assert not store.begin_step(_leased_by(store, held), LEASE_MS).leased
    finally:
        liveness.retire(held)


@pytest.mark.fleet
def test_a_step_this_process_runs_is_not_taken_by_its_redelivery_when_its_lease_ran_out(
    store: RedisStore,
) -> None:
    """A cut: the lease ran out unrenewed and the broker gave the step again to this process.
    The redelivery waits for the renewer to take the lease back (no second model call)."""
    step = f"{uuid.uuid4().hex[:12]}.r0"
    first = store.begin_step(step, LEASE_MS)
    assert first.leased
    with store.hold(step, first.lease):
        store.client.delete(keys.step_state(step))  # ran out in the cut
        again = store.begin_step(step, LEASE_MS)
        assert not again.leased and not again.published
        assert store.client.get(keys.step_state(step)) is None  # not taken
        assert store.lease_left_ms(step) >= 1_000  # put off until the renewer has run
    assert store.begin_step(step, LEASE_MS).leased  # that delivery ended: free for the next


@pytest.mark.fleet
def test_a_lease_of_a_live_process_or_another_machine_is_waited_for(store: RedisStore) -> None:
    for holder in (f"{os.getppid()}@{liveness.HOST}", f"{gone_pid()}@another-machine", ""):
        step = _leased_by(store, f"x.{holder}" if holder else "old-format")
        start = store.begin_step(step, LEASE_MS)
        assert not start.leased and start.tries == 1, holder
        assert store.lease_left_ms(step) > LEASE_MS - 5_000


@pytest.fixture
def conn(base_fleet: Fleet) -> Iterator[tuple[Connection, redis.Redis]]:
    yield from broker_connection(base_fleet, REDIS_DB, dead_after_s=60)


@pytest.mark.fleet
def test_messages_of_a_consumer_whose_process_is_gone_are_handed_out_at_once(
    conn: tuple[Connection, redis.Redis],
) -> None:
    """Its heartbeat has not run out (60 s here): on this machine, its process is known gone
    (a killed worker), or it is this process's and no longer live in it (a channel closed
    when the connection was lost). Another machine's waits for its heartbeat."""
    connection, client = conn
    holders = {
        "killed": f"aaaaaaaaaaaa.{gone_pid()}@{liveness.HOST}",
        "closed": liveness.named("bbbbbbbbbbbb"),
        "elsewhere": f"cccccccccccc.{gone_pid()}@another-machine",
    }
    held_by_others(connection, client, holders)
    for consumer in holders.values():
        client.set(broker_consumers.alive_key(consumer), 1, ex=60)
    connection.channel().qos.restore_visible()
    assert sorted(_queued_ids(client)) == ["closed", "killed"]
    (held,) = broker_consumers.taken_messages(client)
    assert json.loads(held)[0]["headers"]["id"] == "elsewhere"

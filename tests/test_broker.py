"""The broker's unacked bookkeeping (worker/edges/broker.py) on a real Redis: a taken message
is held in its consumer's hash until acked; it goes back to its queue when rejected with
requeue, when its channel closes, or when its consumer stops beating, and never while the
consumer beats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from time import monotonic
from typing import Any

import pytest
import redis
from celery.worker import state as celery_state
from kombu.connection import Connection
from kombu.entity import Queue
from kombu.messaging import Consumer

from producer.fleet import Fleet
from worker.edges import broker, broker_consumers, liveness
from worker.edges.dispatch import task_message

pytestmark = pytest.mark.fleet
REDIS_DB = 12
QUEUE = "broker-test"


def broker_connection(
    base_fleet: Fleet, db: int, dead_after_s: int
) -> Iterator[tuple[Connection, redis.Redis]]:
    """A connection through cchatq's transport to an empty database, and a client of it."""
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    connection = Connection(
        url, transport=broker.Transport, transport_options={"consumer_dead_after_s": dead_after_s}
    )
    yield connection, client
    connection.release()
    client.flushdb()
    client.close()


@pytest.fixture
def conn(base_fleet: Fleet) -> Iterator[tuple[Connection, redis.Redis]]:
    yield from broker_connection(base_fleet, REDIS_DB, dead_after_s=5)


def _publish(client: redis.Redis, task_id: str) -> None:
    client.lpush(QUEUE, task_message("cchatq.round", [task_id, 0], task_id, QUEUE))


def _queued_ids(client: redis.Redis) -> list[str]:
    return [json.loads(m)["headers"]["id"] for m in client.lrange(QUEUE, 0, -1)]


def _take(channel: Any) -> Any:
    message = channel.basic_get(QUEUE)
    assert message is not None
    return message


def held_by_others(connection: Connection, client: redis.Redis, holders: dict[str, str]) -> None:
    """A message per holder (named by its task id), taken by a consumer of that name, which
    is none of this process's live ones."""
    for name, consumer in holders.items():
        _publish(client, name)
        channel = connection.channel()
        channel.qos.consumer = consumer
        _take(channel)
        broker._LIVE.discard(channel.qos)


def test_a_taken_message_is_held_until_acked(conn: tuple[Connection, redis.Redis]) -> None:
    connection, client = conn
    _publish(client, "a")
    channel = connection.channel()
    message = _take(channel)
    assert _queued_ids(client) == []
    assert len(broker_consumers.taken_messages(client)) == 1
    message.ack()
    assert broker_consumers.taken_messages(client) == []
    channel.qos.restore_visible()  # our own consumer beats: nothing to give back
    assert _queued_ids(client) == []


def test_rejected_with_requeue_or_left_at_close_it_goes_back(
    conn: tuple[Connection, redis.Redis],
) -> None:
    connection, client = conn
    _publish(client, "a")
    _publish(client, "b")
    channel = connection.channel()
    first = _take(channel)
    first.reject(requeue=True)
    assert sorted(_queued_ids(client)) == ["a", "b"]
    _take(channel)
    _take(channel)
    channel.close()  # kombu gives back what a closing channel holds
    assert sorted(_queued_ids(client)) == ["a", "b"]
    assert broker_consumers.taken_messages(client) == []


def test_a_consumer_that_stopped_beating_has_its_messages_handed_out_again(
    conn: tuple[Connection, redis.Redis],
) -> None:
    connection, client = conn
    _publish(client, "held-by-the-dead")
    _publish(client, "held-by-the-living")
    dead, living, sweeper = connection.channel(), connection.channel(), connection.channel()
    living.qos.consumer = "abcdefabcdef.4242@another-machine"  # its process is not ours to see
    _take(dead)
    _take(living)
    # the dead one's process is gone: it is no consumer of ours, and its heartbeat has run out
    broker._LIVE.discard(dead.qos)
    broker._LIVE.discard(living.qos)
    client.delete(broker_consumers.alive_key(dead.qos.consumer))
    client.set(
        broker_consumers.alive_key(living.qos.consumer), 1, ex=60
    )  # another process, beating
    sweeper.qos.restore_visible()
    assert _queued_ids(client) == ["held-by-the-dead"]
    restored = json.loads(client.lindex(QUEUE, 0) or b"{}")
    assert restored["headers"]["redelivered"] is True
    assert len(broker_consumers.taken_messages(client)) == 1  # the living one's, still held
    assert broker_consumers.alive_key(sweeper.qos.consumer).encode() in client.keys(
        "_cchatq:broker:alive:*"
    )
    sweeper.qos.restore_visible()  # a second sweep finds nothing more to do
    assert _queued_ids(client) == ["held-by-the-dead"]


def _consume(connection: Connection, n: int) -> list[Any]:
    """Take n messages the way a worker does: a consumer of one queue, the poller's BLMOVE."""
    got: list[Any] = []
    channel = connection.channel()
    consumer = Consumer(channel, queues=[Queue(QUEUE, routing_key=QUEUE)], accept=["json"])
    consumer.register_callback(lambda _body, message: got.append(message))
    consumer.consume()
    while len(got) < n:
        connection.drain_events(timeout=5)
    return got


def test_a_one_queue_consumer_takes_and_holds_in_one_move_and_an_ack_forgets_it(
    conn: tuple[Connection, redis.Redis],
) -> None:
    connection, client = conn
    for task_id in ("a", "b"):
        _publish(client, task_id)
    first, second = _consume(connection, 2)
    assert _queued_ids(client) == []
    held = [json.loads(m)["headers"]["id"] for m in broker_consumers.taken_messages(client)]
    assert sorted(held) == ["a", "b"]
    assert client.keys("_cchatq:broker:unacked:*") == []  # held by the move, no hash entry
    first.ack()
    assert [json.loads(m)["headers"]["id"] for m in broker_consumers.taken_messages(client)] == [
        second.headers["id"]
    ]
    second.reject(requeue=True)
    assert _queued_ids(client) == [second.headers["id"]]
    assert broker_consumers.taken_messages(client) == []


def test_what_a_dead_one_queue_consumer_moved_goes_back_to_its_queue(
    conn: tuple[Connection, redis.Redis],
) -> None:
    connection, client = conn
    _publish(client, "moved-by-the-dead")
    (message,) = _consume(connection, 1)
    dead = message.channel.qos
    broker._LIVE.discard(dead)
    client.delete(broker_consumers.alive_key(dead.consumer))
    connection.channel().qos.restore_visible()
    assert _queued_ids(client) == ["moved-by-the-dead"]
    assert broker_consumers.taken_messages(client) == []


def test_a_process_that_could_not_beat_sweeps_only_the_consumers_known_gone(
    conn: tuple[Connection, redis.Redis], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own beats stopped longer than a heartbeat lasts (a silent cut): another machine's
    heartbeat that ran out meanwhile may have run out for the same cut, so that consumer keeps
    its messages until this process has beaten that long again; a consumer of this machine
    whose process is gone is swept at once."""
    connection, client = conn
    holders = {"gone": liveness.named("dddddddddddd"), "cut": "eeeeeeeeeeee.4242@another-host"}
    held_by_others(connection, client, holders)
    for consumer in holders.values():
        client.delete(broker_consumers.alive_key(consumer))  # its heartbeat ran out
    sweeper = connection.channel().qos
    monkeypatch.setattr(broker_consumers.OwnBeats, "quiet_until", 0.0)
    monkeypatch.setattr(broker_consumers.OwnBeats, "beaten_at", monotonic() - 60)  # cut 60 s
    sweeper.restore_visible()
    assert _queued_ids(client) == ["gone"]
    monkeypatch.setattr(broker_consumers.OwnBeats, "quiet_until", monotonic())  # beaten 5 s
    sweeper.restore_visible()
    assert sorted(_queued_ids(client)) == ["cut", "gone"]


class _Running:
    """A task this process runs (Celery's worker state holds requests by weak reference)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


def test_messages_of_tasks_still_running_here_stay_held_when_their_channel_closes(
    conn: tuple[Connection, redis.Redis],
) -> None:
    """The connection was lost under running tasks: their messages are not handed out again
    (the tasks acknowledge them as they end), the others go back at once; once the task has
    ended, a sweep gives back what it could not acknowledge."""
    connection, client = conn
    _publish(client, "running")
    _publish(client, "waiting")
    closed = connection.channel()
    _take(closed)
    _take(closed)
    running = _Running("running")
    celery_state.active_requests.add(running)
    try:
        closed.qos.restore_unacked()  # as the channel closes
        assert _queued_ids(client) == ["waiting"]
        client.delete(QUEUE)
        held = [json.loads(m)[0]["headers"]["id"] for m in broker_consumers.taken_messages(client)]
        assert held == ["running"]
        broker._LIVE.discard(closed.qos)
        connection.channel().qos.restore_visible()  # its own consumer, closed: not while it runs
        assert _queued_ids(client) == []
    finally:
        celery_state.active_requests.discard(running)
    connection.channel().qos.restore_visible()
    assert _queued_ids(client) == ["running"]
    assert broker_consumers.taken_messages(client) == []

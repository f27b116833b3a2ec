"""User streams through the store, both halves: the program's (ProgramStore.user_events and
emit_user_event) and the user's (the twin's user_send / user_received; on Redis the producer's
UserStream). One contract over the in-memory twin and Redis (its half needs the private Redis:
fleet marker), then the producer's reading rules on Redis."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from producer.fleet import Fleet
from producer.user_stream import UserStream
from schemas import keys
from schemas.user_stream import CLOSE, DATA, OPEN, Frame, StreamEvent
from worker.edges.store import RedisStore
from worker.edges.store_programs import RedisProgramStore
from worker.guest.ports import ProgramStore
from worker.session.twins.store import MemoryStore

REDIS_DB = 9
TTL_S = 600


@dataclass
class Backend:
    store: ProgramStore
    send: Callable[[str, StreamEvent], None]  # the user's side
    received: Callable[[str], list[StreamEvent]]


def _memory() -> Backend:
    store = MemoryStore()
    return Backend(store, store.user_send, store.user_received)


def _client(base_fleet: Fleet) -> Any:  # redis-py, replies as bytes
    return redis.Redis.from_url(base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}")


def _redis(base_fleet: Fleet) -> Backend:
    client = _client(base_fleet)

    def send(run_sk: str, event: StreamEvent) -> None:
        stream = UserStream(client, run_sk, event.stream_id, TTL_S)
        if event.kind == OPEN:
            stream.open()
        elif event.kind == DATA:
            stream.send_frame(event.frame)
        else:
            stream.close()

    def received(run_sk: str) -> list[StreamEvent]:
        entries = client.xrange(keys.user_out(run_sk))
        return [e for _, fields in entries if (e := StreamEvent.from_fields(fields)) is not None]

    return Backend(RedisProgramStore(RedisStore(client, ttl_s=TTL_S)), send, received)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.fleet)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield _memory()
    else:
        yield _redis(request.getfixturevalue("base_fleet"))


@pytest.fixture
def run_sk() -> str:
    return uuid.uuid4().hex[:12]


def data(stream_id: int, text: str) -> StreamEvent:
    return StreamEvent(DATA, stream_id, Frame(stream_id, text.encode()).encode())


def test_the_program_reads_its_users_events_in_order_from_a_cursor(
    backend: Backend, run_sk: str
) -> None:
    sent = [StreamEvent(OPEN, 1), data(1, "a"), data(1, "b"), StreamEvent(CLOSE, 1)]
    assert backend.store.user_events(run_sk, "0-0") == []
    for event in sent[:2]:
        backend.send(run_sk, event)
    first = backend.store.user_events(run_sk, "0-0")
    assert [event for _, event in first] == sent[:2]
    for event in sent[2:]:
        backend.send(run_sk, event)
    rest = backend.store.user_events(run_sk, first[-1][0])
    assert [event for _, event in rest] == sent[2:]
    assert backend.store.user_events(run_sk, rest[-1][0]) == []
    # from the start again (a replayed run): all of it
    assert [event for _, event in backend.store.user_events(run_sk, "0-0")] == sent


def test_a_users_send_wakes_the_runs_waits(backend: Backend, run_sk: str) -> None:
    backend.send(run_sk, StreamEvent(OPEN, 4))
    assert backend.store.wait_done(keys.run_batch(run_sk), 5.0) == [keys.USER_WAKE]


def test_the_programs_writes_land_once_in_order(backend: Backend, run_sk: str) -> None:
    emit = backend.store.emit_user_event
    assert emit(run_sk, 1, data(2, "one")) is True
    assert emit(run_sk, 2, data(2, "two")) is True
    assert emit(run_sk, 1, data(2, "one")) is False  # a replayed run writing it again
    assert emit(run_sk, 2, data(2, "two")) is False
    assert emit(run_sk, 3, StreamEvent(CLOSE, 2)) is True
    assert backend.received(run_sk) == [data(2, "one"), data(2, "two"), StreamEvent(CLOSE, 2)]


# the producer's side on Redis ---------------------------------------------------------------


@pytest.mark.fleet
def test_user_stream_reads_its_own_stream_until_the_program_closes_it(
    base_fleet: Fleet, run_sk: str
) -> None:
    client = _client(base_fleet)
    store = RedisProgramStore(RedisStore(client, ttl_s=TTL_S))
    for seq, event in enumerate(
        [data(1, "for 1"), data(2, "for 2"), data(1, "again"), StreamEvent(CLOSE, 1)], 1
    ):
        store.emit_user_event(run_sk, seq, event)
    assert list(UserStream(client, run_sk, 1, TTL_S).lines()) == ["for 1", "again"]


@pytest.mark.fleet
def test_user_stream_stops_reading_once_the_run_ended(base_fleet: Fleet, run_sk: str) -> None:
    client = _client(base_fleet)
    store = RedisProgramStore(RedisStore(client, ttl_s=TTL_S))
    store.emit_user_event(run_sk, 1, data(1, "last words"))
    client.set(keys.response(run_sk), b'{"exit_code":0}', ex=TTL_S)  # the run's end
    assert list(UserStream(client, run_sk, 1, TTL_S).lines()) == ["last words"]


@pytest.mark.fleet
def test_user_stream_refuses_frames_that_are_not_its_own(base_fleet: Fleet, run_sk: str) -> None:
    stream = UserStream(_client(base_fleet), run_sk, 1, TTL_S)
    for bad in (b"not a frame", Frame(2, b"x").encode(), Frame(1, b"x" * (256 << 10)).encode()):
        with pytest.raises(ValueError):
            stream.send_frame(bad)
    stream.close()
    with pytest.raises(ValueError):
        stream.send("after the end")

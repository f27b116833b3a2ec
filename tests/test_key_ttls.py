"""Every key cchatq writes has a TTL (docs/architecture.md section 4), also the keys of a session
whose keys expired or were lost with Redis's data when a late step, a cancel's finish or a
background call still writes to it: such a writer changes keys that are there, or makes them
with their TTL, never a key that lives forever. On the private Redis (fleet marker)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis

from producer.fleet import Fleet
from schemas import keys
from schemas.bodies import dump_body
from schemas.partial import PartialRound
from schemas.session_record import StoredRecord, read_record
from worker.edges.store import RedisStore
from worker.edges.store_trace import TRACE_FLEET_KEEP_MS
from worker.session.store_ports import TraceWrite
from worker.session.trace import event

pytestmark = pytest.mark.fleet  # the private Redis

REDIS_DB = 15
TTL_S = 600


@pytest.fixture
def client(base_fleet: Fleet) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _without_ttl(client: redis.Redis, sk: str) -> list[str]:
    """The keys of session `sk` with no TTL (the fleet's trace stream gets its own TTL from
    the reconciler's next pass)."""
    return sorted(k.decode() for k in client.scan_iter(f"*{sk}*") if client.ttl(k) == -1)


def test_the_late_writers_of_a_lost_session_leave_no_key_without_a_ttl(
    client: redis.Redis,
) -> None:
    """A session none of whose keys are left: a round starting (its state for the meta), a
    rate-limited round giving its try back, a background call's progress and a tool step's
    trace events, a dead-lettered finish writing its end, its partial text, its async task."""
    store = RedisStore(client, ttl_s=TTL_S)
    sk = uuid.uuid4().hex[:12]
    step = keys.round_step(sk, 1)
    start = store.begin_step(step, 60_000, {"state": "round 1"}, sk, first=False)
    client.delete(keys.tries(step))  # expired while the round waited for its model call
    store.defer_step(step, sk, start.tries_stored, 1_000)
    store.trace(TraceWrite(sk, (event("task.progress", "x", percent=50),)))
    store.set_partial(sk, PartialRound("half"))
    store.update_task(sk, "task-0-0", {"status": "running"})
    body = {"error": {"code": "step_failed", "message": "m"}}
    store.dead_letter(keys.finish_step(sk), sk, body, "why")
    assert store.write_result(sk, dump_body(body), {"id": sk}, [], keys.finish_step(sk))
    assert _without_ttl(client, sk) == []
    assert not client.exists(keys.trace(sk))  # events of a stream that is gone are dropped
    assert client.hget(keys.meta(sk), "state") == b"done"  # its end, as long as its response


def test_a_step_of_a_live_session_keeps_its_meta_and_its_ttl(client: redis.Redis) -> None:
    store = RedisStore(client, ttl_s=TTL_S)
    sk = uuid.uuid4().hex[:12]
    client.hset(keys.meta(sk), mapping={"id": "x", "state": "queued"})
    client.expire(keys.meta(sk), TTL_S)
    store.begin_step(keys.round_step(sk, 0), 60_000, {"state": "round 0"}, sk)
    assert client.hget(keys.meta(sk), "state") == b"round 0"
    assert 0 < client.ttl(keys.meta(sk)) <= TTL_S


def test_a_sessions_trace_stream_is_made_with_its_ttl_by_its_first_round(
    client: redis.Redis,
) -> None:
    """Round 0's events make the stream, with its TTL; a later step's add to it."""
    store = RedisStore(client, ttl_s=TTL_S)
    sk = uuid.uuid4().hex[:12]
    store.trace(TraceWrite(sk, (event("session.started", "x"),), expire=True))
    store.trace(TraceWrite(sk, (event("tool.call.started", "x"),)))
    assert client.xlen(keys.trace(sk)) == 2
    assert 0 < client.ttl(keys.trace(sk)) <= TTL_S


def _events(client: redis.Redis, sk: str) -> list[str]:
    entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(keys.trace(sk))  # type: ignore[assignment]
    field = keys.TRACE_FIELD.encode()
    return [e["event"] for _, fields in entries for e in json.loads(fields[field])]


def _retired(client: redis.Redis, sk: str) -> StoredRecord:
    raw = client.get(keys.record(sk))
    assert isinstance(raw, bytes)
    return read_record(raw)


def test_a_session_finished_event_lands_only_with_its_ending(client: redis.Redis) -> None:
    """The ending step's entry keeps its session.finished while the session's stored ending
    is that step's; when a failover lost the ending, or another step's stands, the entry lands
    without it (the one who writes the ending says it), so a history never shows two."""
    store = RedisStore(client, ttl_s=TTL_S)
    ended, lost, bare = (uuid.uuid4().hex[:12] for _ in range(3))
    store.write_result(ended, b"{}", {"id": "x", "body": {}}, None, "r1")
    client.hset(keys.meta(lost), "id", "x")  # submitted; its ending lost with a failover
    last_round = (event("model.call.finished", "x", round=1), event("session.finished", "x"))
    for sk in (ended, lost):
        store.trace(TraceWrite(sk, last_round, expire=True, ended_by="r1"))
    store.write_result(bare, b"{}", {"id": "x", "body": {}}, None, "finish")  # another ended it
    store.trace(TraceWrite(bare, (event("session.finished", "x"),), expire=True, ended_by="r1"))
    # the ended session is retired: its events folded into its record, its stream and meta gone
    assert not client.exists(keys.trace(ended), keys.meta(ended))
    retired = _retired(client, ended)
    assert [e["event"] for e in retired.trace] == ["model.call.finished", "session.finished"]
    assert retired.retired and retired.meta["ended_by"] == "r1"
    assert 0 < client.ttl(keys.record(ended)) <= TTL_S
    assert 0 < client.ttl(keys.response(ended)) <= TTL_S
    assert _events(client, lost) == ["model.call.finished"]
    assert 0 < client.ttl(keys.trace(lost)) <= TTL_S
    assert not client.exists(keys.trace(bare))  # nothing else to say: no stream made
    # a second delivery of the ending step (its stand-in while it was cut off) says it no more
    store.trace(TraceWrite(ended, last_round, expire=True, ended_by="r1"))
    assert not client.exists(keys.trace(ended), keys.meta(ended))
    assert _retired(client, ended).trace == retired.trace


def test_the_fleets_stream_keeps_its_last_minutes_and_its_ttl_by_the_reconcilers_pass(
    client: redis.Redis,
) -> None:
    """Sessions' writes only add to the fleet's stream (no command of theirs tends it); a pass
    of the reconciler (a fleet event that sets `expire`) trims what is older than
    TRACE_FLEET_KEEP_MS and sets its TTL, so its memory levels off within minutes."""
    store = RedisStore(client, ttl_s=TTL_S)
    old_ms = store.clock.now_ms() - TRACE_FLEET_KEEP_MS - 120_000
    for n in range(200):  # events of long ago, as Redis stamped them then
        client.xadd(keys.TRACE, {keys.TRACE_FIELD: "[]"}, id=f"{old_ms}-{n}")
    sk = uuid.uuid4().hex[:12]
    store.trace(TraceWrite(sk, (event("session.started", "x"),), expire=True))
    assert client.xlen(keys.TRACE) == 201 and client.ttl(keys.TRACE) == -1
    store.trace(TraceWrite("", (event("reconciler.pass", ""),), expire=True))
    assert client.xlen(keys.TRACE) == 2  # the session's entry and the pass's
    assert 0 < client.ttl(keys.TRACE) <= TTL_S


def test_results_kept_by_count_keep_the_latest(client: redis.Redis) -> None:
    """With results kept by count (CCHATQ_RESULTS_KEEP), each retired session enters the
    finished index and the reconciler's trim deletes the results of the oldest beyond it."""
    store = RedisStore(client, ttl_s=TTL_S, results_keep=2)
    client.delete(keys.FINISHED)
    sks = [uuid.uuid4().hex[:12] for _ in range(3)]
    for sk in sks:
        store.write_result(sk, b"{}", {"id": sk, "body": {}}, None, "r1")
        store.trace(TraceWrite(sk, (event("session.finished", sk),), expire=True, ended_by="r1"))
        assert _retired(client, sk).retired
    assert store.trim_results(2) == 1
    assert not client.exists(keys.record(sks[0]), keys.response(sks[0]))
    assert all(client.exists(keys.record(sk), keys.response(sk)) == 2 for sk in sks[1:])
    assert client.zcard(keys.FINISHED) == 2 and store.trim_results(2) == 0


def test_a_session_retires_without_trace_events(client: redis.Redis) -> None:
    """With CCHATQ_TRACE=off its ending step writes no event, and the session retires still:
    its working keys deleted, its record kept (with no events in it)."""
    store = RedisStore(client, ttl_s=TTL_S)
    sk = uuid.uuid4().hex[:12]
    client.set(keys.spec(sk), b"{}", ex=TTL_S)
    store.write_result(sk, b"{}", {"id": sk, "body": {}}, None, "r1")
    store.trace(TraceWrite(sk, (), expire=True, ended_by="r1"))
    assert not client.exists(keys.spec(sk), keys.meta(sk))
    stored = _retired(client, sk)
    assert stored.retired and stored.trace == [] and stored.meta["ended_by"] == "r1"

"""One contract for the session store port, run against the in-memory twin and against
Redis (as dramatiq runs its result backends over ["redis", "stub"]): what the steps rely on
(first writer wins, leases, published markers, try counts, the fan-in count, results written
once and announced) holds on both. The Redis half needs the private Redis (fleet marker)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import redis

from producer.fleet import Fleet
from schemas import keys
from schemas.bodies import dump_body
from schemas.fleet import McpServerConfig
from schemas.mcp import McpToolInfo, offered_tools
from schemas.partial import PartialRound
from schemas.spec_types import (
    FunctionSpec,
    McpToolRef,
    SessionSpec,
    ToolSpec,
    spec_from_json,
    spec_to_json,
)
from worker.codecs.reply import Reply
from worker.edges.redis_pool import pooled_client
from worker.edges.store import RedisStore
from worker.errors import StoreError
from worker.session.engine import ToolRun
from worker.session.outcomes import ToolFailure, ToolOutcome
from worker.session.round_record import PlannedRun
from worker.session.store_ports import RoundReads, SessionStore, ToolReads
from worker.session.twins.store import MemoryStore

REDIS_DB = 9


@dataclass
class Backend:
    """A store under test, with what a producer does to it (submit, cancel, chunk)."""

    store: SessionStore
    submit: Any
    cancel: Any
    chunk: Any


def _memory() -> Backend:
    store = MemoryStore()

    def chunk(batch: str, n: int, members: list[str]) -> None:
        store.chunks[(batch, n)] = [keys.ChunkMember.decode(m) for m in members]

    def submit(sk: str, spec: dict[str, Any], batch: str) -> None:
        store.submit(sk, spec_from_json(spec), batch)

    return Backend(store, submit, store.cancel, chunk)


def _redis(base_fleet: Fleet) -> Backend:
    url = base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    return _on(redis.Redis.from_url(url))


def _on(client: Any) -> Backend:
    store = RedisStore(client, ttl_s=600)

    def submit(sk: str, spec: dict[str, Any], batch: str) -> None:
        client.set(keys.spec(sk), dump_body(spec), ex=600)
        client.hset(keys.meta(sk), mapping={"id": spec["id"], "submitted_ms": 1})
        if batch:
            client.sadd(keys.watchers(sk), batch)

    def chunk(batch: str, n: int, members: list[str]) -> None:
        client.rpush(keys.chunk(batch, n), *members)

    return Backend(store, submit, lambda sk: client.set(keys.cancel(sk), 1), chunk)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.fleet),
        pytest.param("cluster", marks=pytest.mark.fleet),
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield _memory()
    elif request.param == "redis":
        yield _redis(request.getfixturevalue("base_fleet"))
    else:
        yield _on(pooled_client(request.getfixturevalue("state_cluster"), 4))


@pytest.fixture
def sk() -> str:
    return uuid.uuid4().hex[:12]


def spec(sk: str) -> dict[str, Any]:
    return {"id": f"contract/{sk}", "model": "m", "messages": [], "limits": {"max_iterations": 3}}


def completion(*call_ids: str) -> dict[str, Any]:
    calls = [
        {"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for c in call_ids
    ]
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else "done"}
    if calls:
        message["tool_calls"] = calls
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def store_reply(store: Any, sk: str, round_no: int, raw: dict[str, Any]) -> Reply:
    return store.store_round(sk, round_no, Reply.parse(raw), ())


def test_a_round_is_stored_with_the_runs_its_plan_made(backend: Backend, sk: str) -> None:
    """A tool step reads its run as the round step planned it: id, tool, canonical args."""
    typed = spec_from_json(spec(sk))
    assert isinstance(typed, SessionSpec)
    backend.submit(sk, spec(sk), "")
    reply = Reply.parse(completion("a", "b"))
    tool = ToolSpec(FunctionSpec("get_weather"), "weather.wasm", export="get_weather")
    runs = (ToolRun(1, "b", "get_weather", tool, '{"city":"Paris"}'),)
    backend.store.store_round(sk, 0, reply, runs)
    stored, _ = backend.store.tool_inputs(sk, 0, 1)
    assert stored is not None and stored.calls == 2
    assert stored.runs == {1: PlannedRun("b", "get_weather", '{"city":"Paris"}')}
    with_tool = replace(typed, tools=(tool,))
    assert stored.run(with_tool, 1) == runs[0]
    assert stored.run(with_tool, 0) is None  # the plan made no run of call 0


def test_a_missing_spec_is_a_store_error(backend: Backend, sk: str) -> None:
    with pytest.raises(StoreError, match="spec not found"):
        backend.store.load_spec(sk)


def test_the_first_model_reply_wins(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    ours = Reply.parse(completion("a"))
    first = backend.store.store_round(sk, 0, ours, ())
    second = backend.store.store_round(sk, 0, Reply.parse(completion()), ())
    assert first is ours  # this call stored it
    assert first.completion == second.completion == completion("a")


def test_tool_outcomes_first_writer_wins_and_fan_in_counts_each_call_once(
    backend: Backend, sk: str
) -> None:
    backend.submit(sk, spec(sk), "")
    store_reply(backend.store, sk, 0, completion("a", "b"))
    store = backend.store
    assert store.store_tool_outcomes(sk, 0, {1: ToolOutcome.success("one")}, 2) == 1
    assert (
        store.store_tool_outcomes(
            sk, 0, {1: ToolOutcome(ok=False, failure=ToolFailure("RUNTIME_ERROR", "again"))}, 2
        )
        == 1
    )
    assert store.store_tool_outcomes(sk, 0, {0: ToolOutcome.success("zero")}, 2) == 2
    stored, outcome = store.tool_inputs(sk, 0, 1)
    assert stored is not None and stored.completion == completion("a", "b")
    assert outcome == ToolOutcome.success("one")
    assert store.tool_inputs(sk, 1, 0) == (None, None)
    session = store.load_session(sk, "replay")
    assert session.backend == "replay"
    assert [r.outcomes for r in session.rounds] == [
        {0: ToolOutcome.success("zero"), 1: ToolOutcome.success("one")}
    ]


def test_a_step_reads_what_it_asks_for_with_its_lease(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    store = backend.store
    store_reply(store, sk, 0, completion("a", "b"))
    store.store_tool_outcomes(sk, 0, {1: ToolOutcome.success("one")}, 2)
    start = store.begin_step(keys.round_step(sk, 1), 1000, None, sk, RoundReads(1, "r"))
    assert start.leased and start.session == store.load_session(sk, "r", upto_round=1)
    tool = store.begin_step(keys.tool_step(sk, 0, 1), 1000, None, sk, ToolReads(0, 1))
    assert tool.tool_inputs == store.tool_inputs(sk, 0, 1)
    assert tool.tool_inputs is not None
    stored, outcome = tool.tool_inputs
    assert stored is not None and stored.completion == completion("a", "b")
    assert outcome == ToolOutcome.success("one")
    assert store.begin_step(keys.round_step(sk, 2), 1000, None, sk).session is None


def test_load_session_reads_rounds_up_to_the_one_asked(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    store_reply(backend.store, sk, 0, completion("a"))
    backend.store.store_tool_outcomes(sk, 0, {0: ToolOutcome.success("x")}, 1)
    store_reply(backend.store, sk, 1, completion())
    assert len(backend.store.load_session(sk, "r").rounds) == 2
    assert len(backend.store.load_session(sk, "r", upto_round=0).rounds) == 1


def test_a_step_lease_is_held_once_and_its_tries_counted(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    store, step = backend.store, keys.round_step(sk, 0)
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
    assert store.meta(sk)["state"] == "round 0"


def test_a_late_step_of_a_lost_session_does_not_make_its_meta_again(
    backend: Backend, sk: str
) -> None:
    """A step records its state in its session's meta only while the meta is there: one of a
    session whose keys expired (or were lost with Redis's data) would make a meta with no TTL,
    and a producer would take the lost session for a live one."""
    store = backend.store
    store.begin_step(keys.round_step(sk, 1), 60_000, {"state": "round 1"}, sk)
    assert store.meta(sk) == {}
    backend.submit(sk, spec(sk), "")
    store.begin_step(keys.round_step(sk, 2), 60_000, {"state": "round 2"}, sk)
    assert store.meta(sk)["state"] == "round 2"


def test_tries_count_every_delivery_when_the_broker_vouches_for_the_first(
    backend: Backend, sk: str
) -> None:
    """A first delivery (`first=True`) is try 1 (the Redis store writes nothing for it); the
    redeliveries after it count on from 2; a rate-limited one gives its try back."""
    store = backend.store
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
    store = backend.store
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
    assert backend.store.begin_step(keys.finish_step(sk), 1000, None, sk).cancelled


def test_a_dead_letter_keeps_the_first_failure(backend: Backend, sk: str) -> None:
    store = backend.store
    assert store.failure(sk) is None
    store.dead_letter("s1", sk, {"error": {"code": "step_failed", "message": "one"}}, "why")
    store.dead_letter("s2", sk, {"error": {"code": "step_failed", "message": "two"}}, "why")
    assert store.failure(sk) == {"error": {"code": "step_failed", "message": "one"}}


def test_a_result_is_written_once_and_announced(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "batch-" + sk)
    store = backend.store
    assert not store.has_result(sk)
    assert store.write_result(sk, b'{"ok":1}', {"id": "x"}) == "ok"
    assert store.write_result(sk, b'{"ok":2}', {"id": "y"}) is None
    assert store.has_result(sk)
    assert store.watcher_batches(sk) == ["batch-" + sk]
    assert store.meta(sk)["state"] == "done"
    store.set_partial(sk, PartialRound("half"))
    store.set_partial(sk, None)


def test_the_end_is_decided_once_and_owned_by_the_step_that_wrote_it(
    backend: Backend, sk: str
) -> None:
    """The first writer ends the session: the meta keeps its outcome and names it; another
    step's write changes nothing and tells no batch; the winner's own redelivery (whose commit
    may not have been written) is told it ended the session."""
    backend.submit(sk, spec(sk), "")
    store = backend.store
    ok = {"id": "x", "body": {"choices": []}}
    cancelled = {"id": "x", "body": {"error": {"code": "cancelled", "message": "m"}}}
    round_step, finish = keys.round_step(sk, 0), keys.finish_step(sk)
    assert store.write_result(sk, b'{"choices":[]}', ok, [], round_step) == "ok"
    told: list[str] = []
    assert store.write_result(sk, b'{"error":{}}', cancelled, told, finish) is None
    assert told == []
    assert store.write_result(sk, b'{"error":{}}', cancelled, None, "") is None
    # the winner's redelivery, whose ending now says cancelled: told the outcome written
    assert store.write_result(sk, b'{"error":{}}', cancelled, [], round_step) == "ok"
    meta = store.meta(sk)
    assert (meta["state"], meta["outcome"], meta["ended_by"]) == ("done", "ok", round_step)


def test_only_steps_a_delivery_works_on_are_leased(backend: Backend, sk: str) -> None:
    store = backend.store
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


def test_chunk_members_in_order(backend: Backend, sk: str) -> None:
    backend.chunk("b" + sk, 0, ["x", "p:y", "z"])
    assert backend.store.chunk_members("b" + sk, 0) == [
        keys.ChunkMember("x"),
        keys.ChunkMember("y", program=True),
        keys.ChunkMember("z"),
    ]
    assert backend.store.chunk_members("b" + sk, 1) == []


def test_specs_round_trip_as_json(backend: Backend, sk: str) -> None:
    original = spec(sk) | {"params": {"temperature": 0.5, "stop": ["\n"]}}
    backend.submit(sk, original, "")
    assert spec_to_json(backend.store.load_spec(sk)) == spec_to_json(spec_from_json(original))


def test_a_specs_mcp_tools_are_stored_once_and_read_with_it(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk) | {"mcp_servers": ["fs"]}, "")
    unlisted = backend.store.load_spec(sk)
    assert isinstance(unlisted, SessionSpec) and unlisted.mcp_servers == ("fs",)
    server = McpServerConfig(id="fs", command=("x",), timeout_ms=3000)
    first = offered_tools(server, [McpToolInfo("add", "Add", {"type": "object"})])
    later = offered_tools(server, [McpToolInfo("echo", None, {"type": "object"})])
    backend.store.store_mcp_tools(sk, first)
    backend.store.store_mcp_tools(sk, later)  # a redelivered first round's: the first wins
    listed = backend.store.load_spec(sk)
    assert isinstance(listed, SessionSpec) and listed.mcp_servers == ()
    assert listed.tools == first and listed.tools[0].mcp == McpToolRef("fs", "add")


def test_a_round_with_many_calls_reads_every_outcome(backend: Backend, sk: str) -> None:
    """More calls than the store reads speculatively with the replies (a second read)."""
    backend.submit(sk, spec(sk), "")
    ids = [f"c{i}" for i in range(9)]
    store_reply(backend.store, sk, 0, completion(*ids))
    outcomes = {i: ToolOutcome.success(f"out{i}") for i in (0, 7, 8)}
    assert backend.store.store_tool_outcomes(sk, 0, outcomes, 9) == 3
    [round_0] = backend.store.load_session(sk, "r").rounds
    assert round_0.outcomes == {i: ToolOutcome.success(f"out{i}") for i in (0, 7, 8)}


def test_calls_under_max_parallel_are_queued_claimed_once_and_counted_until_answered(
    backend: Backend, sk: str
) -> None:
    store = backend.store
    backend.submit(sk, spec(sk), "")
    assert store.unstarted_calls(sk, 0, 4) == ([0, 1, 2, 3], 0)
    assert store.queue_calls(sk, 0, [0, 1], claim=False) == [0, 1]
    assert store.unstarted_calls(sk, 0, 4) == ([2, 3], 2)
    store.store_tool_outcomes(sk, 0, {0: ToolOutcome.success("zero")}, 4)
    assert store.unstarted_calls(sk, 0, 4) == ([2, 3], 1)
    # two finishing calls race for the next place: one wins it
    assert store.queue_calls(sk, 0, [2], claim=True) == [2]
    assert store.queue_calls(sk, 0, [2], claim=True) == []
    # a call whose step is leased holds a place too (a nudge published it)
    assert store.begin_step(keys.tool_step(sk, 0, 3), 60_000, None, sk).leased
    assert store.unstarted_calls(sk, 0, 4) == ([], 3)


@pytest.mark.fleet
def test_a_held_lease_is_renewed_and_a_dead_holders_runs_out(base_fleet: Fleet, sk: str) -> None:
    """Issue 10: leases are short and renewed while their worker lives. Here a lease of 600 ms,
    renewed every 200 ms: it outlives many of its lengths while held, and runs out once its
    holder stops renewing (a worker that died), so another delivery takes the step over."""
    from tests.test_pipeline import wait_for
    from worker.edges.step_leases import LeaseKeeper

    backend = _redis(base_fleet)
    store = backend.store
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
    call again. One another delivery took, and one its own delivery released, stay theirs."""
    from tests.test_pipeline import wait_for
    from worker.edges.step_leases import LeaseKeeper

    backend = _redis(base_fleet)
    store = backend.store
    assert isinstance(store, RedisStore)
    store._keeper = LeaseKeeper(store.client, lease_ms=600)
    ran_out, taken, released = (keys.round_step(sk, n) for n in range(3))
    starts = {step: store.begin_step(step, 600, None, sk) for step in (ran_out, taken, released)}
    with contextlib.ExitStack() as held:
        for step, start in starts.items():
            held.enter_context(store.hold(step, start.lease))
        store.client.delete(keys.step_state(ran_out))  # expired while cut off
        store.client.set(keys.step_state(taken), keys.step_lease("stand-in.1@elsewhere"))
        store.release_lease(released)
        mine = keys.step_lease(starts[ran_out].lease)
        wait_for(lambda: store.client.get(keys.step_state(ran_out)) == mine, timeout_s=5)
        wait_for(lambda: int(store.client.pttl(keys.step_state(ran_out))) > 0, timeout_s=5)
        assert store.client.get(keys.step_state(taken)) == keys.step_lease("stand-in.1@elsewhere")
        assert store.client.get(keys.step_state(released)) is None

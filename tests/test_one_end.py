"""A session ends once, whatever races its end: a cancel during a model call, a cancel racing
the natural end, a reconciler's nudge of a session ending, a step redelivered after the end.
Each race is played on the twins (no Redis, no workers): exactly one session.finished event,
after every other event of the session, the ending's outcome in the meta, and usage that holds
every model call that completed."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import keys
from tests.test_engine import WEATHER_FN
from tests.test_steps import SK, Pipeline, pipeline, reply, spec, submit
from worker.errors import RetryLater
from worker.session.trace import TraceEvent
from worker.session.twins.failing import FailingStore

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}  # reply()'s


def events(p: Pipeline) -> list[TraceEvent]:
    return list(p.store.traces.get(SK, []))


def finished(p: Pipeline) -> list[TraceEvent]:
    return [e for e in events(p) if e.event == "session.finished"]


def assert_ended_once(p: Pipeline, outcome: str) -> None:
    """One session.finished, the last event made, with the outcome the body and meta say."""
    ends = finished(p)
    assert len(ends) == 1, [e.event for e in events(p)]
    assert (ends[0].error or "ok") == outcome
    assert events(p)[-1].event == "session.finished"
    times = [e.ts_ms for e in events(p)]
    assert times == sorted(times)
    body = p.body()
    assert (body["error"]["code"] if "error" in body else "ok") == outcome
    assert p.store.meta(SK)["outcome"] == outcome


def usage(p: Pipeline) -> dict[str, int]:
    record = p.store.record(SK)
    assert record is not None
    return dict(record["metrics"]["usage"])


def cancel_and_finish(p: Pipeline) -> None:
    """`cchatq cancel`: the flag, then the finish step, run at once (the call is in flight).
    The finish waits for the call: it asks to come back, and is queued again."""
    p.store.cancel(SK)
    with pytest.raises(RetryLater):
        p.runner.finish(SK)
    p.queue.finish(SK)


@pytest.mark.parametrize("tools", [False, True], ids=["answer", "tool-calls"])
def test_a_cancel_during_a_model_call_ends_once_with_the_calls_tokens(tools: bool) -> None:
    def answered_while_cancelled(request: Any) -> dict[str, Any]:
        cancel_and_finish(p)
        if tools:
            return reply(None, ("call_1", "get_weather", '{"city":"Paris"}'))
        return reply("too late")

    p = pipeline([answered_while_cancelled])
    submit(p, spec(WEATHER_FN))
    p.drain()
    assert_ended_once(p, "cancelled")
    assert usage(p) == USAGE  # the call completed: its tokens count
    assert p.tools.calls == []  # the tool asked for never ran
    assert [m["role"] for m in p.transcript()][:2] == ["user", "assistant"]
    # the finish step's waits spent no try: it is not dead-lettered however long the call
    assert p.store.tries[keys.finish_step(SK)] <= 1
    assert p.store.deadletters == []


def test_a_finish_waits_as_long_as_the_call_and_spends_no_try() -> None:
    """More waits than max_step_attempts: none of them is a failure."""

    def slow(request: Any) -> dict[str, Any]:
        p.store.cancel(SK)
        for _ in range(5):
            with pytest.raises(RetryLater):
                p.runner.finish(SK)
        p.queue.finish(SK)
        return reply("done")

    p = pipeline([slow])
    submit(p, spec())
    p.drain()
    assert_ended_once(p, "cancelled")
    assert p.store.deadletters == []


def test_a_cancel_after_the_natural_end_changes_nothing() -> None:
    p = pipeline([reply("hello")])
    submit(p, spec())
    p.drain()
    p.store.cancel(SK)
    p.queue.finish(SK)  # `cchatq cancel` of a session that just ended
    p.drain()
    assert_ended_once(p, "ok")
    assert usage(p) == USAGE
    assert list(p.store.done["b"]) == [SK]  # the batch is told once


def test_a_cancel_racing_the_natural_end_ends_it_once_cancelled() -> None:
    """The flag lands while the last round's call is out, its finish step after the round
    ended the session: the round's ending reads the flag (cancel wins), the finish adds
    nothing."""

    def answer(request: Any) -> dict[str, Any]:
        p.store.cancel(SK)
        return reply("hello")

    p = pipeline([answer])
    submit(p, spec())
    p.drain()
    p.queue.finish(SK)
    p.drain()
    assert_ended_once(p, "cancelled")
    assert usage(p) == USAGE
    assert list(p.store.done["b"]) == [SK]


def test_a_nudge_of_a_session_ending_gives_one_end() -> None:
    """The last round stored its reply but failed before it could end the session; the
    reconciler's nudge publishes the finish step, which ends it; the round's retry then finds
    it ended, and says nothing more."""
    p = pipeline([reply("hello")], store=lambda m: FailingStore(m, ending_inputs=1))
    submit(p, spec())
    round_step = p.queue.pending.popleft()
    with pytest.raises(RetryLater):
        p.run(round_step)
    p.runner.nudge(SK)
    assert list(p.queue.pending) == [("finish", SK)]
    p.queue.pending.append(round_step)  # the round's retry comes back after the finish
    p.drain()
    assert_ended_once(p, "ok")
    assert usage(p) == USAGE
    assert p.store.meta(SK)["ended_by"] == keys.finish_step(SK)
    p.runner.nudge(SK)  # a nudge of an ended session tells the batches again, nothing more
    assert len(finished(p)) == 1


@pytest.mark.parametrize("ending", ["round", "finish"])
def test_a_step_redelivered_after_it_ended_the_session_ends_it_once(ending: str) -> None:
    """The step that wrote the ending failed before its commit (the published marker): its
    redelivery is the one that ended the session and says so, once; a later copy of it, or
    of any other step, says nothing."""
    p = pipeline([reply("hello")], store=lambda m: FailingStore(m, end_step=1))
    submit(p, spec())
    if ending == "finish":
        p.store.cancel(SK)
        p.queue.pending.clear()
        p.queue.finish(SK)
    p.drain()  # the commit fails once; the step is retried
    assert p.queue.retries == 1
    p.queue.round(SK, 0)  # copies of the steps, after the end
    p.queue.finish(SK)
    p.drain()
    assert_ended_once(p, "ok" if ending == "round" else "cancelled")
    step = keys.round_step(SK, 0) if ending == "round" else keys.finish_step(SK)
    assert p.store.meta(SK)["ended_by"] == step
    assert set(p.store.done["b"]) == {SK}  # told again by the redelivery: at least once


def test_a_dead_lettered_finish_after_the_end_says_nothing() -> None:
    """A finish step poisoned after another step ended the session writes nothing and
    makes no second session.finished."""
    p = pipeline([reply("hello")])
    submit(p, spec())
    p.drain()
    p.store.tries[keys.finish_step(SK)] = 99  # it has failed every try
    p.queue.finish(SK)
    p.drain()
    assert_ended_once(p, "ok")


def test_a_cancelled_program_run_ends_once() -> None:
    """A program run checks its cancel flag itself and ends cancelled; a finish step after it
    (a nudge, a copy) and a copy of its program step add no second end."""
    from schemas.program_spec import ProgramSpecSchema
    from worker.guest.step import ProgramSteps

    p = pipeline([])
    run = ProgramSpecSchema().load({"id": "p/1", "program": {"module": "agent.wasm"}})
    p.store.submit(SK, run, batch="b")
    p.store.cancel(SK)
    programs = ProgramSteps(p.runner, p.store, source=None)  # type: ignore[arg-type]
    assert programs.program(SK) == "cancelled"
    p.runner.finish(SK)
    assert programs.program(SK) is None  # published: a copy does nothing
    ends = finished(p)
    assert [(e.event, e.error) for e in ends] == [("session.finished", "cancelled")]
    assert p.body()["error"]["code"] == "cancelled"
    assert p.store.meta(SK)["ended_by"] == keys.program_step(SK)


def test_a_round_ending_while_the_finish_looks_at_the_steps_is_counted() -> None:
    """The finish step reads the session, then looks at its steps: a round whose call ends in
    between (its reply stored, its step done) is read again, and its tokens count."""
    calls = ("call_1", "get_weather", '{"city":"Paris"}')
    p = pipeline([reply(None, calls), reply(None, calls)])
    submit(p, spec(WEATHER_FN))
    p.queue.run_next(p.runner)  # round 0 asked for a tool
    p.queue.run_next(p.runner)  # whose step published round 1
    assert list(p.queue.pending) == [("round", SK, 1)]
    failed = {"error": {"code": "deadline_exceeded", "message": "past the deadline"}}
    p.store.dead_letter(f"{SK}.deadline", SK, failed, "deadline")
    look = p.store.leased_steps
    looks: list[list[str]] = []

    def round_ends_meanwhile(steps: list[str]) -> dict[str, int]:
        if not looks:  # round 1 runs to its end between the finish's two reads
            p.run(p.queue.pending.popleft())
        looks.append(steps)
        return look(steps)

    p.store.leased_steps = round_ends_meanwhile  # type: ignore[method-assign]
    assert p.runner.finish(SK) == "deadline_exceeded"
    assert len(looks) == 2  # looked again, at round 1's steps
    assert usage(p) == {k: 2 * v for k, v in USAGE.items()}
    ends = finished(p)
    assert [(e.event, e.error) for e in ends] == [("session.finished", "deadline_exceeded")]


def test_a_round_that_ended_the_session_and_is_cancelled_before_its_redelivery_ends_it_once() -> (
    None
):
    """The round wrote the ending but not its commit; `cchatq cancel` comes before its
    redelivery, which still commits the end (from the stored reply: no second call), and the
    cancel's finish step adds nothing."""
    p = pipeline([reply("hello")], store=lambda m: FailingStore(m, end_step=1))
    submit(p, spec())
    round_step = p.queue.pending.popleft()
    with pytest.raises(RetryLater):
        p.run(round_step)
    p.store.cancel(SK)
    p.queue.finish(SK)
    p.queue.pending.append(round_step)
    p.drain()
    assert_ended_once(p, "ok")
    assert len(p.provider.requests) == 1

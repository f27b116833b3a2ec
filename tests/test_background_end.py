"""A background call whose session ended (the fleet's deadline passed, or the model answered
without waiting for an async task) stops at its next progress report or within a second of
sleeping, as a cancelled one does, and its result is dropped: no outcome stored, no round
published, no task state written; only its events say how it stopped. One that had not
started when its session ended never runs. On the twins."""

from __future__ import annotations

import json
from typing import Any

from tests.test_engine import WEATHER_FN
from tests.test_steps import SK, Pipeline, pipeline, reply, submit
from tests.test_steps import spec as pipeline_spec
from tests.test_trace import run_pending, weather_model_once
from worker.session.ports import ToolCall


class EndsWhileRunning:
    """A long background tool, during which `end` ends its session; it then reports again,
    and goes on (returns its result) only if its watcher lets it."""

    def __init__(self, p: Pipeline, end: Any) -> None:
        self.p, self.end = p, end
        self.calls = 0
        self.went_on = False

    def run(self, call: ToolCall) -> str:
        self.calls += 1
        assert call.watcher is not None
        call.watcher.progress(10, "started")
        self.end(self.p)
        call.watcher.check()  # its next report: the session has ended
        self.went_on = True
        return "done"


def _past_its_deadline(p: Pipeline) -> None:
    p.runner.end_overdue(SK, 1_000)
    run_pending(p, "finish")  # an end does not wait for background calls


def _after_the_end(p: Pipeline) -> list[str]:
    names = [e.event for e in p.store.traces[SK]]
    return names[names.index("session.finished") + 1 :]


def test_a_waited_for_call_stops_when_its_session_passes_its_deadline() -> None:
    p = pipeline([weather_model_once, weather_model_once])
    tool = EndsWhileRunning(p, _past_its_deadline)
    p.runner.tools = lambda: tool
    session_spec = pipeline_spec(WEATHER_FN)
    session_spec["tools"][0]["policy"] = {"background": True, "timeout_ms": 600_000}
    submit(p, session_spec)
    p.drain()
    assert p.body()["error"]["code"] == "deadline_exceeded"
    assert (tool.calls, tool.went_on) == (1, False)
    assert (SK, 0, 0) not in p.store.outcomes  # dropped: nothing waits for it
    assert len(p.provider.requests) == 1  # no round after the end
    assert _after_the_end(p) == ["tool.call.failed", "task.failed"]  # NOT_RUN


def answers_without_waiting(request: Any) -> dict[str, Any]:
    if len(request.messages) == 1:
        return reply(None, ("call_0", "get_weather", '{"city":"Paris"}'))
    return reply("I will not wait for it")


def _async_session(p: Pipeline) -> None:
    session_spec = pipeline_spec(WEATHER_FN)
    session_spec["tools"][0]["policy"] = {"background": True, "background_mode": "async"}
    submit(p, session_spec)
    run_pending(p, "round")  # the model starts the task
    run_pending(p, "tool")  # answered at once: submitted; the round goes on


def test_an_async_task_stops_when_its_session_ends_without_it() -> None:
    p = pipeline([answers_without_waiting] * 2)
    tool = EndsWhileRunning(p, lambda p: run_pending(p, "round"))  # the model answers
    p.runner.tools = lambda: tool
    _async_session(p)
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "I will not wait for it"
    assert (tool.calls, tool.went_on) == (1, False)
    state = p.store.task_state(SK, "task-0-0")
    assert state is not None and state["status"] == "running"  # never finished
    assert _after_the_end(p) == ["tool.call.failed", "task.failed"]


def test_an_async_task_whose_session_ended_before_it_started_never_runs() -> None:
    p = pipeline([answers_without_waiting] * 2)
    tool = EndsWhileRunning(p, lambda p: None)
    p.runner.tools = lambda: tool
    _async_session(p)
    run_pending(p, "round")  # the model answers: the session ends
    p.drain()  # then the task's background step comes
    assert tool.calls == 0
    assert p.store.task_state(SK, "task-0-0") == {"status": "submitted"}
    assert _after_the_end(p) == []
    answer = json.loads(next(m for m in p.transcript() if m["role"] == "tool")["content"])
    assert answer["data"] == {"task_id": "task-0-0", "status": "submitted"}

"""Issue 9, point 4: trace events of a session, on the twins. Order, fields, and what they
must never hold (prompts, arguments, outputs): a canary string proves it. The fleet half
(`cchatq trace`) is in test_tool_policy_fleet.py."""

from __future__ import annotations

import json
from typing import Any

from fixtures.replay.conversation import read_envelope
from schemas import keys
from tests.test_engine import WEATHER_FN
from tests.test_steps import SK, pipeline, reply, submit
from tests.test_steps import spec as pipeline_spec
from worker.errors import ToolRuntimeError
from worker.session.ports import ToolCall
from worker.session.trace import Arrival

CANARY = "canary-7f3a"


def flaky_weather() -> Any:
    failures = [ToolRuntimeError(f"flaky {CANARY}")]

    def run(args: str) -> str:
        if failures:
            raise failures.pop()
        return f"sunny in {json.loads(args)['city']}"

    return run


def mixed_model(request: Any) -> dict[str, Any]:
    if request.messages[-1]["role"] == "tool":
        return reply(f"done {CANARY}")
    return reply(
        None,
        ("call_1", "get_weather", json.dumps({"city": CANARY})),
        ("call_2", "nope", "{}"),
    )


def run_mixed() -> list[dict[str, Any]]:
    p = pipeline([mixed_model, mixed_model], tools={"get_weather": flaky_weather()})
    weather = {**WEATHER_FN}
    session_spec = pipeline_spec(weather)
    session_spec["tools"][0]["policy"] = {"max_retries": 1, "retry_backoff_ms": 0}
    session_spec["messages"] = [{"role": "user", "content": f"Weather? {CANARY}"}]
    submit(p, session_spec)
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == f"done {CANARY}"
    return [e.to_json() for e in p.store.traces[SK]]


def test_a_mixed_session_traces_every_call_in_order() -> None:
    events = run_mixed()
    assert [(e["event"], e.get("tool"), e.get("error")) for e in events] == [
        ("session.started", None, None),
        ("model.call.started", None, None),
        ("model.call.finished", None, None),
        ("tool.call.failed", "nope", "TOOL_NOT_FOUND"),  # answered, never started
        ("tool.call.started", "get_weather", None),
        ("tool.call.retried", "get_weather", "RUNTIME_ERROR"),
        ("tool.call.finished", "get_weather", None),
        ("model.call.started", None, None),
        ("model.call.finished", None, None),
        ("session.finished", None, None),
    ]
    assert {e["session"] for e in events} == {"t/1"}
    by_name = {e["event"]: e for e in events}
    assert by_name["tool.call.finished"]["call_id"] == "call_1"
    assert by_name["tool.call.finished"]["attempt"] == 1  # one retry
    assert by_name["tool.call.finished"]["output_bytes"] == len(f"sunny in {CANARY}")
    assert by_name["tool.call.retried"]["attempt"] == 1
    assert by_name["model.call.finished"]["request_id"] == "c"
    assert [e["round"] for e in events if e["event"] == "model.call.started"] == [0, 1]
    assert all(e["ts_ms"] > 0 for e in events)
    ts = [e["ts_ms"] for e in events]
    assert ts == sorted(ts)


def test_no_event_holds_a_prompt_an_argument_or_an_output() -> None:
    assert CANARY not in json.dumps(run_mixed())


def test_trace_off_writes_no_event() -> None:
    p = pipeline([reply("hi")], trace=False)
    submit(p, pipeline_spec())
    p.drain()
    assert p.store.traces == {}


class ReportingTools:
    """A ToolRuntime whose call reports its progress, as a background WASM tool would."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def run(self, call: ToolCall) -> str:
        self.calls.append(call)
        assert call.watcher is not None  # a background call is watched
        for percent in (0, 50, 100):
            call.watcher.check()
            call.watcher.progress(percent, "working")
        return "done"


def test_a_background_tool_is_handed_over_and_reports_its_progress() -> None:
    p = pipeline([weather_model_once, weather_model_once])
    runtime = ReportingTools()
    p.runner.tools = lambda: runtime
    session_spec = pipeline_spec(WEATHER_FN)
    session_spec["tools"][0]["policy"] = {"background": True, "timeout_ms": 600_000}
    submit(p, session_spec)
    kinds = []
    while p.queue.pending:
        kinds.append(p.queue.run_next(p.runner)[0])
    assert kinds == ["round", "tool", "background", "round"]
    assert [c.timeout_ms for c in runtime.calls] == [600_000]  # over the 120 s of a tool step
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: done"
    events = [e.to_json() for e in p.store.traces[SK]]
    names = [e["event"] for e in events]
    assert names[names.index("task.submitted") :] == [
        "task.submitted",
        "tool.call.started",
        "task.progress",  # 0 %; 50 % comes too soon after it; 100 % always
        "task.progress",
        "tool.call.finished",
        "task.completed",
        "model.call.started",
        "model.call.finished",
        "session.finished",
    ]
    progress = [e for e in events if e["event"] == "task.progress"]
    assert [(e["percent"], e["message"]) for e in progress] == [(0, "working"), (100, "working")]


def weather_model_once(request: Any) -> dict[str, Any]:
    if request.messages[-1]["role"] == "tool":
        return reply(f"Tool said: {read_envelope(request.messages[-1]['content'])}")
    return reply(None, ("call_1", "get_weather", '{"city":"Paris"}'))


def polling_model(request: Any) -> dict[str, Any]:
    """Starts the async task, then asks task_status until it is done, then answers."""
    last = request.messages[-1]
    if last["role"] != "tool":
        return reply(None, ("call_0", "get_weather", '{"city":"Paris"}'))
    data = json.loads(last["content"])["data"]
    if data["status"] in ("submitted", "running"):
        turn = sum(m["role"] == "assistant" for m in request.messages)
        args = json.dumps({"task_id": data["task_id"]})
        return reply(None, (f"call_{turn}", "task_status", args))
    return reply(f"Task said: {json.dumps(data['result'])}")


def run_pending(p: Any, kind: str) -> None:
    step = next(s for s in p.queue.pending if s[0] == kind)
    p.queue.pending.remove(step)
    p.run(step)


def test_an_async_background_task_is_asked_for_with_task_status() -> None:
    p = pipeline([polling_model] * 4)
    runtime = ReportingTools()
    p.runner.tools = lambda: runtime
    session_spec = pipeline_spec(WEATHER_FN)
    policy = {"background": True, "background_mode": "async"}
    session_spec["tools"][0]["policy"] = policy
    submit(p, session_spec)
    run_pending(p, "round")  # the model starts the task
    run_pending(p, "tool")  # answered at once: submitted; the round goes on
    assert sorted(s[0] for s in p.queue.pending) == ["background", "round"]
    run_pending(p, "round")  # the model asks
    run_pending(p, "tool")  # task_status: not started yet
    run_pending(p, "background")  # the task runs, reporting progress
    p.drain()  # the model asks again: completed, with the result; then it answers
    assert p.body()["choices"][0]["message"]["content"] == 'Task said: "done"'
    answers = [json.loads(m["content"])["data"] for m in p.transcript() if m["role"] == "tool"]
    assert answers == [
        {"task_id": "task-0-0", "status": "submitted"},
        {"task_id": "task-0-0", "status": "submitted"},
        {"task_id": "task-0-0", "status": "completed", "result": "done", "error": None},
    ]
    assert len(runtime.calls) == 1
    offered = p.provider.requests[0].tools
    assert [t["function"]["name"] for t in offered] == ["get_weather", "task_status"]
    unknown = {"task_id": "task-9-9"}
    assert p.runner.store.task_state(SK, unknown["task_id"]) is None


def test_task_status_of_an_unknown_task_is_a_validation_error() -> None:
    def asks(request: Any) -> dict[str, Any]:
        if request.messages[-1]["role"] == "tool":
            return reply(f"said {json.loads(request.messages[-1]['content'])['error']['code']}")
        return reply(None, ("call_1", "task_status", '{"task_id":"task-7-7"}'))

    p = pipeline([asks, asks])
    session_spec = pipeline_spec(WEATHER_FN)
    session_spec["tools"][0]["policy"] = {"background": True, "background_mode": "async"}
    submit(p, session_spec)
    p.drain()
    assert p.body()["choices"][0]["message"]["content"] == "said VALIDATION_ERROR"


def test_a_cancel_stops_a_running_background_call() -> None:
    class CancelledMidway:
        def __init__(self, store: Any) -> None:
            self.store = store

        def run(self, call: ToolCall) -> str:
            assert call.watcher is not None
            call.watcher.progress(10, "started")
            self.store.cancel(SK)  # `cchatq cancel` while the call runs
            call.watcher.check()
            raise AssertionError("the watcher should have stopped the call")

    p = pipeline([weather_model_once])
    p.runner.tools = lambda: CancelledMidway(p.store)
    session_spec = pipeline_spec(WEATHER_FN)
    session_spec["tools"][0]["policy"] = {"background": True}
    submit(p, session_spec)
    p.drain()
    assert p.body()["error"]["code"] == "cancelled"
    names = [e.event for e in p.store.traces[SK]]
    assert "task.failed" in names
    tool_message = next(m for m in p.transcript() if m["role"] == "tool")
    assert json.loads(tool_message["content"])["error"]["code"] == "NOT_RUN"


def test_a_long_output_can_reach_the_model_as_a_summary() -> None:
    long_text = "x" * 20_000

    def summary(request: Any) -> dict[str, Any]:
        assert request.messages[1]["content"] == long_text  # the whole output, to sum up
        return reply("twenty thousand x")

    p = pipeline([weather_model_once, summary, weather_model_once])
    p.tools.functions["get_weather"] = lambda args: long_text
    session_spec = pipeline_spec(WEATHER_FN, limits={"compress": "summarize"})
    submit(p, session_spec)
    p.drain()
    tool_message = next(m for m in p.transcript() if m["role"] == "tool")
    envelope = json.loads(tool_message["content"])
    assert envelope["data"] == "twenty thousand x"
    assert (envelope["truncated"], envelope["summarized"], envelope["bytes"]) == (
        True,
        True,
        20_000,
    )
    assert p.body()["choices"][0]["message"]["content"] == "Tool said: twenty thousand x"
    stored = p.store.outcomes[(SK, 0, 0)]
    assert json.loads(stored)["output"] == long_text  # kept whole


def test_a_summary_that_fails_leaves_the_excerpt() -> None:
    from worker.errors import ProviderRequestError

    p = pipeline([weather_model_once, ProviderRequestError("no"), weather_model_once])
    p.tools.functions["get_weather"] = lambda args: "y" * 20_000
    submit(p, pipeline_spec(WEATHER_FN, limits={"compress": "summarize"}))
    p.drain()
    envelope = json.loads(next(m for m in p.transcript() if m["role"] == "tool")["content"])
    assert envelope["truncated"] and "summarized" not in envelope
    assert "bytes omitted" in envelope["data"]


def test_a_model_call_says_which_model_was_asked_which_answered_and_why_it_stopped() -> None:
    events = run_mixed()
    finished = [e for e in events if e["event"] == "model.call.finished"]
    assert [(e["model"], e["response_model"], e["finish_reason"]) for e in finished] == [
        ("m", "m", "tool_calls"),
        ("m", "m", "stop"),
    ]


def test_a_steps_last_event_says_where_and_how_it_ran() -> None:
    """The worker and the message's wait come with the delivery (from its task); the delivery
    count is the step's try: a second delivery of a step says 2."""
    p = pipeline([reply("hi")])
    submit(p, pipeline_spec())
    p.queue.pending.clear()
    p.runner.round(SK, 0, first=True, arrival=Arrival("llm@host-a", 42))
    (entry,) = p.store.traces.values()
    events = [e.to_json() for e in entry]
    last = events[-1]
    assert (last["worker"], last["delivery"], last["queue_ms"], last["kind"]) == (
        "llm@host-a",
        1,
        42,
        "round",
    )
    assert all("worker" not in e and "delivery" not in e for e in events[:-1])


def test_a_redelivered_step_counts_its_delivery() -> None:
    p = pipeline([reply("hi"), reply("hi")])
    submit(p, pipeline_spec())
    p.queue.pending.clear()
    step = keys.round_step(SK, 0)
    p.store.tries[step] = 1  # its first delivery ran and died before its commit
    p.runner.round(SK, 0, first=False, arrival=Arrival("llm@host-b", None))
    last = p.store.traces[SK][-1].to_json()
    assert (last["worker"], last["delivery"]) == ("llm@host-b", 2)
    assert "queue_ms" not in last  # its sender stamped no time

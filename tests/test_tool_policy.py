"""Issue 9 on the twins: a tool's policy (timeout, retries, idempotency, fallback), the result
envelope, max_parallel, executed-call counting and the final answer after a limit. The real
runtime and fleet are in test_tool_policy_fleet.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.config import parse_config
from schemas.fleet import ToolDefaults
from schemas.limits import Limits
from schemas.spec_types import SessionSpec, ToolPolicy, spec_from_json, tool_from_json
from tests.test_engine import (
    TIME,
    USER,
    WEATHER,
    call,
    completion,
    ended_transcript,
    err,
    make_spec,
    ok,
    session,
)
from tests.test_steps import pipeline, reply, submit
from tests.test_steps import spec as pipeline_spec
from worker.codecs.reply import Reply
from worker.errors import (
    GuestError,
    ToolOutputTooLargeError,
    ToolRuntimeError,
    ToolTimeoutError,
    ToolValidationError,
)
from worker.session.engine import CallModel, Finish, RunTools, plan, tool_run
from worker.session.outcomes import ToolFailure, ToolOutcome
from worker.session.ports import ToolCall
from worker.session.state import Round
from worker.session.tool_policy import (
    CallPolicy,
    ToolCaller,
    call_policy,
)

# Policy resolution -------------------------------------------------------------------------


def test_a_tools_own_policy_wins_then_the_sessions_limits_then_the_fleet() -> None:
    fleet = ToolDefaults(timeout_ms=9_000, max_retries=1, retry_backoff_ms=50)
    bare = tool_from_json(WEATHER)
    assert call_policy(bare, Limits(), fleet) == CallPolicy(9_000, 1, 50, True)
    limits = Limits.resolve({"tool_timeout_ms": 700, "max_tool_retries": 0})
    assert call_policy(bare, limits, fleet) == CallPolicy(700, 0, 50, True)
    own = tool_from_json(
        {**WEATHER, "policy": {"timeout_ms": 300, "max_retries": 3, "retry_backoff_ms": 10}}
    )
    assert call_policy(own, limits, fleet) == CallPolicy(300, 3, 10, True)


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = CallPolicy(timeout_ms=1_000, max_retries=3, retry_backoff_ms=100, idempotent=True)
    assert [policy.backoff_ms(k) for k in (1, 2, 3)] == [100, 200, 400]
    assert CallPolicy(1, 10, 60_000, True).backoff_ms(5) == 60_000  # capped


def test_the_fleet_defaults_are_checked_when_the_configuration_loads() -> None:
    parsed = parse_config({"tools": {"max_parallel": 4, "auto_tool_call": False}})
    assert parsed.tool_defaults == ToolDefaults(max_parallel=4, auto_tool_call=False)
    for bad, message in [
        ({"timeout": 1}, "tools.timeout: unknown key"),
        ({"max_retries": "2"}, "tools.max_retries: must be an integer"),
        ({"auto_tool_call": 1}, "tools.auto_tool_call: must be true or false"),
        ({"max_parallel": 0}, "tools.max_parallel: must be at least 1"),
        ([], "tools: Invalid input type"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_config({"tools": bad})


# The caller: retries, idempotency, fallback ----------------------------------------------


class FlakyTools:
    """A ToolRuntime whose calls fail with the given errors, in order, then succeed."""

    def __init__(self, *errors: Exception, output: str = "sunny") -> None:
        self.errors = list(errors)
        self.output = output
        self.calls: list[ToolCall] = []

    def run(self, call: ToolCall) -> str:
        self.calls.append(call)
        if self.errors:
            raise self.errors.pop(0)
        return self.output


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _spec(policy: dict[str, Any], time_policy: dict[str, Any] | None = None) -> SessionSpec:
    weather = {**WEATHER, "policy": policy}
    time = {**TIME, "policy": time_policy} if time_policy else TIME
    typed = spec_from_json(make_spec(tools=[weather, time]))
    assert isinstance(typed, SessionSpec)
    return typed


def _run(spec: SessionSpec, tools: Any, clock: Clock | None = None) -> ToolOutcome:
    clock = clock or Clock()
    reply = completion(call("call_1", "get_weather", '{"city":"Paris"}'))
    run = tool_run(spec, Reply.parse(reply), 0)
    assert run is not None
    return ToolCaller(tools, ToolDefaults(), sleep=clock.sleep, clock=clock).run(spec, run)


def test_a_call_that_fails_twice_then_succeeds_is_retried_with_backoff() -> None:
    tools = FlakyTools(ToolRuntimeError("tool rc: -5"), ToolTimeoutError("timed out"))
    clock = Clock()
    outcome = _run(_spec({"max_retries": 2, "retry_backoff_ms": 100}), tools, clock)
    assert (outcome.ok, outcome.output, outcome.retries) == (True, "sunny", 2)
    assert [c.attempt for c in tools.calls] == [0, 1, 2]  # what cchatq_attempt() answers
    assert clock.slept == [0.1, 0.2]
    assert outcome.latency_ms == 300


def test_retries_are_spent_then_the_last_failure_is_the_answer() -> None:
    tools = FlakyTools(*(ToolTimeoutError(f"timed out {n}") for n in range(5)))
    outcome = _run(_spec({"max_retries": 2, "retry_backoff_ms": 0}), tools)
    assert (outcome.code, outcome.retries, len(tools.calls)) == ("TIMEOUT", 2, 3)
    assert outcome.failure == ToolFailure("TIMEOUT", "timed out 2")


@pytest.mark.parametrize(
    "error",
    [ToolOutputTooLargeError("too big"), ToolValidationError("bad")],
    ids=["output-too-large", "validation"],
)
def test_an_error_no_retry_can_fix_is_not_retried(error: Exception) -> None:
    tools = FlakyTools(error)
    outcome = _run(_spec({"max_retries": 3}), tools)
    assert (outcome.ok, outcome.retries, len(tools.calls)) == (False, 0, 1)


def test_a_non_idempotent_tool_is_retried_only_when_it_provably_did_not_run() -> None:
    policy = {"max_retries": 2, "retry_backoff_ms": 0, "idempotent": False}
    ran = FlakyTools(ToolRuntimeError("tool trapped"))
    assert _run(_spec(policy), ran).code == "RUNTIME_ERROR"
    assert len(ran.calls) == 1
    never_ran = FlakyTools(GuestError("module cannot be linked"), ToolRuntimeError("no", ran=False))
    outcome = _run(_spec(policy), never_ran)
    assert (outcome.ok, outcome.retries, len(never_ran.calls)) == (True, 2, 3)


def test_retries_stop_where_the_step_budget_ends() -> None:
    tools = FlakyTools(*(ToolTimeoutError("timed out") for _ in range(10)))
    clock = Clock()
    policy = {"timeout_ms": 100_000, "max_retries": 10, "retry_backoff_ms": 0}

    class Slow(FlakyTools):
        def run(self, call: ToolCall) -> str:
            clock.now += call.timeout_ms / 1000  # every attempt times out
            return super().run(call)

    slow = Slow(*tools.errors)
    outcome = _run(_spec(policy), slow, clock)
    assert outcome.code == "TIMEOUT"
    assert len(slow.calls) == 2  # a third 100 s attempt would pass 240 s


def test_a_fallback_answers_with_the_same_arguments_when_the_primary_fails() -> None:
    tools = FlakyTools(ToolRuntimeError("down"), ToolRuntimeError("down again"), output="cached")
    spec = _spec({"max_retries": 1, "retry_backoff_ms": 0, "fallback": "get_time"})
    outcome = _run(spec, tools)
    assert (outcome.ok, outcome.output, outcome.fallback, outcome.retries) == (
        True,
        "cached",
        "get_time",
        1,
    )
    assert [(c.export, c.arguments) for c in tools.calls] == [
        ("get_weather", b'{"city":"Paris"}'),
        ("get_weather", b'{"city":"Paris"}'),
        ("get_time", b'{"city":"Paris"}'),
    ]
    assert outcome.envelope()["metrics"] == {"latency_ms": 0, "retries": 1, "fallback": "get_time"}


def test_a_fallback_whose_schema_rejects_the_arguments_is_not_called() -> None:
    strict_time = {
        "name": "get_time",
        "parameters": {"type": "object", "additionalProperties": False},
    }
    weather = {**WEATHER, "policy": {"fallback": "get_time"}}
    typed = spec_from_json(make_spec(tools=[weather, {**TIME, "function": strict_time}]))
    assert isinstance(typed, SessionSpec)
    tools = FlakyTools(ToolRuntimeError("down"))
    outcome = _run(typed, tools)
    assert (outcome.failure, outcome.fallback, len(tools.calls)) == (
        ToolFailure("RUNTIME_ERROR", "down"),
        None,
        1,
    )


# The envelope ------------------------------------------------------------------------------


def test_the_envelope_parses_json_output_and_keeps_text_as_text() -> None:
    parsed = ToolOutcome.success('{"temp_c":21}', latency_ms=3)
    assert json.loads(parsed.message(envelope=True)) == {
        "ok": True,
        "data": {"temp_c": 21},
        "error": None,
        "metrics": {"latency_ms": 3, "retries": 0},
    }
    assert json.loads(ToolOutcome.success("sunny").message(envelope=True))["data"] == "sunny"
    assert ToolOutcome.success("sunny").message(envelope=False) == "sunny"


def test_a_failure_in_the_envelope_carries_its_class_and_metrics() -> None:
    failed = ToolOutcome.error(
        ToolTimeoutError("tool timed out after 5 ms"), latency_ms=6, retries=2
    )
    assert json.loads(failed.message(envelope=True)) == {
        "ok": False,
        "data": None,
        "error": {"code": "TIMEOUT", "message": "tool timed out after 5 ms"},
        "metrics": {"latency_ms": 6, "retries": 2},
    }
    assert failed.message(envelope=False) == (
        '{"error":{"code":"TIMEOUT","message":"tool timed out after 5 ms"}}'
    )


def test_an_outcome_round_trips_through_its_stored_form_and_reads_the_old_one() -> None:
    outcome = ToolOutcome.error(ToolRuntimeError("trap"), latency_ms=4, retries=1, fallback="b")
    assert ToolOutcome.from_json(outcome.to_json()) == outcome
    assert ToolOutcome.from_json({"content": "sunny", "ok": True}) == ToolOutcome.success("sunny")
    old_error = {"content": '{"error":{"code":"tool_exec_failed","message":"x"}}', "ok": False}
    assert ToolOutcome.from_json(old_error).failure == ToolFailure("tool_exec_failed", "x")


def test_spec_sessions_send_the_envelope_to_the_model_by_default() -> None:
    s = session(
        make_spec(flags={"tool_result_envelope": True}),
        Round(
            reply=Reply.parse(completion(call("call_1", "get_time", "{}"))),
            outcomes={0: ok("12:00")},
        ),
    )
    [tool_message] = [m for m in ended_transcript(s) if m["role"] == "tool"]
    assert json.loads(tool_message["content"])["data"] == "12:00"
    loaded = spec_from_json({**make_spec(), "flags": {}})
    assert loaded.flags.tool_result_envelope  # type: ignore[union-attr]


# The loop's edges ----------------------------------------------------------------------------


def test_calls_that_never_ran_do_not_count_toward_max_total_tool_calls() -> None:
    unknown = completion(*(call(f"u{i}", "nope", "{}") for i in range(3)), completion_id="c0")
    outcomes = {i: err("TOOL_NOT_FOUND", "unknown tool: nope") for i in range(3)}
    asks = completion(call("c1", "get_time", '{"tz":"UTC"}'), completion_id="c1")
    s = session(
        make_spec(limits={"max_total_tool_calls": 1}),
        Round(reply=Reply.parse(unknown), outcomes=outcomes),
        Round(reply=Reply.parse(asks)),
    )
    step = plan(s)
    assert isinstance(step, RunTools) and [r.index for r in step.runs] == [0]


LOOPING = [
    completion(call(f"call_{n}", "get_time", f'{{"tz":"T{n}"}}'), completion_id=f"c{n}")
    for n in range(3)
]


def test_a_limit_is_followed_by_a_final_answer_with_tool_choice_none() -> None:
    spec = make_spec(limits={"max_iterations": 2}, flags={"final_answer_on_limit": True})
    first = Round(reply=Reply.parse(LOOPING[0]), outcomes={0: ok("12:00")})
    s = session(spec, first, Round(reply=Reply.parse(LOOPING[1])))
    step = plan(s)  # the second round's call would pass max_iterations: answered as not run
    assert isinstance(step, RunTools) and step.runs == ()
    assert step.presets == {0: err("NOT_RUN", "skipped: exceeded max_iterations")}
    s = session(spec, first, Round(reply=Reply.parse(LOOPING[1]), outcomes=step.presets))
    final = plan(s)
    assert isinstance(final, CallModel)
    assert (final.round_no, final.tool_choice) == (2, "none")
    # the model still calls a tool: its answer is the body, without the call, naming the limit
    s = session(
        spec,
        first,
        Round(reply=Reply.parse(LOOPING[1]), outcomes=step.presets),
        Round(Reply.parse(LOOPING[2])),
    )
    done = plan(s)
    assert isinstance(done, Finish) and done.ok
    message = done.body["choices"][0]["message"]
    assert "tool_calls" not in message
    assert done.body["_spear"]["limit"] == {
        "code": "tool_call_limit",
        "message": "exceeded max_iterations",
    }


def test_with_the_final_answer_off_a_limit_ends_the_session_with_its_error() -> None:
    spec = make_spec(limits={"max_iterations": 1}, flags={"final_answer_on_limit": False})
    step = plan(session(spec, Round(reply=Reply.parse(LOOPING[0]))))
    assert step == Finish(
        {"error": {"code": "tool_call_limit", "message": "exceeded max_iterations"}}
    )


def test_the_fleet_can_turn_automatic_tool_calling_off() -> None:
    from dataclasses import replace

    s = replace(
        session(make_spec(), Round(reply=Reply.parse(LOOPING[0]))),
        fleet=ToolDefaults(auto_tool_call=False),
    )
    step = plan(s)
    assert isinstance(step, Finish) and step.body["choices"][0]["message"]["tool_calls"]


# max_parallel, through the steps ------------------------------------------------------------


def test_max_parallel_keeps_at_most_n_tool_steps_of_a_session_in_flight() -> None:
    calls = [(f"call_{i}", "get_weather", f'{{"city":"C{i}"}}') for i in range(5)]

    def model(request: Any) -> dict[str, Any]:
        if request.messages[-1]["role"] == "tool":
            return reply(f"{sum(m['role'] == 'tool' for m in request.messages)} answers")
        return reply(None, *calls)

    from tests.test_engine import WEATHER_FN

    p = pipeline([model, model], tools={"get_weather": lambda args: json.loads(args)["city"]})
    submit(p, pipeline_spec(WEATHER_FN, limits={"max_parallel": 2}))
    most = 0
    while p.queue.pending:
        in_flight = sum(1 for step in p.queue.pending if step[0] == "tool")
        most = max(most, in_flight)
        p.queue.run_next(p.runner)
    assert most == 2
    assert [json.loads(c.arguments)["city"] for c in p.tools.calls] == [f"C{i}" for i in range(5)]
    assert p.body()["choices"][0]["message"]["content"] == "5 answers"
    answers = [json.loads(m["content"])["data"] for m in p.transcript() if m["role"] == "tool"]
    assert answers == [f"C{i}" for i in range(5)]  # call order, whatever order they ran in


def test_a_policy_object_is_checked_at_submit() -> None:
    from marshmallow import ValidationError

    from schemas.spec import SessionSpecSchema

    raw: dict[str, Any] = {
        "id": "p/1",
        "model": "m",
        "messages": [USER],
        "tools": [
            {"module": "w.wasm", "export": "a", "function": {"name": "a"},
             "policy": {"timeout_ms": 0, "max_retries": 11, "idempotent": "yes",
                        "fallback": "zz", "colour": "red"}},
        ],
    }  # fmt: skip
    with pytest.raises(ValidationError) as info:
        SessionSpecSchema().load(raw)
    assert info.value.messages == {
        "tools": {
            0: {
                "policy": {
                    "timeout_ms": [
                        "Must be between 1 and 120000 (up to 21600000 with background: true)."
                    ],
                    "max_retries": ["Must be between 0 and 10."],
                    "idempotent": ["Not a valid boolean."],
                    "colour": ["Unknown field."],
                }
            }
        }
    }
    raw["tools"][0]["policy"] = {"fallback": "a"}
    with pytest.raises(ValidationError) as info:
        SessionSpecSchema().load(raw)
    assert info.value.messages == {
        "tools": {0: {"policy": {"fallback": ["Must name another tool of this session."]}}}
    }
    assert ToolPolicy.from_json({"max_retries": 2}).to_json() == {"max_retries": 2}


def test_an_unreadable_call_is_a_validation_error_and_the_loop_goes_on() -> None:
    from schemas.spec_types import INVALID_CALL_NAME

    reply = completion(
        call("call_x", INVALID_CALL_NAME, "{}"), call("call_a", "get_time", '{"tz":"UTC"}')
    )
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply))))
    assert isinstance(step, RunTools) and [r.index for r in step.runs] == [1]
    assert step.presets == {
        0: err("VALIDATION_ERROR", "this tool call could not be read: it names no function")
    }


def test_no_tool_may_take_the_name_unreadable_calls_are_kept_under() -> None:
    from marshmallow import ValidationError

    from schemas.spec import SessionSpecSchema

    tool = {"module": "w.wasm", "export": "x", "function": {"name": "invalid_tool_call"}}
    with pytest.raises(ValidationError) as info:
        SessionSpecSchema().load({"id": "a", "model": "m", "messages": [USER], "tools": [tool]})
    assert "Reserved" in str(info.value.messages)


# Long results -------------------------------------------------------------------------------


def test_a_long_output_reaches_the_model_as_an_excerpt_that_says_so() -> None:
    from worker.session.outcomes import excerpt

    text = "é" + "x" * 49_998 + "€"  # multi-byte at both ends: the cut stays on characters
    cut = excerpt(text, 3_000)
    head, _, rest = cut.partition("\n[... ")
    omitted, _, tail = rest.partition(" bytes omitted ...]\n")
    assert text.startswith(head) and text.endswith(tail)
    assert len(head.encode()) + int(omitted) + len(tail.encode()) == len(text.encode())
    assert len(head.encode()) <= 2_000 and len(tail.encode()) <= 1_000
    envelope = json.loads(ToolOutcome.success(text).message(True, 3_000, ref="call_9"))
    assert envelope["data"] == cut
    assert (envelope["truncated"], envelope["bytes"], envelope["ref"]) == (
        True,
        len(text.encode()),
        "call_9",
    )
    short = json.loads(ToolOutcome.success('{"a":1}').message(True, 3_000, ref="c"))
    assert "truncated" not in short and short["data"] == {"a": 1}
    assert ToolOutcome.success(text).message(False, 3_000, ref="c") == text  # raw: whole


def test_background_modes_are_checked_at_submit_and_task_status_is_reserved() -> None:
    from marshmallow import ValidationError

    from schemas.spec import SessionSpecSchema
    from schemas.spec_types import TASK_STATUS, with_builtins

    def load(*tools: dict[str, Any]) -> Any:
        return SessionSpecSchema().load(
            {"id": "a", "model": "m", "messages": [USER], "tools": tools}
        )

    def tool(name: str, **policy: Any) -> dict[str, Any]:
        return {"module": "w.wasm", "export": "x", "function": {"name": name}, "policy": policy}

    with pytest.raises(ValidationError) as info:
        load(tool("a", background_mode="async"))
    assert info.value.messages == {
        "tools": {0: {"policy": {"background_mode": ["Only with background: true."]}}}
    }
    with pytest.raises(ValidationError) as info:
        load(tool("a", background=True, background_mode="later"))
    assert "Must be one of: wait, async." in str(info.value.messages)
    with pytest.raises(ValidationError) as info:
        load(tool("a", background=True, background_mode="async"), tool(TASK_STATUS))
    assert "Reserved" in str(info.value.messages)
    assert load(tool(TASK_STATUS)).tool(TASK_STATUS) is not None  # no async tool: a name
    spec = load(tool("a", background=True, background_mode="async"))
    assert [t.name for t in with_builtins(spec).tools] == ["a", TASK_STATUS]  # type: ignore[union-attr]
    assert with_builtins(with_builtins(spec)) == with_builtins(spec)

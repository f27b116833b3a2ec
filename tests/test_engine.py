"""The pure session engine (docs/guest-abi.md section 4): table tests driving `plan` by hand.

A session is built from a spec and stored rounds (canonical replies from
`normalize_completion` plus tool outcomes by call index); `plan` must say what happens next
from that state alone. No Celery, Redis, HTTP or wasmtime.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from schemas.limits import Limits
from schemas.spec_types import SessionSpec, spec_from_json, tool_from_json
from worker.codecs.openai_chat import normalize_completion
from worker.codecs.reply import Reply
from worker.errors import ToolNotFoundError
from worker.session.ending import closing_fill, metrics
from worker.session.engine import (
    CANCELLED,
    CallModel,
    Finish,
    RunTools,
    ToolRun,
    argument_problem,
    plan,
)
from worker.session.outcomes import ToolFailure, ToolOutcome
from worker.session.state import Round, Session
from worker.session.transcript import success_body, transcript

# Fixtures as plain data --------------------------------------------------------------------

WEATHER_FN = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME_FN = {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
}
WEATHER = {
    "module_sha256": "ab",
    "export": "get_weather",
    "table_index": None,
    "function": WEATHER_FN,
}
TIME = {"module_sha256": "cd", "export": "get_time", "table_index": None, "function": TIME_FN}
USER = {"role": "user", "content": "hi"}

TRUNCATED = "arguments truncated (finish_reason length), not executed"


def make_spec(
    *,
    flags: dict[str, bool] | None = None,
    limits: dict[str, int] | None = None,
    tools: list[dict[str, Any]] | None = None,
    params: dict[str, Any] | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "id": "s1",
        "model": "m",
        "messages": messages if messages is not None else [USER],
        "tools": tools if tools is not None else [WEATHER, TIME],
        "params": params if params is not None else {},
        "flags": {
            "auto_tool_call": True,
            "metrics": True,
            "strict_unknown_tool": False,
            # the loop is tested on raw tool messages; test_tool_outcomes covers the envelope
            "tool_result_envelope": False,
            # limits are tested ending the session; test_tool_policy covers the final answer
            "final_answer_on_limit": False,
            **(flags or {}),
        },
        "limits": {**Limits().as_dict(), **(limits or {})},
    }


def call(call_id: str | None, name: str, arguments: Any = "{}") -> dict[str, Any]:
    raw: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        raw["id"] = call_id
    return raw


def completion(
    *calls: dict[str, Any],
    content: str | None = None,
    finish_reason: str = "stop",
    usage: dict[str, Any] | None = None,
    model: str | None = "m-upstream",
    completion_id: str = "chatcmpl-1",
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    raw: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": 1700000000,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    }
    if model is not None:
        raw["model"] = model
    if usage is not None:
        raw["usage"] = usage
    return normalize_completion(raw)


def session(spec: dict[str, Any], *rounds: Round) -> Session:
    typed = spec_from_json(spec)
    assert isinstance(typed, SessionSpec)
    return Session(spec=typed, backend="replay", rounds=tuple(rounds))


def ended_transcript(s: Session, missing: ToolOutcome | None = None) -> list[dict[str, Any]]:
    """The transcript a session ends with (worker.session.ending): the plan's answers to its
    last round's unanswered calls, and `missing` for the rest."""
    return transcript(s, closing_fill(s, plan(s), missing))


def ok(content: str) -> ToolOutcome:
    return ToolOutcome.success(content)


def err_text(code: str, message: str) -> str:
    """An error body as the engine must write it: compact JSON, sorted keys, UTF-8."""
    return json.dumps(
        {"error": {"code": code, "message": message}},
        separators=(",", ":"),
        sort_keys=True,
        ensure_ascii=False,
    )


def err(code: str, message: str, ran: bool = False) -> ToolOutcome:
    return ToolOutcome(ok=False, failure=ToolFailure(code, message), ran=ran)


def canon(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool call as normalize_completion writes it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_msg(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def weather_run(index: int, call_id: str, arguments: str) -> ToolRun:
    return ToolRun(
        index=index,
        call_id=call_id,
        name="get_weather",
        tool=tool_from_json(WEATHER),
        arguments=arguments,
    )


def time_run(index: int, call_id: str, arguments: str) -> ToolRun:
    tool = tool_from_json(TIME)
    return ToolRun(index=index, call_id=call_id, name="get_time", tool=tool, arguments=arguments)


def unanswered_calls(messages: list[dict[str, Any]]) -> list[str]:
    """Assistant turns whose tool calls are not each answered once, in call order, right after."""
    problems: list[str] = []
    for pos, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        ids = [c["id"] for c in message["tool_calls"]]
        answered = []
        for follower in messages[pos + 1 :]:
            if follower["role"] != "tool":
                break
            answered.append(follower["tool_call_id"])
        if answered != ids:
            problems.append(f"calls {ids} answered by {answered}")
    return problems


THREE_CALLS = completion(
    call("call_a", "get_weather", '{"city":"Paris"}'),
    call("call_b", "get_time", '{"tz":"UTC"}'),
    call("call_c", "get_weather", '{"city":"Oslo"}'),
    content="Let me check.",
)
THREE_CALLS_ASSISTANT = {
    "role": "assistant",
    "content": "Let me check.",
    "tool_calls": [
        canon("call_a", "get_weather", '{"city":"Paris"}'),
        canon("call_b", "get_time", '{"tz":"UTC"}'),
        canon("call_c", "get_weather", '{"city":"Oslo"}'),
    ],
}
THREE_OUTCOMES = {0: ok("sunny"), 1: ok("12:00"), 2: ok("rain")}
ANSWER = completion(content="It is sunny in Paris.")


# No rounds yet: call the model -------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param(
            make_spec(params={"temperature": 0.2, "max_tokens": 64}),
            CallModel(
                round_no=0,
                model="m",
                messages=[USER],
                tools=[
                    {"type": "function", "function": WEATHER_FN},
                    {"type": "function", "function": TIME_FN},
                ],
                params={"temperature": 0.2, "max_tokens": 64},
            ),
            id="tools-and-params",
        ),
        pytest.param(
            make_spec(tools=[], messages=[{"role": "system", "content": "be brief"}, USER]),
            CallModel(
                round_no=0,
                model="m",
                messages=[{"role": "system", "content": "be brief"}, USER],
                tools=[],
                params={},
            ),
            id="no-tools-no-params",
        ),
        pytest.param(
            {"id": "s1", "model": "m2", "messages": [USER]},
            CallModel(round_no=0, model="m2", messages=[USER], tools=[], params={}),
            id="minimal-spec",
        ),
    ],
)
def test_no_rounds_calls_model_round_0(spec: dict[str, Any], expected: CallModel) -> None:
    assert plan(session(spec)) == expected


def test_call_model_messages_are_copies_of_the_spec() -> None:
    spec = make_spec()
    step = plan(session(spec))
    assert isinstance(step, CallModel)
    step.messages[0]["content"] = "changed"
    step.params["x"] = 1
    assert spec["messages"] == [USER]
    assert spec["params"] == {}


# A reply without tool calls finishes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "spear_model"),
    [
        pytest.param(completion(content="hello"), "m-upstream", id="upstream-model"),
        pytest.param(completion(content="hello", model=None), "m", id="spec-model-when-absent"),
        pytest.param(
            completion(content="hello", finish_reason="tool_calls"),
            "m-upstream",
            id="tool_calls-reason-no-calls",
        ),
        pytest.param(
            completion(content="cut", finish_reason="length"), "m-upstream", id="length-no-calls"
        ),
        pytest.param(completion(content=None), "m-upstream", id="empty-content"),
    ],
)
def test_reply_without_tool_calls_finishes_with_reply_and_spear(
    reply: dict[str, Any], spear_model: str
) -> None:
    before = copy.deepcopy(reply)
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply))))
    assert step == Finish({**before, "_spear": {"backend": "replay", "model": spear_model}})
    assert isinstance(step, Finish) and step.ok
    assert reply == before  # the stored reply is not mutated


def test_success_body_adds_spear_without_mutating() -> None:
    reply = completion(content="hello")
    before = copy.deepcopy(reply)
    body = success_body(session(make_spec()), Reply.parse(reply))
    assert body == {**before, "_spear": {"backend": "replay", "model": "m-upstream"}}
    assert reply == before


def test_final_answer_after_tool_round_finishes() -> None:
    s = session(
        make_spec(),
        Round(reply=Reply.parse(THREE_CALLS), outcomes=THREE_OUTCOMES),
        Round(reply=Reply.parse(ANSWER)),
    )
    assert plan(s) == Finish({**ANSWER, "_spear": {"backend": "replay", "model": "m-upstream"}})


# auto_tool_call off: one round, the tool-call reply is the answer ---------------------------


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param({"auto_tool_call": False}, id="auto-off"),
        pytest.param({"auto_tool_call": False, "strict_unknown_tool": True}, id="auto-off-strict"),
    ],
)
def test_auto_tool_call_off_finishes_with_tool_call_reply(flags: dict[str, bool]) -> None:
    reply = completion(call("call_a", "get_weather", '{"city":"Paris"}'), call("call_x", "nope"))
    step = plan(
        session(
            make_spec(flags=flags, limits={"max_iterations": 1}), Round(reply=Reply.parse(reply))
        )
    )
    assert step == Finish({**reply, "_spear": {"backend": "replay", "model": "m-upstream"}})
    assert isinstance(step, Finish)
    assert step.body["choices"][0]["message"]["tool_calls"] == [
        canon("call_a", "get_weather", '{"city":"Paris"}'),
        canon("call_x", "nope", "{}"),
    ]


# Tool calls: RunTools, then CallModel with the tool messages in call order -------------------


def test_tool_calls_run_in_call_order() -> None:
    step = plan(session(make_spec(), Round(reply=Reply.parse(THREE_CALLS))))
    assert step == RunTools(
        round_no=0,
        call_count=3,
        runs=(
            weather_run(0, "call_a", '{"city":"Paris"}'),
            time_run(1, "call_b", '{"tz":"UTC"}'),
            weather_run(2, "call_c", '{"city":"Oslo"}'),
        ),
        presets={},
    )


@pytest.mark.parametrize(
    ("stored", "runs", "presets"),
    [
        pytest.param({}, (1, 2), {0}, id="nothing-stored"),
        pytest.param({0}, (1, 2), set(), id="preset-stored"),
        pytest.param({1}, (2,), {0}, id="one-run-stored"),
        pytest.param({0, 1}, (2,), set(), id="preset-and-run-stored"),
        pytest.param({1, 2}, (), {0}, id="runs-stored-preset-not"),
    ],
)
def test_partially_stored_round_plans_only_what_is_missing(
    stored: set[int], runs: tuple[int, ...], presets: set[int]
) -> None:
    reply = completion(
        call("call_x", "get_wether", '{"city":"Paris"}'),
        call("call_a", "get_weather", '{"city":"Paris"}'),
        call("call_b", "get_time", "{}"),
    )
    all_outcomes = {
        0: err("TOOL_NOT_FOUND", "unknown tool: get_wether"),
        1: ok("sunny"),
        2: ok("12:00"),
    }
    outcomes = {i: all_outcomes[i] for i in stored}
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply), outcomes=outcomes)))
    expected_runs = {
        1: weather_run(1, "call_a", '{"city":"Paris"}'),
        2: time_run(2, "call_b", "{}"),
    }
    assert step == RunTools(
        round_no=0,
        call_count=3,
        runs=tuple(expected_runs[i] for i in runs),
        presets={i: all_outcomes[i] for i in presets},
    )


def test_second_tool_round_is_round_1() -> None:
    second = completion(call("call_d", "get_time", '{"tz":"CET"}'), completion_id="chatcmpl-2")
    s = session(
        make_spec(),
        Round(reply=Reply.parse(THREE_CALLS), outcomes=THREE_OUTCOMES),
        Round(reply=Reply.parse(second)),
    )
    assert plan(s) == RunTools(
        round_no=1, call_count=1, runs=(time_run(0, "call_d", '{"tz":"CET"}'),), presets={}
    )


@pytest.mark.parametrize(
    "fill_order",
    [
        pytest.param((0, 1, 2), id="in-order"),
        pytest.param((2, 1, 0), id="reverse"),
        pytest.param((1, 2, 0), id="shuffled"),
    ],
)
def test_all_outcomes_stored_calls_model_with_tool_messages_in_call_order(
    fill_order: tuple[int, ...],
) -> None:
    outcomes = {i: THREE_OUTCOMES[i] for i in fill_order}
    assert list(outcomes) == list(fill_order)
    step = plan(
        session(
            make_spec(params={"temperature": 0}),
            Round(reply=Reply.parse(THREE_CALLS), outcomes=outcomes),
        )
    )
    assert step == CallModel(
        round_no=1,
        model="m",
        messages=[
            USER,
            THREE_CALLS_ASSISTANT,
            tool_msg("call_a", "sunny"),
            tool_msg("call_b", "12:00"),
            tool_msg("call_c", "rain"),
        ],
        tools=[
            {"type": "function", "function": WEATHER_FN},
            {"type": "function", "function": TIME_FN},
        ],
        params={"temperature": 0},
    )


def test_two_tool_rounds_build_the_whole_history() -> None:
    second = completion(call("call_d", "get_time", '{"tz":"CET"}'), completion_id="chatcmpl-2")
    s = session(
        make_spec(),
        Round(
            reply=Reply.parse(THREE_CALLS), outcomes={2: ok("rain"), 0: ok("sunny"), 1: ok("12:00")}
        ),
        Round(reply=Reply.parse(second), outcomes={0: ok("13:00")}),
    )
    step = plan(s)
    assert isinstance(step, CallModel)
    assert step.round_no == 2
    assert step.messages == [
        USER,
        THREE_CALLS_ASSISTANT,
        tool_msg("call_a", "sunny"),
        tool_msg("call_b", "12:00"),
        tool_msg("call_c", "rain"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [canon("call_d", "get_time", '{"tz":"CET"}')],
        },
        tool_msg("call_d", "13:00"),
    ]


@pytest.mark.parametrize(
    ("content", "message_content"),
    [
        pytest.param("", "(no output)", id="empty-placeholder"),
        pytest.param('{"temp": 21}', '{"temp": 21}', id="json-text-kept"),
        pytest.param("☀ 20°C", "☀ 20°C", id="utf8-kept"),
    ],
)
def test_tool_message_content(content: str, message_content: str) -> None:
    reply = completion(call("call_a", "get_weather", '{"city":"Paris"}'))
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply), outcomes={0: ok(content)})))
    assert isinstance(step, CallModel)
    assert step.messages[-1] == tool_msg("call_a", message_content)


def test_duplicate_and_missing_ids_are_paired_by_normalised_id() -> None:
    reply = completion(
        call("call_0", "get_time", "{}"),
        call("call_0", "get_time", '{"tz":"UTC"}'),
        call(None, "get_time", "{}"),
    )
    synthetic = reply["choices"][0]["message"]["tool_calls"][2]["id"]
    assert synthetic.startswith("call_")
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply))))
    assert isinstance(step, RunTools)
    assert [r.call_id for r in step.runs] == ["call_0", "call_0_2", synthetic]
    step = plan(
        session(
            make_spec(),
            Round(reply=Reply.parse(reply), outcomes={0: ok("a"), 1: ok("b"), 2: ok("c")}),
        )
    )
    assert isinstance(step, CallModel)
    assert step.messages[2:] == [
        tool_msg("call_0", "a"),
        tool_msg("call_0_2", "b"),
        tool_msg(synthetic, "c"),
    ]


# Unknown tools --------------------------------------------------------------------------------


def test_unknown_tool_error_text_is_compact_and_sorted() -> None:
    assert err_text("TOOL_NOT_FOUND", "unknown tool: get_wether") == (
        '{"error":{"code":"TOOL_NOT_FOUND","message":"unknown tool: get_wether"}}'
    )
    outcome = ToolOutcome.error(ToolNotFoundError("unknown tool: get_wether"))
    assert outcome == err("TOOL_NOT_FOUND", "unknown tool: get_wether")
    assert outcome.message(envelope=False) == (
        '{"error":{"code":"TOOL_NOT_FOUND","message":"unknown tool: get_wether"}}'
    )


@pytest.mark.parametrize(
    ("calls", "runs", "presets"),
    [
        pytest.param(
            [
                call("call_x", "get_wether", '{"city":"Paris"}'),
                call("call_a", "get_weather", '{"city":"Paris"}'),
            ],
            (weather_run(1, "call_a", '{"city":"Paris"}'),),
            {0: err("TOOL_NOT_FOUND", "unknown tool: get_wether")},
            id="unknown-then-known",
        ),
        pytest.param(
            [call("call_a", "get_weather", '{"city":"Paris"}'), call("call_x", "rm_rf", "{}")],
            (weather_run(0, "call_a", '{"city":"Paris"}'),),
            {1: err("TOOL_NOT_FOUND", "unknown tool: rm_rf")},
            id="known-then-unknown",
        ),
        pytest.param(
            [call("call_x", "a", "{}"), call("call_y", "b", "not json")],
            (),
            {
                0: err("TOOL_NOT_FOUND", "unknown tool: a"),
                1: err("TOOL_NOT_FOUND", "unknown tool: b"),
            },
            id="all-unknown-bad-args-ignored",
        ),
    ],
)
def test_unknown_tool_is_preset_not_run(
    calls: list[dict[str, Any]], runs: tuple[ToolRun, ...], presets: dict[int, ToolOutcome]
) -> None:
    step = plan(session(make_spec(), Round(reply=Reply.parse(completion(*calls)))))
    assert step == RunTools(round_no=0, call_count=len(calls), runs=runs, presets=presets)


def test_unknown_tool_outcome_reaches_the_next_model_call() -> None:
    reply = completion(
        call("call_x", "get_wether", "{}"), call("call_a", "get_weather", '{"city":"Paris"}')
    )
    outcomes = {1: ok("sunny"), 0: err("TOOL_NOT_FOUND", "unknown tool: get_wether")}
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply), outcomes=outcomes)))
    assert isinstance(step, CallModel)
    assert step.messages[2:] == [
        tool_msg(
            "call_x", '{"error":{"code":"TOOL_NOT_FOUND","message":"unknown tool: get_wether"}}'
        ),
        tool_msg("call_a", "sunny"),
    ]


@pytest.mark.parametrize(
    ("calls", "name"),
    [
        pytest.param([call("call_x", "get_wether")], "get_wether", id="only-unknown"),
        pytest.param(
            [
                call("call_a", "get_weather", '{"city":"Paris"}'),
                call("call_x", "foo"),
                call("call_y", "bar"),
            ],
            "foo",
            id="first-unknown-named",
        ),
    ],
)
def test_strict_unknown_tool_finishes_with_error(calls: list[dict[str, Any]], name: str) -> None:
    step = plan(
        session(
            make_spec(flags={"strict_unknown_tool": True}),
            Round(reply=Reply.parse(completion(*calls))),
        )
    )
    assert step == Finish({"error": {"code": "unknown_tool", "message": f"unknown tool: {name}"}})
    assert isinstance(step, Finish) and not step.ok


def test_strict_unknown_tool_with_known_calls_only_runs_them() -> None:
    step = plan(
        session(
            make_spec(flags={"strict_unknown_tool": True}), Round(reply=Reply.parse(THREE_CALLS))
        )
    )
    assert isinstance(step, RunTools)
    assert [r.index for r in step.runs] == [0, 1, 2]


# Invalid arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param(
            "not json",
            "invalid JSON arguments: Expecting value: line 1 column 1 (char 0), resend valid JSON",
            id="bad-json",
        ),
        pytest.param(
            '{"city": ',
            "invalid JSON arguments: Expecting value: line 1 column 10 (char 9), resend valid JSON",
            id="unrepairable-cut",
        ),
        pytest.param("{}", "arguments: 'city' is a required property", id="missing-required"),
        pytest.param(
            "", "arguments: 'city' is a required property", id="empty-string-is-empty-object"
        ),
        pytest.param("null", "arguments: 'city' is a required property", id="null-is-empty-object"),
        pytest.param('{"city": 5}', "city: 5 is not of type 'string'", id="wrong-type"),
        pytest.param('["Paris"]', "tool arguments must be a JSON object, got array", id="array"),
        pytest.param("42", "tool arguments must be a JSON object, got number", id="number"),
        pytest.param('"Paris"', "tool arguments must be a JSON object, got string", id="string"),
        pytest.param("true", "tool arguments must be a JSON object, got boolean", id="boolean"),
    ],
)
def test_invalid_arguments_are_preset_and_valid_siblings_still_run(
    arguments: str, message: str
) -> None:
    reply = completion(
        call("call_a", "get_weather", '{"city":"Paris"}'),
        call("call_bad", "get_weather", arguments),
        call("call_b", "get_time", "{}"),
    )
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply))))
    assert step == RunTools(
        round_no=0,
        call_count=3,
        runs=(weather_run(0, "call_a", '{"city":"Paris"}'), time_run(2, "call_b", "{}")),
        presets={1: err("VALIDATION_ERROR", message)},
    )


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param('{"city": "Paris"', id="truncated-then-repaired"),
        pytest.param('```json\n{"city": "Paris"}\n```', id="code-fenced"),
        pytest.param('"{\\"city\\":\\"Paris\\"}"', id="double-encoded"),
    ],
)
def test_a_run_call_gets_the_arguments_that_were_validated(arguments: str) -> None:
    reply = completion(call("call_a", "get_weather", arguments))
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply))))
    assert isinstance(step, RunTools)
    if 0 in step.presets:  # rejecting the call would be consistent too
        assert step.runs == ()
        return
    (run,) = step.runs
    assert json.loads(run.arguments) == {"city": "Paris"}


@pytest.mark.parametrize(
    ("calls", "presets"),
    [
        pytest.param(
            [
                call("call_a", "get_weather", '{"city":"Paris"}'),
                call("call_b", "get_time", '{"tz":"UT'),
            ],
            {0: err("VALIDATION_ERROR", TRUNCATED), 1: err("VALIDATION_ERROR", TRUNCATED)},
            id="valid-and-cut",
        ),
        pytest.param(
            [call("call_x", "nope", "{}"), call("call_a", "get_weather", '{"city":"Paris"}')],
            {0: err("TOOL_NOT_FOUND", "unknown tool: nope"), 1: err("VALIDATION_ERROR", TRUNCATED)},
            id="unknown-wins-over-truncated",
        ),
    ],
)
def test_finish_reason_length_presets_every_call(
    calls: list[dict[str, Any]], presets: dict[int, ToolOutcome]
) -> None:
    reply = completion(*calls, finish_reason="length")
    assert reply["choices"][0]["finish_reason"] == "length"
    step = plan(session(make_spec(), Round(reply=Reply.parse(reply))))
    assert step == RunTools(round_no=0, call_count=len(calls), runs=(), presets=presets)
    assert err_text("VALIDATION_ERROR", TRUNCATED) == (
        '{"error":{"code":"VALIDATION_ERROR",'
        '"message":"arguments truncated (finish_reason length), not executed"}}'
    )


def test_finish_reason_length_presets_appear_in_transcript() -> None:
    reply = completion(call("call_a", "get_weather", '{"city":"Paris"}'), finish_reason="length")
    s = session(make_spec(), Round(reply=Reply.parse(reply)))
    assert ended_transcript(s)[2:] == [tool_msg("call_a", err_text("VALIDATION_ERROR", TRUNCATED))]


# Limits ------------------------------------------------------------------------------------------

ITER_LIMIT = {"error": {"code": "tool_call_limit", "message": "exceeded max_iterations"}}
TOTAL_LIMIT = {"error": {"code": "tool_call_limit", "message": "exceeded max_total_tool_calls"}}


def test_max_iterations_ends_second_tool_turn_and_answers_every_call() -> None:
    first = completion(
        call("call_a", "get_weather", '{"city":"Paris"}'), completion_id="chatcmpl-1"
    )
    second = completion(
        call("call_b", "get_weather", '{"city":"Oslo"}'),
        call("call_c", "get_time", "{}"),
        call("call_d", "nope", "{}"),
        content="More.",
        completion_id="chatcmpl-2",
    )
    s = session(
        make_spec(limits={"max_iterations": 2}),
        Round(reply=Reply.parse(first), outcomes={0: ok("sunny")}),
        Round(reply=Reply.parse(second)),
    )
    assert plan(s) == Finish(ITER_LIMIT)
    skipped = err_text("NOT_RUN", "skipped: exceeded max_iterations")
    assert ended_transcript(s) == [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [canon("call_a", "get_weather", '{"city":"Paris"}')],
        },
        tool_msg("call_a", "sunny"),
        {
            "role": "assistant",
            "content": "More.",
            "tool_calls": [
                canon("call_b", "get_weather", '{"city":"Oslo"}'),
                canon("call_c", "get_time", "{}"),
                canon("call_d", "nope", "{}"),
            ],
        },
        tool_msg("call_b", skipped),
        tool_msg("call_c", skipped),
        tool_msg("call_d", skipped),
    ]
    # the cancelled filler does not override the limit verdict
    assert ended_transcript(s, CANCELLED) == ended_transcript(s)


@pytest.mark.parametrize(
    ("max_iterations", "replies", "expected"),
    [
        pytest.param(1, ["calls"], Finish(ITER_LIMIT), id="1-first-reply-calls"),
        pytest.param(2, ["calls"], "run", id="2-first-reply-calls"),
        pytest.param(2, ["calls", "calls"], Finish(ITER_LIMIT), id="2-second-reply-calls"),
        pytest.param(2, ["calls", "answer"], "answer", id="2-second-reply-answer"),
        pytest.param(3, ["calls", "calls"], "run", id="3-second-reply-calls"),
    ],
)
def test_max_iterations_table(max_iterations: int, replies: list[str], expected: Any) -> None:
    rounds = []
    for n, kind in enumerate(replies):
        last = n == len(replies) - 1
        if kind == "answer":
            rounds.append(Round(reply=Reply.parse(ANSWER)))
        else:
            rounds.append(
                Round(
                    reply=Reply.parse(
                        completion(call(f"call_{n}", "get_time", "{}"), completion_id=f"c{n}")
                    ),
                    outcomes={} if last else {0: ok("12:00")},
                )
            )
    step = plan(session(make_spec(limits={"max_iterations": max_iterations}), *rounds))
    if expected == "run":
        assert isinstance(step, RunTools)
        assert step.round_no == len(replies) - 1
        assert [r.index for r in step.runs] == [0]
    elif expected == "answer":
        assert step == Finish({**ANSWER, "_spear": {"backend": "replay", "model": "m-upstream"}})
    else:
        assert step == expected


def _calls_rounds(counts: list[int]) -> list[Round]:
    rounds = []
    for n, count in enumerate(counts):
        # a different zone each round: the same call three rounds running is REPEATED_CALL
        calls = [call(f"call_{n}_{i}", "get_time", f'{{"tz":"T{n}"}}') for i in range(count)]
        last = n == len(counts) - 1
        outcomes = {} if last else {i: ok("12:00") for i in range(count)}
        rounds.append(
            Round(reply=Reply.parse(completion(*calls, completion_id=f"c{n}")), outcomes=outcomes)
        )
    return rounds


@pytest.mark.parametrize(
    ("allowed", "counts", "runs"),
    [
        pytest.param(3, [2, 2], None, id="3-allowed-2-then-2"),
        pytest.param(4, [2, 2], 2, id="4-allowed-2-then-2"),
        pytest.param(3, [2, 1], 1, id="3-allowed-2-then-1"),
        pytest.param(3, [4], None, id="3-allowed-4-at-once"),
        pytest.param(3, [3], 3, id="3-allowed-3-at-once"),
        pytest.param(3, [1, 1, 2], None, id="3-allowed-1-1-2"),
    ],
)
def test_max_total_tool_calls_table(allowed: int, counts: list[int], runs: int | None) -> None:
    s = session(make_spec(limits={"max_total_tool_calls": allowed}), *_calls_rounds(counts))
    step = plan(s)
    if runs is None:
        assert step == Finish(TOTAL_LIMIT)
        skipped = err_text("NOT_RUN", "skipped: exceeded max_total_tool_calls")
        assert ended_transcript(s)[-counts[-1] :] == [
            tool_msg(f"call_{len(counts) - 1}_{i}", skipped) for i in range(counts[-1])
        ]
    else:
        assert isinstance(step, RunTools)
        assert len(step.runs) == runs


def test_max_total_tool_calls_second_turn_none_run() -> None:
    s = session(make_spec(limits={"max_total_tool_calls": 3}), *_calls_rounds([2, 2]))
    assert plan(s) == Finish(TOTAL_LIMIT)
    msgs = ended_transcript(s)
    assert [m["role"] for m in msgs] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "tool",
    ]
    assert [m["content"] for m in msgs[2:4]] == ["12:00", "12:00"]
    assert unanswered_calls(msgs) == []


# Error replies ------------------------------------------------------------------------------------

PROVIDER_ERROR = {"error": {"code": "provider_error", "message": "upstream said 400"}}


@pytest.mark.parametrize(
    ("rounds", "transcript_tail"),
    [
        pytest.param([Round(reply=Reply.parse(PROVIDER_ERROR))], [], id="first-round-error"),
        pytest.param(
            [
                Round(reply=Reply.parse(THREE_CALLS), outcomes=THREE_OUTCOMES),
                Round(reply=Reply.parse(PROVIDER_ERROR)),
            ],
            [
                THREE_CALLS_ASSISTANT,
                tool_msg("call_a", "sunny"),
                tool_msg("call_b", "12:00"),
                tool_msg("call_c", "rain"),
            ],
            id="second-round-error",
        ),
    ],
)
def test_error_reply_finishes_with_that_body(
    rounds: list[Round], transcript_tail: list[dict[str, Any]]
) -> None:
    s = session(
        make_spec(flags={"strict_unknown_tool": True}, limits={"max_iterations": 1}), *rounds
    )
    step = plan(s)
    assert step == Finish(PROVIDER_ERROR)
    assert isinstance(step, Finish) and not step.ok
    assert ended_transcript(s) == [USER, *transcript_tail]


# Transcript ---------------------------------------------------------------------------------------


def test_transcript_missing_cancelled_fills_every_unanswered_call() -> None:
    reply = completion(
        call("call_a", "get_weather", '{"city":"Paris"}'),
        call("call_x", "nope", "{}"),
        call("call_bad", "get_weather", "{}"),
        call("call_d", "get_time", "{}"),
        call("call_e", "get_time", "{}"),
    )
    s = session(
        make_spec(), Round(reply=Reply.parse(reply), outcomes={4: ok("12:00"), 0: ok("sunny")})
    )
    cancelled = '{"error":{"code":"NOT_RUN","message":"session cancelled before this call ran"}}'
    assert CANCELLED.message(envelope=False) == cancelled
    assert ended_transcript(s, CANCELLED)[2:] == [
        tool_msg("call_a", "sunny"),
        tool_msg("call_x", err_text("TOOL_NOT_FOUND", "unknown tool: nope")),
        tool_msg(
            "call_bad", err_text("VALIDATION_ERROR", "arguments: 'city' is a required property")
        ),
        tool_msg("call_d", cancelled),
        tool_msg("call_e", "12:00"),
    ]
    # without a filler, the call still to run is left out (the plan has no verdict for it)
    assert [m.get("tool_call_id") for m in ended_transcript(s)[2:]] == [
        "call_a",
        "call_x",
        "call_bad",
        "call_e",
    ]


TRANSCRIPT_SESSIONS = [
    pytest.param(session(make_spec()), id="no-rounds"),
    pytest.param(session(make_spec(), Round(reply=Reply.parse(THREE_CALLS))), id="nothing-run"),
    pytest.param(
        session(make_spec(), Round(reply=Reply.parse(THREE_CALLS), outcomes={1: ok("x")})),
        id="partly-run",
    ),
    pytest.param(
        session(make_spec(), Round(reply=Reply.parse(THREE_CALLS), outcomes=THREE_OUTCOMES)),
        id="all-run",
    ),
    pytest.param(
        session(
            make_spec(),
            Round(reply=Reply.parse(THREE_CALLS), outcomes=THREE_OUTCOMES),
            Round(reply=Reply.parse(ANSWER)),
        ),
        id="answered",
    ),
    pytest.param(
        session(
            make_spec(),
            Round(reply=Reply.parse(THREE_CALLS), outcomes=THREE_OUTCOMES),
            Round(reply=Reply.parse(PROVIDER_ERROR)),
        ),
        id="error-after-tools",
    ),
    pytest.param(
        session(make_spec(limits={"max_iterations": 1}), Round(reply=Reply.parse(THREE_CALLS))),
        id="iteration-limit",
    ),
    pytest.param(
        session(
            make_spec(limits={"max_total_tool_calls": 2}), Round(reply=Reply.parse(THREE_CALLS))
        ),
        id="total-limit",
    ),
    pytest.param(
        session(
            make_spec(),
            Round(
                reply=Reply.parse(completion(call("c1", "nope"), call("c2", "get_weather", "[]")))
            ),
        ),
        id="all-preset",
    ),
    pytest.param(
        session(
            make_spec(flags={"strict_unknown_tool": True}),
            Round(reply=Reply.parse(completion(call("c1", "nope")))),
        ),
        id="strict-unknown-only",
    ),
    pytest.param(
        session(
            make_spec(flags={"strict_unknown_tool": True}),
            Round(reply=Reply.parse(completion(call("c1", "nope"), call("c2", "get_time", "{}")))),
        ),
        id="strict-unknown-with-sibling",
    ),
]


@pytest.mark.parametrize("s", TRANSCRIPT_SESSIONS)
def test_transcript_with_cancelled_never_leaves_a_call_unanswered(s: Session) -> None:
    msgs = ended_transcript(s, CANCELLED)
    assert unanswered_calls(msgs) == []
    assert msgs[0] == USER


FINISHED = {
    "answered",
    "error-after-tools",
    "iteration-limit",
    "total-limit",
    "strict-unknown-only",
}
FINISHED_SESSIONS = [p for p in TRANSCRIPT_SESSIONS if p.id in FINISHED]


@pytest.mark.parametrize("s", FINISHED_SESSIONS)
def test_finished_transcript_answers_every_call(s: Session) -> None:
    # worker.session.steps.finish calls ended_transcript(session, None) when plan says Finish
    assert isinstance(plan(s), Finish)
    assert unanswered_calls(ended_transcript(s)) == []


def test_strict_unknown_tool_finish_transcript_answers_known_siblings() -> None:
    reply = completion(
        call("call_x", "nope", "{}"), call("call_a", "get_weather", '{"city":"Paris"}')
    )
    s = session(make_spec(flags={"strict_unknown_tool": True}), Round(reply=Reply.parse(reply)))
    assert plan(s) == Finish({"error": {"code": "unknown_tool", "message": "unknown tool: nope"}})
    assert unanswered_calls(ended_transcript(s)) == []


# Metrics ------------------------------------------------------------------------------------------


def test_metrics_sum_over_rounds() -> None:
    first = completion(
        call("call_a", "get_weather", '{"city":"Paris"}'),
        call("call_x", "get_wether", "{}"),
        usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    )
    second = completion(
        content="done",
        usage={
            "prompt_tokens": 30,
            "completion_tokens": 7,
            "completion_tokens_details": {"reasoning_tokens": 3},
        },
    )
    unknown = err("TOOL_NOT_FOUND", "unknown tool: get_wether")
    s = session(
        make_spec(),
        Round(reply=Reply.parse(first), outcomes={0: ok("☀ 20°C"), 1: unknown}),
        Round(reply=Reply.parse(second)),
    )
    assert metrics(s, 1234) == {
        "iterations": 2,
        "latency_ms": 1234,
        "tool_calls": 2,
        "tool_failures": 1,
        "tool_output_bytes": 9,  # "☀ 20°C" is 9 UTF-8 bytes; a failure has no output
        "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
    }


@pytest.mark.parametrize(
    ("rounds", "expected"),
    [
        pytest.param(
            [],
            {
                "iterations": 0,
                "latency_ms": 7,
                "tool_calls": 0,
                "tool_failures": 0,
                "tool_output_bytes": 0,
                "usage": {},
            },
            id="empty",
        ),
        pytest.param(
            [Round(reply=Reply.parse(PROVIDER_ERROR))],
            {
                "iterations": 0,
                "latency_ms": 7,
                "tool_calls": 0,
                "tool_failures": 0,
                "tool_output_bytes": 0,
                "usage": {},
            },
            id="error-only",
        ),
        pytest.param(
            [Round(reply=Reply.parse(completion(content="x")))],
            {
                "iterations": 1,
                "latency_ms": 7,
                "tool_calls": 0,
                "tool_failures": 0,
                "tool_output_bytes": 0,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            },
            id="no-usage-reported",
        ),
        pytest.param(
            [
                Round(
                    reply=Reply.parse(
                        completion(
                            call("a", "get_time"),
                            call("b", "get_time"),
                            call("c", "get_time"),
                            usage={"prompt_tokens": 3, "completion_tokens": 4},
                        )
                    ),
                    outcomes={0: ok(""), 1: ok("é"), 2: err("RUNTIME_ERROR", "tool rc: -1")},
                ),
                Round(reply=Reply.parse(PROVIDER_ERROR)),
            ],
            {
                "iterations": 1,
                "latency_ms": 7,
                "tool_calls": 3,
                "tool_failures": 1,
                "tool_output_bytes": 0 + 2,
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            },
            id="failures-and-error-round",
        ),
    ],
)
def test_metrics_table(rounds: list[Round], expected: dict[str, Any]) -> None:
    assert metrics(session(make_spec(), *rounds), 7) == expected


# Determinism --------------------------------------------------------------------------------------

PLAN_SESSIONS = [
    *TRANSCRIPT_SESSIONS,
    pytest.param(
        session(make_spec(flags={"auto_tool_call": False}), Round(reply=Reply.parse(THREE_CALLS))),
        id="auto-off",
    ),
    pytest.param(
        session(
            make_spec(),
            Round(
                reply=Reply.parse(
                    completion(call("a", "get_weather", "{}"), finish_reason="length")
                )
            ),
        ),
        id="truncated",
    ),
]


@pytest.mark.parametrize("s", PLAN_SESSIONS)
def test_plan_is_deterministic_and_pure(s: Session) -> None:
    before = copy.deepcopy(s)
    first = plan(s)
    assert plan(s) == first
    assert plan(copy.deepcopy(s)) == first  # a redelivered step reloads the same state
    assert ended_transcript(s, CANCELLED) == ended_transcript(copy.deepcopy(s), CANCELLED)
    assert s == before


# argument_problem ---------------------------------------------------------------------------------

LIST_FN = {
    "name": "f",
    "parameters": {
        "type": "object",
        "properties": {
            "cities": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "object", "properties": {"units": {"enum": ["C", "F"]}}},
        },
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize(
    ("arguments", "function", "expected"),
    [
        pytest.param('{"city":"Paris"}', WEATHER_FN, None, id="valid"),
        pytest.param('{"city":"Paris","extra":1}', WEATHER_FN, None, id="extra-allowed"),
        pytest.param("{}", TIME_FN, None, id="nothing-required"),
        pytest.param("{}", {"name": "f"}, None, id="no-parameters"),
        pytest.param('{"a": 1}', {"name": "f", "parameters": {}}, None, id="empty-schema"),
        pytest.param(
            "{}", WEATHER_FN, "arguments: 'city' is a required property", id="missing-required"
        ),
        pytest.param(
            '{"city": 5}', WEATHER_FN, "city: 5 is not of type 'string'", id="top-level-field"
        ),
        pytest.param(
            '{"cities": ["a", 3]}', LIST_FN, "cities/1: 3 is not of type 'string'", id="array-item"
        ),
        pytest.param(
            '{"opts": {"units": "K"}}',
            LIST_FN,
            "opts/units: 'K' is not one of ['C', 'F']",
            id="nested-field",
        ),
        pytest.param(
            '{"x": 1}',
            LIST_FN,
            "arguments: Additional properties are not allowed ('x' was unexpected)",
            id="additional-property",
        ),
        pytest.param(
            '["Paris"]', WEATHER_FN, "tool arguments must be a JSON object, got array", id="array"
        ),
        pytest.param(
            "{not json}",
            WEATHER_FN,
            "invalid JSON arguments: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1), resend valid JSON",
            id="bad-json",
        ),
    ],
)
def test_argument_problem(arguments: str, function: dict[str, Any], expected: str | None) -> None:
    assert argument_problem(arguments, function.get("parameters")) == expected


def test_argument_problem_is_capped_at_500_chars() -> None:
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 1}}}
    problem = argument_problem(json.dumps({"city": "x" * 600}), parameters)
    assert problem is not None
    assert problem.startswith("city: 'xxx")
    assert len(problem) == 500


def test_a_pattern_that_backtracks_is_stopped_not_a_frozen_worker() -> None:
    """Issue 10: "(a|a)+$" on a long value backtracks for ages in `re`; every pattern of a
    validation runs under a time limit, and a timeout is a validation error to the model."""
    parameters = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "(a|a)+$"}},
        "patternProperties": {"(a|a)+$": {"type": "string"}},
    }
    problem = argument_problem(json.dumps({"s": "a" * 40 + "b"}), parameters)
    assert problem is not None and "took over 100 ms" in problem
    key_problem = argument_problem(json.dumps({"a" * 40 + "b": "x"}), parameters)
    assert key_problem is not None and "took over 100 ms" in key_problem
    assert argument_problem('{"s": "aaa"}', parameters) is None

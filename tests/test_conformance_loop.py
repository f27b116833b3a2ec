"""Conformance cases of docs/provider-conformance.md that are session-engine behaviour: an
unknown tool name, tool-message ordering, max turns, a per-tool timeout, a tool that fails,
repeated calls, and the run's usage totals.

Sessions are driven through the real `plan` / `transcript` / `metrics` of worker.session.engine;
tools that time out or trap are real WASM guests (fixtures/guests) run by WasmToolRuntime and
turned into outcomes by `ToolCaller`, the code a tools worker runs.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.test_codec_openai_stream import USAGE, frag, sse, usage_chunk
from tests.test_codec_openai_stream import chunk as stream_chunk
from tests.test_codec_openai_stream import run as run_stream
from tests.test_engine import (
    ANSWER,
    USER,
    WEATHER_FN,
    call,
    canon,
    completion,
    ended_transcript,
    err,
    err_text,
    make_spec,
    ok,
    session,
    tool_msg,
    unanswered_calls,
)
from worker.codecs.anthropic import AnthropicCodec
from worker.codecs.gemini import GeminiCodec
from worker.codecs.openai_chat import normalize_usage
from worker.codecs.protocol import ChatRequest
from worker.codecs.reply import Reply
from worker.config import Settings
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.errors import ToolCallLimitError, ToolTimeoutError
from worker.session.ending import metrics
from worker.session.engine import (
    REPEAT_LIMIT,
    CallModel,
    Finish,
    RunTools,
    plan,
    tool_run,
)
from worker.session.outcomes import ToolOutcome
from worker.session.ports import ToolCall
from worker.session.state import Round, Session
from worker.session.steps import StepRunner
from worker.session.tool_policy import ToolCaller
from worker.session.twins.models import NoProvider, OpenRateControl, OpenRateLimiter
from worker.session.twins.queue import StepQueue
from worker.session.twins.store import MemoryStore

GUESTS = Path(__file__).resolve().parents[1] / "fixtures" / "guests"

# Small local helpers ----------------------------------------------------------------------------


def with_outcomes(s: Session, outcomes: dict[int, ToolOutcome]) -> Session:
    """Store `outcomes` for the last round, in the order given (a dict keeps insertion order)."""
    last = s.rounds[-1]
    merged = {**last.outcomes, **outcomes}
    return replace(s, rounds=(*s.rounds[:-1], Round(reply=last.reply, outcomes=merged)))


def drive(
    spec: dict[str, Any],
    replies: list[dict[str, Any]],
    run_tool: Callable[[RunTools, int], ToolOutcome],
) -> tuple[Session, Finish, list[str]]:
    """Follow `plan` like the steps do: answer CallModel with the next scripted reply, store
    the presets and run every ToolRun, until Finish. Returns the session, the Finish and the
    kinds of steps taken."""
    s = session(spec)
    script = iter(replies)
    kinds: list[str] = []
    for _ in range(100):
        step = plan(s)
        kinds.append(type(step).__name__)
        if isinstance(step, Finish):
            return s, step, kinds
        if isinstance(step, CallModel):
            assert step.round_no == len(s.rounds)
            s = replace(s, rounds=(*s.rounds, Round(reply=Reply.parse(next(script)))))
        else:
            assert isinstance(step, RunTools)
            outcomes = dict(step.presets)
            for run in step.runs:
                outcomes[run.index] = run_tool(step, run.index)
            s = with_outcomes(s, outcomes)
    raise AssertionError("the loop did not finish")


def weather_by_city(step: RunTools, index: int) -> ToolOutcome:
    run = next(r for r in step.runs if r.index == index)
    return ok(f"sunny in {json.loads(run.arguments).get('city', '?')}")


# Real WASM tools -------------------------------------------------------------------------------


class Guests:
    """fixtures/guests/*.wasm by sha256, as the module store serves them."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def sha(self, name: str) -> str:
        blob = (GUESTS / f"{name}.wasm").read_bytes()
        digest = hashlib.sha256(blob).hexdigest()
        self.blobs[digest] = blob
        return digest

    def __call__(self, sha: str) -> bytes:
        return self.blobs[sha]


@pytest.fixture
def guests() -> Guests:
    return Guests()


@pytest.fixture
def make_runner(tmp_path: Path, guests: Guests) -> Iterator[Callable[[], StepRunner]]:
    """A StepRunner with only a tools worker's parts: each one owns its WasmToolRuntime (its
    own engine and epoch timer), like a separate tools worker process."""
    runtimes: list[WasmToolRuntime] = []

    def factory() -> StepRunner:
        rt = WasmToolRuntime(tmp_path / f"cache{len(runtimes)}", guests)
        runtimes.append(rt)
        # the tool step uses only `tools` (and a fork loader for a program's tools, not here)
        return StepRunner(
            store=MemoryStore(),
            dispatch=StepQueue(),
            provider_for=NoProvider,
            tools=lambda: rt,
            settings=Settings(),
            rate_limiter=OpenRateLimiter(),
            rate_control=OpenRateControl(),
        )

    yield factory
    for rt in runtimes:
        rt.close()


def wasm_tool(guests: Guests, module: str, export: str, function: dict[str, Any]) -> dict[str, Any]:
    return {
        "module_sha256": guests.sha(module),
        "export": export,
        "table_index": None,
        "function": function,
    }


NO_ARGS_FN = {"name": "", "parameters": {"type": "object"}}


def execute(runner: StepRunner, s: Session, index: int) -> ToolOutcome:
    """What a tools worker does for call `index` of the last round (StepRunner.tool)."""
    run = tool_run(s.spec, s.rounds[-1].reply, index)
    assert run is not None
    return ToolCaller(runner.tools(), runner.settings.fleet.tool_defaults).run(s.spec, run)


# An unknown tool name is an error result, never a raise -----------------------------------------

UNKNOWN_BODY = '{"error":{"code":"TOOL_NOT_FOUND","message":"unknown tool: get_wether"}}'


def test_unknown_tool_is_an_error_result() -> None:
    reply = completion(
        call("call_x", "get_wether", '{"city":"Paris"}'),
        call("call_a", "get_weather", '{"city":"Paris"}'),
    )
    s = session(make_spec(), Round(reply=Reply.parse(reply)))
    step = plan(s)
    assert isinstance(step, RunTools)
    assert [r.index for r in step.runs] == [1]  # the unknown call never runs
    assert step.presets == {0: err("TOOL_NOT_FOUND", "unknown tool: get_wether")}
    assert step.presets[0].code == "TOOL_NOT_FOUND"

    s = with_outcomes(s, {**step.presets, 1: ok("sunny")})
    nxt = plan(s)
    assert isinstance(nxt, CallModel)  # the loop goes on: the model sees the error
    assert nxt.round_no == 1
    assert nxt.messages[-2:] == [tool_msg("call_x", UNKNOWN_BODY), tool_msg("call_a", "sunny")]


def test_unknown_tool_never_raises_out_of_the_loop() -> None:
    replies = [
        completion(call("call_x", "get_wether", "{}"), completion_id="c0"),
        completion(call("call_y", "rm_rf", '{"path":"/"}'), completion_id="c1"),
        ANSWER,
    ]
    s, finish, kinds = drive(make_spec(), replies, weather_by_city)
    assert finish.ok
    assert finish.body["choices"][0]["message"]["content"] == "It is sunny in Paris."
    # an all-unknown round runs nothing and still goes back to the model
    assert kinds == ["CallModel", "RunTools", "CallModel", "RunTools", "CallModel", "Finish"]
    tools = [m for m in ended_transcript(s) if m["role"] == "tool"]
    assert [json.loads(m["content"])["error"]["code"] for m in tools] == ["TOOL_NOT_FOUND"] * 2


def test_unknown_tool_error_keeps_the_guest_abi_text() -> None:
    """The conformance notes would list the valid names; docs/guest-abi.md section 4 fixes the
    exact message (SPEAR guests search these bytes), and the tools the model may call are in
    every request anyway. The ABI wins: the message names the unknown tool and nothing else."""
    s = session(
        make_spec(), Round(reply=Reply.parse(completion(call("call_x", "get_wether", "{}"))))
    )
    step = plan(s)
    assert isinstance(step, RunTools)
    assert json.loads(step.presets[0].message(envelope=False))["error"] == {
        "code": "TOOL_NOT_FOUND",
        "message": "unknown tool: get_wether",
    }


# Each call id gets one tool message, right after its turn, in call order ------------------------

FIRST = completion(
    call("call_a", "get_weather", '{"city":"Paris"}'),
    call("call_b", "get_time", '{"tz":"UTC"}'),
    call("call_c", "get_weather", '{"city":"Oslo"}'),
    content="Let me check.",
    completion_id="c0",
)
SECOND = completion(
    call("call_d", "get_wether", "{}"),
    call("call_e", "get_weather", '{"city":"Rome"}'),
    completion_id="c1",
)


def two_rounds_stored_out_of_order() -> Session:
    """Two tool rounds whose outcomes were stored in reverse call order."""
    s = session(make_spec(), Round(reply=Reply.parse(FIRST)))
    s = with_outcomes(s, {2: ok("rain"), 1: ok("12:00"), 0: ok("sunny")})
    s = replace(s, rounds=(*s.rounds, Round(reply=Reply.parse(SECOND))))
    step = plan(s)
    assert isinstance(step, RunTools)
    assert list(step.presets) == [0]  # get_wether is unknown
    return with_outcomes(s, {1: ok("hot"), **step.presets})


def test_tool_messages_follow_their_turn_in_call_order() -> None:
    s = two_rounds_stored_out_of_order()
    assert list(s.rounds[0].outcomes) == [2, 1, 0]
    step = plan(s)
    assert isinstance(step, CallModel)
    assert step.round_no == 2
    assert step.messages == [
        USER,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                canon("call_a", "get_weather", '{"city":"Paris"}'),
                canon("call_b", "get_time", '{"tz":"UTC"}'),
                canon("call_c", "get_weather", '{"city":"Oslo"}'),
            ],
        },
        tool_msg("call_a", "sunny"),
        tool_msg("call_b", "12:00"),
        tool_msg("call_c", "rain"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                canon("call_d", "get_wether", "{}"),
                canon("call_e", "get_weather", '{"city":"Rome"}'),
            ],
        },
        tool_msg("call_d", err_text("TOOL_NOT_FOUND", "unknown tool: get_wether")),
        tool_msg("call_e", "hot"),
    ]
    assert unanswered_calls(step.messages) == []


def _history() -> tuple[ChatRequest, list[list[str]]]:
    step = plan(two_rounds_stored_out_of_order())
    assert isinstance(step, CallModel)
    request = ChatRequest(model="m", messages=step.messages, tools=step.tools)
    return request, [["call_a", "call_b", "call_c"], ["call_d", "call_e"]]


def test_anthropic_tool_results_in_one_user_turn_in_call_order() -> None:
    request, ids = _history()
    turns = AnthropicCodec().encode(request).body["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user"]
    for n, (assistant, answer) in enumerate([(turns[1], turns[2]), (turns[3], turns[4])]):
        uses = [b["id"] for b in assistant["content"] if b["type"] == "tool_use"]
        assert uses == ids[n]
        assert [b["type"] for b in answer["content"]] == ["tool_result"] * len(uses)
        assert [b["tool_use_id"] for b in answer["content"]] == uses
    assert [b["content"] for b in turns[2]["content"]] == ["sunny", "12:00", "rain"]
    assert [b.get("is_error", False) for b in turns[4]["content"]] == [True, False]


def test_gemini_function_responses_in_one_user_content_in_call_order() -> None:
    request, ids = _history()
    contents = GeminiCodec().encode(request).body["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user", "model", "user"]
    for n, (model, answer) in enumerate([(contents[1], contents[2]), (contents[3], contents[4])]):
        calls = [p["functionCall"] for p in model["parts"] if "functionCall" in p]
        responses = [p["functionResponse"] for p in answer["parts"]]
        assert [c["id"] for c in calls] == ids[n]
        assert [r["id"] for r in responses] == ids[n]
        assert [r["name"] for r in responses] == [c["name"] for c in calls]
    assert [p["functionResponse"]["response"] for p in contents[2]["parts"]] == [
        {"content": "sunny"},
        {"content": "12:00"},
        {"content": "rain"},
    ]
    assert contents[4]["parts"][0]["functionResponse"]["response"] == {
        "error": {"code": "TOOL_NOT_FOUND", "message": "unknown tool: get_wether"}
    }


# Max turns: a typed error, every call answered --------------------------------------------------


@pytest.mark.parametrize("max_iterations", [1, 2, 3])
def test_max_turns_ends_with_typed_error_and_answered_transcript(
    max_iterations: int,
) -> None:
    replies = [
        completion(
            call(f"call_{n}a", "get_weather", f'{{"city":"C{n}"}}'),
            call(f"call_{n}b", "get_time", "{}"),
            completion_id=f"c{n}",
        )
        for n in range(max_iterations + 5)  # a model that never stops asking
    ]
    s, finish, kinds = drive(
        make_spec(limits={"max_iterations": max_iterations}), replies, weather_by_city
    )
    assert kinds.count("CallModel") == max_iterations  # the N-th reply is the last one
    assert len(s.rounds) == max_iterations
    assert finish == Finish(
        {"error": {"code": "tool_call_limit", "message": "exceeded max_iterations"}}
    )
    assert finish.body["error"]["code"] == ToolCallLimitError.code
    history = ended_transcript(s)
    assert unanswered_calls(history) == []
    skipped = err_text("NOT_RUN", "skipped: exceeded max_iterations")
    last = max_iterations - 1
    assert history[-2:] == [tool_msg(f"call_{last}a", skipped), tool_msg(f"call_{last}b", skipped)]
    # the rounds before the limit ran their tools
    assert [m["content"] for m in history if m["role"] == "tool"][: 2 * last] == [
        text for n in range(last) for text in (f"sunny in C{n}", "sunny in ?")
    ]


# A per-tool timeout is an error result; the loop continues --------------------------------------


def test_tool_that_never_returns_times_out(
    make_runner: Callable[[], StepRunner], guests: Guests
) -> None:
    rt = make_runner().tools()
    assert isinstance(rt, WasmToolRuntime)
    invocation = ToolCall(guests.sha("spin"), "spin", None, None, b"{}", timeout_ms=200)
    with pytest.raises(ToolTimeoutError, match=r"^tool timed out after 200 ms$"):
        rt.run(invocation)


def test_timeout_is_an_error_result_and_siblings_keep_call_order(
    make_runner: Callable[[], StepRunner], guests: Guests
) -> None:
    spec = make_spec(
        tools=[
            wasm_tool(guests, "weather", "get_weather", WEATHER_FN),
            wasm_tool(guests, "spin", "spin", {**NO_ARGS_FN, "name": "spin"}),
        ],
        limits={"tool_timeout_ms": 200},
    )
    reply = completion(
        call("call_a", "get_weather", '{"city":"Paris"}'),
        call("call_b", "spin", "{}"),
        call("call_c", "get_weather", '{"city":"Oslo"}'),
    )
    s = session(spec, Round(reply=Reply.parse(reply)))
    step = plan(s)
    assert isinstance(step, RunTools)
    assert [r.index for r in step.runs] == [0, 1, 2]

    # parallel calls: each on its own tools worker, with its own timer
    results: dict[int, ToolOutcome] = {}
    lock = threading.Lock()

    def work(index: int, runner: StepRunner) -> None:
        outcome = execute(runner, s, index)
        with lock:
            results[index] = outcome

    threads = [threading.Thread(target=work, args=(r.index, make_runner())) for r in step.runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == [0, 1, 2]

    timed_out = results[1]
    assert (timed_out.code, timed_out.ran) == ("TIMEOUT", True)
    assert timed_out.message(envelope=False) == err_text("TIMEOUT", "tool timed out after 200 ms")
    assert timed_out.latency_ms >= 200
    assert results[0].ok and json.loads(results[0].output or "")["city"] == "Paris"
    assert results[2].ok and json.loads(results[2].output or "")["city"] == "Oslo"

    s = with_outcomes(s, {i: results[i] for i in (1, 2, 0)})  # stored as they finished
    nxt = plan(s)
    assert isinstance(nxt, CallModel)  # the loop continues
    assert nxt.messages[-3:] == [
        tool_msg("call_a", results[0].message(envelope=False)),
        tool_msg("call_b", timed_out.message(envelope=False)),
        tool_msg("call_c", results[2].message(envelope=False)),
    ]


# A tool that fails is an error result; its siblings keep theirs ---------------------------------


def test_trapping_tool_is_an_error_result_and_keeps_siblings(
    make_runner: Callable[[], StepRunner], guests: Guests
) -> None:
    spec = make_spec(
        tools=[
            wasm_tool(guests, "weather", "get_weather", WEATHER_FN),
            wasm_tool(guests, "trap", "boom", {**NO_ARGS_FN, "name": "boom"}),
        ]
    )
    reply = completion(
        call("call_a", "get_weather", '{"city":"Paris"}'),
        call("call_b", "boom", "{}"),
        call("call_c", "get_weather", '{"city":"Oslo"}'),
    )
    s = session(spec, Round(reply=Reply.parse(reply)))
    step = plan(s)
    assert isinstance(step, RunTools)
    runner = make_runner()
    outcomes = {run.index: execute(runner, s, run.index) for run in reversed(step.runs)}

    failed = outcomes[1]
    assert not failed.ok
    assert failed.code == "RUNTIME_ERROR"
    error = json.loads(failed.message(envelope=False))["error"]
    assert error["message"].startswith("tool trapped: wasm trap: wasm `unreachable`")
    assert failed.message(envelope=False) == err_text("RUNTIME_ERROR", error["message"])
    assert outcomes[0].ok and outcomes[2].ok

    s = with_outcomes(s, outcomes)
    nxt = plan(s)
    assert isinstance(nxt, CallModel)
    assert [(m["tool_call_id"], m["content"]) for m in nxt.messages[-3:]] == [
        ("call_a", outcomes[0].message(envelope=False)),
        ("call_b", failed.message(envelope=False)),
        ("call_c", outcomes[2].message(envelope=False)),
    ]
    assert unanswered_calls(nxt.messages) == []
    assert metrics(s, 0)["tool_failures"] == 1


# The same call repeated in a row is refused -----------------------------------------------------

REPEATED = err(
    "REPEATED_CALL",
    f"this exact call was made {REPEAT_LIMIT} times in a row; "
    "use its earlier result or change the arguments",
)


def rounds_asking(*arguments: str, extra: list[dict[str, Any]] | None = None) -> Session:
    """One round per `arguments` (get_weather with them); all but the last answered."""
    rounds = []
    for n, args in enumerate(arguments):
        last = n == len(arguments) - 1
        calls = [call(f"call_{n}", "get_weather", args), *((extra or []) if last else [])]
        reply = completion(*calls, completion_id=f"c{n}")
        rounds.append(Round(reply=Reply.parse(reply), outcomes={} if last else {0: ok("sunny")}))
    return session(make_spec(), *rounds)


def test_third_identical_call_is_a_repeated_call_error() -> None:
    assert REPEAT_LIMIT == 3
    # the same call, spelt three ways: compared after canonicalisation
    s = rounds_asking('{"city":"Paris"}', '{ "city" : "Paris" }', '{"city": "Paris"}')
    step = plan(s)
    assert step == RunTools(round_no=2, call_count=1, runs=(), presets={0: REPEATED})
    s = with_outcomes(s, step.presets)
    nxt = plan(s)
    assert isinstance(nxt, CallModel)  # a hint to the model, not the end of the session
    assert nxt.round_no == 3
    assert nxt.messages[-1] == tool_msg("call_2", REPEATED.message(envelope=False))


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param(['{"city":"Paris"}'], id="first"),
        pytest.param(['{"city":"Paris"}', '{ "city" : "Paris" }'], id="second"),
        pytest.param(['{"city":"Paris"}', '{"city":"Oslo"}', '{"city":"Paris"}'], id="reset"),
        pytest.param(['{"city":"Oslo"}', '{"city":"Paris"}', '{"city":"Paris"}'], id="late"),
        pytest.param(['{"city":"Paris"}', '{"city":"Paris"}', '{"city":"Rome"}'], id="changed"),
    ],
)
def test_fewer_repeats_or_a_different_argument_runs_the_call(arguments: list[str]) -> None:
    step = plan(rounds_asking(*arguments))
    assert isinstance(step, RunTools)
    assert step.presets == {}
    assert [r.index for r in step.runs] == [0]


def test_fourth_identical_call_is_refused_again_and_siblings_still_run() -> None:
    paris = '{"city":"Paris"}'
    s = rounds_asking(paris, paris, paris, paris, extra=[call("call_t", "get_time", "{}")])
    step = plan(s)
    assert isinstance(step, RunTools)
    assert step.presets == {0: REPEATED}
    assert [(r.index, r.name) for r in step.runs] == [(1, "get_time")]


# Run totals: the final usage of every call, never streamed partials -----------------------------


def test_run_totals_sum_the_final_usage_of_every_call() -> None:
    usages = [
        {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37},
        {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52},
    ]
    first = completion(call("call_a", "get_weather", '{"city":"Paris"}'), completion_id="c0")
    second = completion(call("call_b", "get_time", "{}"), completion_id="c1")
    rounds = [
        Round(reply=Reply.parse({**first, "usage": usages[0]}), outcomes={0: ok("sunny")}),
        # a stored usage with an extra integer field: summed like the others
        Round(
            reply=Reply.parse({**second, "usage": {**usages[1], "cached_tokens": 4}}),
            outcomes={0: ok("x")},
        ),
        Round(reply=Reply.parse({**ANSWER, "usage": usages[2]})),
    ]
    s = session(make_spec(), *rounds)
    assert isinstance(plan(s), Finish)
    # per-call records: each stored reply keeps its own final usage
    per_call = [r.reply.usage for r in s.rounds]
    assert per_call == [usages[0], {**usages[1], "cached_tokens": 4}, usages[2]]
    assert metrics(s, 0)["usage"] == {
        "prompt_tokens": 90,
        "completion_tokens": 14,
        "total_tokens": 104,
        "cached_tokens": 4,
    }
    assert metrics(s, 0)["iterations"] == 3


FINAL = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103}


PARTIAL = {"prompt_tokens": 82, "completion_tokens": 1, "total_tokens": 83}
ROLE_CHUNK = stream_chunk({"role": "assistant", "content": None})
CALL_CHUNK = stream_chunk({"tool_calls": [frag(0, id="call_s", name="get_time", args="{}")]})


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            sse(
                {**ROLE_CHUNK, "usage": PARTIAL},
                {**CALL_CHUNK, "usage": {**PARTIAL, "completion_tokens": 9, "total_tokens": 91}},
                stream_chunk(finish="tool_calls"),
                usage_chunk(),  # include_usage: the final usage comes last, in choices: []
            ),
            id="final-usage-chunk",
        ),
        pytest.param(
            sse(
                {**ROLE_CHUNK, "usage": PARTIAL},
                {**CALL_CHUNK, "usage": {**PARTIAL, "completion_tokens": 9, "total_tokens": 91}},
                {**stream_chunk(finish="tool_calls"), "usage": USAGE},
            ),
            id="cumulative-on-every-chunk",
        ),
    ],
)
def test_streaming_partials_are_never_summed(body: bytes) -> None:
    asm, _ = run_stream(body)
    streamed = asm.result()
    assert streamed["usage"] == normalize_usage(USAGE)  # only the final usage, not a sum

    s = session(
        make_spec(),
        Round(reply=Reply.parse(streamed), outcomes={0: ok("12:00")}),
        Round(reply=Reply.parse(completion(content="12:00 UTC", usage=FINAL))),
    )
    assert metrics(s, 0)["usage"] == {
        "prompt_tokens": 182,
        "completion_tokens": 20,
        "total_tokens": 202,
    }

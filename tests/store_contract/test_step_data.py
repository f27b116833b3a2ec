"""The StepData contract: a step's reads and writes of its own session's keys (specs, stored
rounds and outcomes, first writer wins, the fan-in count, calls under max_parallel);
run on the in-memory twin, one Redis and a 3-master cluster (conftest.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas import keys
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
from tests.store_contract.conftest import Backend, completion, spec, store_reply
from worker.codecs.reply import Reply
from worker.errors import StoreError
from worker.session.engine import ToolRun
from worker.session.outcomes import ToolFailure, ToolOutcome
from worker.session.round_record import PlannedRun
from worker.session.store_ports import StepData


def port(backend: Backend) -> StepData:
    """The store as this role's port: a test of it calls nothing else."""
    return backend.store


def test_a_round_is_stored_with_the_runs_its_plan_made(backend: Backend, sk: str) -> None:
    """A tool step reads its run as the round step planned it: id, tool, canonical args."""
    typed = spec_from_json(spec(sk))
    assert isinstance(typed, SessionSpec)
    backend.submit(sk, spec(sk), "")
    reply = Reply.parse(completion("a", "b"))
    tool = ToolSpec(FunctionSpec("get_weather"), "weather.wasm", export="get_weather")
    runs = (ToolRun(1, "b", "get_weather", tool, '{"city":"Paris"}'),)
    port(backend).store_round(sk, 0, reply, runs)
    stored, _ = port(backend).tool_inputs(sk, 0, 1)
    assert stored is not None and stored.calls == 2
    assert stored.runs == {1: PlannedRun("b", "get_weather", '{"city":"Paris"}')}
    with_tool = replace(typed, tools=(tool,))
    assert stored.run(with_tool, 1) == runs[0]
    assert stored.run(with_tool, 0) is None  # the plan made no run of call 0


def test_a_missing_spec_is_a_store_error(backend: Backend, sk: str) -> None:
    with pytest.raises(StoreError, match="spec not found"):
        port(backend).load_spec(sk)


def test_the_first_model_reply_wins(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    ours = Reply.parse(completion("a"))
    first = port(backend).store_round(sk, 0, ours, ())
    second = port(backend).store_round(sk, 0, Reply.parse(completion()), ())
    assert first is ours  # this call stored it
    assert first.completion == second.completion == completion("a")


def test_tool_outcomes_first_writer_wins_and_fan_in_counts_each_call_once(
    backend: Backend, sk: str
) -> None:
    backend.submit(sk, spec(sk), "")
    store_reply(port(backend), sk, 0, completion("a", "b"))
    store = port(backend)
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


def test_load_session_reads_rounds_up_to_the_one_asked(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    store_reply(port(backend), sk, 0, completion("a"))
    port(backend).store_tool_outcomes(sk, 0, {0: ToolOutcome.success("x")}, 1)
    store_reply(port(backend), sk, 1, completion())
    assert len(port(backend).load_session(sk, "r").rounds) == 2
    assert len(port(backend).load_session(sk, "r", upto_round=0).rounds) == 1


def test_specs_round_trip_as_json(backend: Backend, sk: str) -> None:
    original = spec(sk) | {"params": {"temperature": 0.5, "stop": ["\n"]}}
    backend.submit(sk, original, "")
    assert spec_to_json(port(backend).load_spec(sk)) == spec_to_json(spec_from_json(original))


def test_a_specs_mcp_tools_are_stored_once_and_read_with_it(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk) | {"mcp_servers": ["fs"]}, "")
    unlisted = port(backend).load_spec(sk)
    assert isinstance(unlisted, SessionSpec) and unlisted.mcp_servers == ("fs",)
    server = McpServerConfig(id="fs", command=("x",), timeout_ms=3000)
    first = offered_tools(server, [McpToolInfo("add", "Add", {"type": "object"})])
    later = offered_tools(server, [McpToolInfo("echo", None, {"type": "object"})])
    port(backend).store_mcp_tools(sk, first)
    port(backend).store_mcp_tools(sk, later)  # a redelivered first round's: the first wins
    listed = port(backend).load_spec(sk)
    assert isinstance(listed, SessionSpec) and listed.mcp_servers == ()
    assert listed.tools == first and listed.tools[0].mcp == McpToolRef("fs", "add")


def test_a_round_with_many_calls_reads_every_outcome(backend: Backend, sk: str) -> None:
    """More calls than the store reads speculatively with the replies (a second read)."""
    backend.submit(sk, spec(sk), "")
    ids = [f"c{i}" for i in range(9)]
    store_reply(port(backend), sk, 0, completion(*ids))
    outcomes = {i: ToolOutcome.success(f"out{i}") for i in (0, 7, 8)}
    assert port(backend).store_tool_outcomes(sk, 0, outcomes, 9) == 3
    [round_0] = port(backend).load_session(sk, "r").rounds
    assert round_0.outcomes == {i: ToolOutcome.success(f"out{i}") for i in (0, 7, 8)}


def test_calls_under_max_parallel_are_queued_claimed_once_and_counted_until_answered(
    backend: Backend, sk: str
) -> None:
    store = port(backend)
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
    assert backend.store.begin_step(keys.tool_step(sk, 0, 3), 60_000, None, sk).leased
    assert store.unstarted_calls(sk, 0, 4) == ([], 3)


def test_a_streamed_rounds_partial_text_is_set_and_cleared(backend: Backend, sk: str) -> None:
    backend.submit(sk, spec(sk), "")
    port(backend).set_partial(sk, PartialRound("half"))
    port(backend).set_partial(sk, None)

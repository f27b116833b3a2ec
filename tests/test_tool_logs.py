"""What a tool call writes for its user: its `log` lines and stdout/stderr,
bounded per call, stored with its outcome, shown in the session's record marked with the call,
counted (never quoted) in the trace, and merged into a program's logs where it saw its chat end.
On the twins, on real wasmtime in process (a SPEAR-style guest), and through the CLI's output.
The fleet test is in test_programs.py."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.batch import result_line
from producer.cli_programs import log_origin
from schemas import keys
from tests.test_engine import WEATHER_FN
from tests.test_hostcalls import _Source
from tests.test_steps import SK, pipeline, reply, spec, submit
from tests.test_tool_policy import _run, _spec
from tests.test_wasm_runtime import SIG, Modules
from tests.twin_pipeline import Pipeline
from tests.twin_pipeline import pipeline as twin_pipeline
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.errors import ToolRuntimeError
from worker.guest.host import ChatDefaults, ProgramHost
from worker.guest.runner import ProgramRun, run_program
from worker.session.outcomes import ToolOutcome
from worker.session.ports import ToolCall
from worker.session.tool_logs import ToolLogLine, ToolLogs

GUESTS = Path(__file__).resolve().parents[1] / "fixtures" / "guests"


def kept(logs: ToolLogs) -> list[tuple[str, str, str]]:
    return [(line.stream, line.level, line.message) for line in logs.lines]


# the bounded collector ---------------------------------------------------------------------


def test_streams_make_lines_of_their_pieces_and_the_last_one_ends_with_the_call() -> None:
    logs = ToolLogs()
    logs.write("stdout", b"sum st")
    logs.log(2, "sum invoked")
    logs.write("stdout", b"dout\r\nand a ")
    logs.write("stderr", b"err\n")
    logs.write("stdout", b"tail")
    logs.flush()
    assert kept(logs) == [
        ("log", "info", "sum invoked"),
        ("stdout", "info", "sum stdout"),  # a line is kept when it is finished
        ("stderr", "info", "err"),
        ("stdout", "info", "and a tail"),
    ]
    assert logs.dropped == 0


def test_a_call_keeps_at_most_its_lines_and_bytes_and_counts_the_rest() -> None:
    logs = ToolLogs(max_lines=3)
    for n in range(5):
        logs.log(4, f"line {n}")
    assert [line.message for line in logs.lines] == ["line 0", "line 1", "line 2"]
    assert logs.dropped == 2

    logs = ToolLogs(max_bytes=10)
    logs.log(2, "12345")
    logs.log(2, "123456")  # over what is left: dropped, and a shorter one still fits
    logs.log(2, "1234")
    assert [line.message for line in logs.lines] == ["12345", "1234"]
    assert logs.dropped == 1


def test_a_stream_line_too_long_to_keep_is_counted_once_and_never_held() -> None:
    logs = ToolLogs(max_bytes=8)
    logs.write("stdout", b"x" * 6)
    logs.write("stdout", b"y" * 6)  # 12 unfinished bytes: nothing of this line can be kept
    logs.write("stdout", b"z" * 1000 + b"\nok\n")
    logs.flush()
    assert kept(logs) == [("stdout", "info", "ok")]
    assert logs.dropped == 1


def test_the_stored_outcome_keeps_the_lines_and_an_outcome_without_any_is_unchanged() -> None:
    lines = (ToolLogLine("warn", "hm", "log"), ToolLogLine("info", "out", "stdout", attempt=1))
    outcome = ToolOutcome.success("42", logs=lines, dropped_logs=3)
    stored = outcome.to_json()
    assert stored["logs"] == [
        {"level": "warn", "message": "hm", "stream": "log"},
        {"level": "info", "message": "out", "stream": "stdout", "attempt": 1},
    ]
    assert ToolOutcome.from_json(json.loads(json.dumps(stored))) == outcome
    assert "logs" not in ToolOutcome.success("42").to_json()


# the caller: every attempt's lines, a failed call's too ------------------------------------


class LoggingTools:
    """A ToolRuntime whose calls log a line each, then fail with the given errors, in order."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)

    def run(self, call: ToolCall) -> str:
        assert call.logs is not None
        call.logs.log(2, f"try {call.attempt}: {call.arguments.decode()}")
        call.logs.write("stderr", b"on stderr\n")
        if self.errors:
            raise self.errors.pop(0)
        return "sunny"


def test_the_lines_of_every_attempt_are_kept_marked_with_it() -> None:
    outcome = _run(_spec({"max_retries": 1}), LoggingTools(ToolRuntimeError("tool rc: -5")))
    assert outcome.ok
    assert [(line.attempt, line.stream, line.message) for line in outcome.logs] == [
        (0, "log", 'try 0: {"city":"Paris"}'),
        (0, "stderr", "on stderr"),
        (1, "log", 'try 1: {"city":"Paris"}'),
        (1, "stderr", "on stderr"),
    ]


def test_a_failed_calls_lines_are_kept() -> None:
    outcome = _run(_spec({"max_retries": 0}), LoggingTools(ToolRuntimeError("tool rc: -5")))
    assert not outcome.ok
    assert [line.message for line in outcome.logs] == ['try 0: {"city":"Paris"}', "on stderr"]


# the steps: the record, the trace, a redelivery ----------------------------------------------


def two_calls(request: Any) -> dict[str, Any]:
    if request.messages[-1]["role"] == "tool":
        return reply("done")
    return reply(
        None,
        ("call_a", "get_weather", '{"city":"Paris"}'),
        ("call_b", "get_weather", '{"city":"Oslo"}'),
    )


def test_a_sessions_record_shows_each_calls_lines_in_call_order_and_the_trace_counts_them() -> None:
    p = pipeline([two_calls, two_calls])
    p.runner.tools = lambda: LoggingTools()
    submit(p, spec(WEATHER_FN))
    p.queue.tool(SK, 0, 0)  # a tool step delivered twice: its lines are in the record once
    p.drain()
    record = p.store.record(SK)
    assert record is not None and record["status"] == "ok"
    mark = {"round": 0, "tool": "get_weather", "source": "tool"}
    assert record["tool_logs"] == [
        {**mark, "call_id": "call_a", "level": "info", "message": 'try 0: {"city":"Paris"}',
         "stream": "log"},
        {**mark, "call_id": "call_a", "level": "info", "message": "on stderr", "stream": "stderr"},
        {**mark, "call_id": "call_b", "level": "info", "message": 'try 0: {"city":"Oslo"}',
         "stream": "log"},
        {**mark, "call_id": "call_b", "level": "info", "message": "on stderr", "stream": "stderr"},
    ]  # fmt: skip
    assert result_line(record)["tool_logs"] == record["tool_logs"]  # `cchatq result --full`
    events = [e.to_json() for e in p.store.traces[SK]]
    logged = [e for e in events if e["event"] == "tool.logs"]
    assert sorted((e["call_id"], e["lines"], e["dropped"]) for e in logged) == [
        ("call_a", 2, 0),
        ("call_b", 2, 0),
    ]
    assert {e["log_bytes"] for e in logged} == {len('try 0: {"city":"Paris"}on stderr'),
                                                len('try 0: {"city":"Oslo"}on stderr')}  # fmt: skip
    assert "Paris" not in json.dumps(events)  # the lines' text stays in the record


def test_a_call_past_its_bound_says_so_in_the_record() -> None:
    class Chatty:
        def run(self, call: ToolCall) -> str:
            assert call.logs is not None
            call.logs.write("stdout", b"".join(b"line %d\n" % n for n in range(100)))
            return "sunny"

    p = pipeline([two_calls, two_calls])
    p.runner.tools = lambda: Chatty()
    submit(p, spec(WEATHER_FN))
    p.drain()
    record = p.store.record(SK)
    assert record is not None
    first = [e for e in record["tool_logs"] if e["call_id"] == "call_a"]
    assert [e["message"] for e in first[:64]] == [f"line {n}" for n in range(64)]
    assert first[64]["dropped"] == 36 and first[64]["level"] == "warn"
    assert first[64]["message"].startswith("36 more line(s) of this call dropped")
    events = [e.to_json() for e in p.store.traces[SK]]
    assert [e["dropped"] for e in events if e["event"] == "tool.logs"] == [36, 36]


def test_a_session_whose_tools_wrote_nothing_keeps_its_records_shape() -> None:
    p = pipeline([two_calls, two_calls])
    submit(p, spec(WEATHER_FN))
    p.drain()
    record = p.store.record(SK)
    assert record is not None and "tool_logs" not in record
    assert "tool_logs" not in result_line(record)


# real wasmtime: a tool's stdout/stderr, a trapping tool, a SPEAR-style program ---------------

LOG_THEN_TRAP_WAT = f"""
(module
  (import "spear" "log" (func $log (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "no newline")
  (data (i32.const 32) "about to trap")
  (data (i32.const 48) "err line\\n")
  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 0) (local.get $ptr))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func (export "t") {SIG}
    (call $write (i32.const 1) (i32.const 16) (i32.const 10))
    (drop (call $log (i32.const 3) (i32.const 32) (i32.const 13)))
    (call $write (i32.const 2) (i32.const 48) (i32.const 9))
    unreachable))
"""


def test_a_trapping_tools_lines_and_its_unfinished_stdout_are_kept(tmp_path: Path) -> None:
    modules = Modules()
    sha = modules.add(LOG_THEN_TRAP_WAT)
    runtime = WasmToolRuntime(tmp_path / "cache", modules)
    logs = ToolLogs()
    call = ToolCall(sha, "t", None, None, b"{}", 5_000, 16 << 20, 4096, logs=logs)
    try:
        with pytest.raises(ToolRuntimeError, match="trapped"):
            runtime.run(call)
    finally:
        runtime.close()
    assert kept(logs) == [
        ("log", "warn", "about to trap"),
        ("stderr", "info", "err line"),
        ("stdout", "info", "no newline"),  # ended with the call
    ]


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[tuple[Pipeline, dict[str, bytes]]]:
    blobs: dict[str, bytes] = {}
    pipe = twin_pipeline(blobs, tmp_path / "cache")
    try:
        yield pipe, blobs
    finally:
        pipe.close()


def test_a_spear_style_programs_logs_hold_its_forked_tools_lines_in_call_order(
    twins: tuple[Pipeline, dict[str, bytes]],
) -> None:
    pipe, blobs = twins
    blob = (GUESTS / "prog_spear_tool_log.wasm").read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    blobs[sha] = blob
    run_sk = keys.run_session_key(keys.DEFAULT_NAMESPACE, "toollogs", keys.new_generation())
    defaults = ChatDefaults("toollogs", run_sk, sha, None, None, time.monotonic() + 60)
    host = ProgramHost(defaults, pipe.store, pipe.queue)
    outcome = run_program(_Source(pipe.runtime), ProgramRun(module_sha256=sha), host)
    assert outcome.exit_code == 0, outcome
    assert outcome.stdout == b'ANSWER: Tool said: {\\"sum\\":42} | {\\"sum\\":3}\n'

    def tool(call_id: str, stream: str, message: str) -> dict[str, Any]:
        return {"call_id": call_id, "round": 0, "tool": "sum", "source": "tool",
                "level": "info", "message": message, "stream": stream}  # fmt: skip

    assert host.logs == [
        {"level": "info", "message": "program: sending"},
        tool("call_0_0", "log", "sum invoked: a=7 b=35 sum=42 cap=65536"),
        tool("call_0_0", "stderr", "sum stderr: a=7 b=35"),
        tool("call_0_0", "stdout", "sum stdout: sum=42"),
        tool("call_0_1", "log", "sum invoked: a=1 b=2 sum=3 cap=65536"),
        tool("call_0_1", "stderr", "sum stderr: a=1 b=2"),
        tool("call_0_1", "stdout", "sum stdout: sum=3"),
        {"level": "info", "message": "program: answered"},
    ]


def test_cchatq_run_names_the_call_of_a_tools_line() -> None:
    own = {"level": "info", "message": "program: sending"}
    line = {"call_id": "call_0_0", "tool": "sum", "source": "tool", "stream": "log"}
    assert log_origin(own) == ""
    assert log_origin(line) == "sum call_0_0: "
    assert log_origin({**line, "stream": "stderr"}) == "sum call_0_0 stderr: "

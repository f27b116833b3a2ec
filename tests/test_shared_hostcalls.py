"""The hostcalls a program and its tools share (`log`, `time_now_ms`, `wall_time_s`,
`random_i64`, `sleep_ms`; docs/guest-abi.md section 6) answer the same in both modes: one WAT
program runs once as a program (run_program with a ProgramHost) and once under the tool-mode
host (ToolModeHost, linked by define_spear as a tool call links it), and both runs give the
same results and the same log lines."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import wasmtime

from schemas.limits import RUN_LOG_MAX_BYTES, RUN_LOG_MAX_LINES
from tests.wat_program import OOB, Dump, Program
from worker.guest.fork import ToolModeHost
from worker.guest.host import ChatDefaults, ProgramHost
from worker.guest.hostcalls import HOSTCALLS, Part
from worker.guest.imports import define_spear
from worker.guest.runner import ProgramRun, run_program
from worker.session.tool_logs import ToolLogs
from worker.session.twins.queue import StepQueue
from worker.session.twins.store import MemoryStore

EFAULT, EINVAL = 14, 22
SHA = "0" * 64


@dataclass
class Ran:
    dump: Dump | None  # None: the run ended before its dump
    logs: list[tuple[str, str]]  # (level, message)
    error_code: str | None
    elapsed_s: float


class _Source:
    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module) -> None:
        self.engine, self.module = engine, module

    def compiled(self, sha256: str) -> tuple[wasmtime.Engine, wasmtime.Module]:
        return self.engine, self.module

    def deadline_ticks(self, budget_ms: float) -> int:
        return 1 << 40  # the epoch never moves here: the host's deadline is what ends a run


def _compiled(p: Program | str) -> tuple[wasmtime.Engine, wasmtime.Module]:
    config = wasmtime.Config()
    config.epoch_interruption = True
    engine = wasmtime.Engine(config)
    wat = p if isinstance(p, str) else p.wat()
    return engine, wasmtime.Module(engine, bytes(wasmtime.wat2wasm(wat)))


def as_program(p: Program | str, deadline_s: float = 30.0) -> Ran:
    engine, module = _compiled(p)
    store = MemoryStore()
    defaults = ChatDefaults(
        run_id="shared",
        run_sk="shared#1",
        module_sha256=SHA,
        backend=None,
        model=None,
        deadline=time.monotonic() + deadline_s,
    )
    host = ProgramHost(defaults, store, StepQueue())
    started = time.monotonic()
    outcome = run_program(_Source(engine, module), ProgramRun(module_sha256=SHA), host)
    elapsed = time.monotonic() - started
    dump = Dump(outcome.stdout) if outcome.exit_code == 0 else None
    logs = [(line["level"], line["message"]) for line in host.logs]
    return Ran(dump, logs, outcome.error_code, elapsed)


def as_tool(p: Program, deadline_s: float = 30.0) -> Ran:
    engine, module = _compiled(p)
    host = ToolModeHost(logs=ToolLogs(max_bytes=1 << 20))
    host.deadline = time.monotonic() + deadline_s
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    define_spear(linker, module, host)
    with tempfile.TemporaryDirectory() as tmp:
        stdout = Path(tmp) / "stdout"
        wasi = wasmtime.WasiConfig()
        wasi.stdout_file = str(stdout)
        store = wasmtime.Store(engine)
        store.set_wasi(wasi)
        store.set_epoch_deadline(1 << 40)
        started = time.monotonic()
        start = linker.instantiate(store, module).exports(store)["_start"]
        assert isinstance(start, wasmtime.Func)
        start(store)
        elapsed = time.monotonic() - started
        raw = stdout.read_bytes()
    logs = [(line.level, line.message) for line in host.logs.lines]
    return Ran(Dump(raw), logs, None, elapsed)


def test_the_shared_hostcalls_are_those_tested_here() -> None:
    shared = [h.name for h in HOSTCALLS if h.program == h.tool == Part.SHARED]
    assert shared == ["log", "time_now_ms", "wall_time_s", "random_i64", "sleep_ms"]


def test_each_shared_hostcall_answers_the_same_in_a_program_and_in_a_tool() -> None:
    p = Program()
    hello, bad = p.data("hello log"), p.data(b"\xff ok")
    big = p.data("a" * 16_384)
    logs = [
        p.call("log", 2, hello.ptr, hello.len),
        p.call("log", 4, bad.ptr, bad.len),
        p.call("log", 0, big.ptr, 16_384),
        p.call("log", 1, hello.ptr, 0),
        p.call("log", 1, big.ptr, 16_385),  # over the cap
        p.call("log", 1, hello.ptr, -1),  # a u32 length far over it
        p.call("log", 2, OOB, 5),
        p.call("log", 5, hello.ptr, hello.len),
        p.call("log", -1, hello.ptr, hello.len),
    ]
    before_ms, wall = p.call("time_now_ms"), p.call("wall_time_s")
    randoms = [p.call("random_i64") for _ in range(3)]
    p.call("sleep_ms", 50)
    after_ms = p.call("time_now_ms")
    p.call("sleep_ms", 0)
    p.call("sleep_ms", -5)
    started = time.time()
    runs = [as_program(p), as_tool(p)]
    for ran in runs:
        assert ran.dump is not None and ran.error_code is None
        expected = [0] * 4 + [-EINVAL, -EINVAL, -EFAULT, -EINVAL, -EINVAL]
        assert [ran.dump.result(c) for c in logs] == expected
        assert ran.logs == [
            ("info", "hello log"),
            ("error", "\ufffd ok"),
            ("trace", "a" * 16_384),
            ("debug", ""),
        ]
        assert abs(ran.dump.result(before_ms) - started * 1000) < 5000
        assert abs(ran.dump.result(wall) - started) < 5
        assert ran.dump.result(wall) == ran.dump.result(before_ms) // 1000 or (
            ran.dump.result(wall) == ran.dump.result(before_ms) // 1000 + 1  # a second ticked
        )
        assert len({ran.dump.result(r) for r in randoms}) == 3
        assert ran.dump.result(after_ms) - ran.dump.result(before_ms) >= 50
        assert 0.05 <= ran.elapsed_s < 5
    program, tool = (ran.dump for ran in runs)
    assert runs[0].logs == runs[1].logs
    assert program is not None and tool is not None
    assert [program.result(c) for c in logs] == [tool.result(c) for c in logs]
    assert abs(program.result(before_ms) - tool.result(before_ms)) < 5000


# a program that logs "x" %d times (more calls than a wat_program.Program holds)
LOG_LOOP = """(module
  (import "spear" "log" (func $log (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 1024) "x")
  (func (export "_start") (local $n i32)
    (local.set $n (i32.const %d))
    (loop $again
      (drop (call $log (i32.const 2) (i32.const 1024) (i32.const 1)))
      (local.set $n (i32.sub (local.get $n) (i32.const 1)))
      (br_if $again (local.get $n)))))"""


def test_a_programs_log_keeps_its_bound_of_lines_and_says_how_many_it_dropped() -> None:
    """A program's `log` lines are bounded per run (the record keeps them, in Redis): past
    RUN_LOG_MAX_LINES lines they are only counted, and one last `warn` line says how many."""
    ran = as_program(LOG_LOOP % (RUN_LOG_MAX_LINES + 5))
    assert ran.error_code is None
    assert ran.logs[:-1] == [("info", "x")] * RUN_LOG_MAX_LINES
    level, note = ran.logs[-1]
    assert level == "warn" and note.startswith("5 more line(s) of this run dropped")


def test_a_programs_log_keeps_its_bound_of_bytes() -> None:
    p = Program()
    big, small = p.data("a" * 16_384), p.data("b")
    fitting = RUN_LOG_MAX_BYTES // 16_384
    for _ in range(fitting + 1):
        p.call("log", 2, big.ptr, big.len)
    p.call("log", 2, small.ptr, small.len)  # no room left, however short
    ran = as_program(p)
    assert ran.logs[:-1] == [("info", "a" * 16_384)] * fitting
    assert ran.logs[-1][1].startswith("2 more line(s) of this run dropped")


def test_a_sleep_stops_at_the_deadline_in_both_modes() -> None:
    """The deadline bounds a sleep in both; past it a program's run ends (deadline_exceeded)
    while a tool's sleep returns and its call's epoch deadline ends it (not ticking here)."""
    p = Program()
    p.call("sleep_ms", 20_000)
    program, tool = as_program(p, deadline_s=0.3), as_tool(p, deadline_s=0.3)
    assert (program.dump, program.error_code) == (None, "deadline_exceeded")
    assert tool.dump is not None and tool.error_code is None
    for ran in (program, tool):
        assert 0.25 <= ran.elapsed_s < 2

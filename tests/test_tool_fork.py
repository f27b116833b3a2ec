"""Tools of a WASM agent program run in a fork of the program (docs/guest-abi.md section 4, "Where a
tool runs: fork semantics"), and every tool call sees the tool-mode `spear` host (section 6).
Real wasmtime, modules built from WAT in the test."""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Unpack

import pytest
from wasmtime import Global, Linker, Module, Store, WasiConfig

from tests.test_wasm_runtime import SIG, Limits, Modules
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.errors import (
    GuestError,
    ToolOutputTooLargeError,
    ToolRuntimeError,
    ToolTimeoutError,
)
from worker.guest.fork import ProgramFork, ToolModeHost, restore_fork
from worker.guest.imports import define_spear
from worker.session.ports import ToolCall
from worker.session.tool_logs import ToolLogs

PAGE = 65_536
VALUE_ADDR = 1024  # the program's initial data holds 7 here
TAIL_ADDR = 2 * PAGE + 8  # in the third page: beyond the module's initial 2 pages

# Output helpers shared by the WAT modules: $put appends a signed decimal (space-separated) to
# a temp area at 2048 and returns the new length; $emit copies it out with the ENOSPC rule.
HELPERS_WAT = """
  (func $put (param $pos i32) (param $v i64) (result i32)
    (local $dst i32) (local $t i64) (local $len i32) (local $i i32)
    (if (local.get $pos) (then
      (i32.store8 (i32.add (i32.const 2048) (local.get $pos)) (i32.const 32))
      (local.set $pos (i32.add (local.get $pos) (i32.const 1)))))
    (if (i64.lt_s (local.get $v) (i64.const 0)) (then
      (i32.store8 (i32.add (i32.const 2048) (local.get $pos)) (i32.const 45))
      (local.set $pos (i32.add (local.get $pos) (i32.const 1)))
      (local.set $v (i64.sub (i64.const 0) (local.get $v)))))
    (local.set $dst (i32.add (i32.const 2048) (local.get $pos)))
    (local.set $t (local.get $v)) (local.set $len (i32.const 1))
    (block $b (loop $l
      (br_if $b (i64.lt_u (local.get $t) (i64.const 10)))
      (local.set $t (i64.div_u (local.get $t) (i64.const 10)))
      (local.set $len (i32.add (local.get $len) (i32.const 1)))
      (br $l)))
    (local.set $i (local.get $len))
    (loop $w
      (local.set $i (i32.sub (local.get $i) (i32.const 1)))
      (i32.store8 (i32.add (local.get $dst) (local.get $i))
        (i32.add (i32.const 48) (i32.wrap_i64 (i64.rem_u (local.get $v) (i64.const 10)))))
      (local.set $v (i64.div_u (local.get $v) (i64.const 10)))
      (br_if $w (local.get $i)))
    (i32.add (local.get $pos) (local.get $len)))

  ;; appends " " and the args bytes
  (func $put_args (param $pos i32) (param $a i32) (param $n i32) (result i32)
    (i32.store8 (i32.add (i32.const 2048) (local.get $pos)) (i32.const 32))
    (memory.copy (i32.add (i32.const 2049) (local.get $pos)) (local.get $a) (local.get $n))
    (i32.add (i32.add (local.get $pos) (i32.const 1)) (local.get $n)))

  (func $emit (param $out i32) (param $lenp i32) (param $n i32) (result i32)
    (if (i32.lt_u (i32.load (local.get $lenp)) (local.get $n))
      (then (i32.store (local.get $lenp) (local.get $n)) (return (i32.const -28))))
    (memory.copy (local.get $out) (i32.const 2048) (local.get $n))
    (i32.store (local.get $lenp) (local.get $n))
    (i32.const 0))

  (func $i32 (param $v i32) (result i64) (i64.extend_i32_s (local.get $v)))
"""

# A WASI command "program": it would register $report etc. with cchat_write_fn (table slots).
PROGRAM_WAT = f"""
(module
  (import "spear" "cchat_create" (func $cchat_create (result i32)))
  (import "spear" "cchat_send" (func $cchat_send (param i32 i32) (result i32)))
  (import "spear" "log" (func $log (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 2)
  (table (export "__indirect_function_table") 8 funcref)
  (elem (i32.const 1) $report $scribble $where $try_chat $spin $twice)
  (global $counter (export "counter") (mut i32) (i32.const 7))
  (global $big (export "big") (mut i64) (i64.const 1))
  (global $fixed (export "fixed") i32 (i32.const 3))
  (global $ratio (export "ratio") (mut f64) (f64.const 0.5))
  (data (i32.const {VALUE_ADDR}) "\\07\\00\\00\\00")
  {HELPERS_WAT}

  ;; a fork never runs the program's entry point
  (func (export "_start") unreachable)

  ;; "mem[VALUE_ADDR] counter big memory_pages mem[TAIL_ADDR]" (-1 when there is no 3rd page)
  (func $report {SIG} (local $p i32)
    (local.set $p (call $put (i32.const 0) (i64.extend_i32_u (i32.load (i32.const {VALUE_ADDR})))))
    (local.set $p (call $put (local.get $p) (call $i32 (global.get $counter))))
    (local.set $p (call $put (local.get $p) (global.get $big)))
    (local.set $p (call $put (local.get $p) (call $i32 (memory.size))))
    (local.set $p (call $put (local.get $p)
      (if (result i64) (i32.ge_u (memory.size) (i32.const 3))
        (then (i64.extend_i32_u (i32.load (i32.const {TAIL_ADDR}))))
        (else (i64.const -1)))))
    (call $emit (local.get $out) (local.get $lenp) (local.get $p)))

  ;; changes the memory and the globals, then reports
  (func $scribble {SIG}
    (i32.store (i32.const {VALUE_ADDR}) (i32.const 999))
    (i32.store (i32.const {TAIL_ADDR}) (i32.const 888))
    (global.set $counter (i32.const 1000))
    (global.set $big (i64.const 1000))
    (call $report (local.get $a) (local.get $n) (local.get $out) (local.get $lenp)))

  ;; "args_ptr out_ptr out_len_ptr capacity memory_pages args"
  (func $where {SIG} (local $p i32)
    (local.set $p (call $put (i32.const 0) (call $i32 (local.get $a))))
    (local.set $p (call $put (local.get $p) (call $i32 (local.get $out))))
    (local.set $p (call $put (local.get $p) (call $i32 (local.get $lenp))))
    (local.set $p (call $put (local.get $p) (call $i32 (i32.load (local.get $lenp)))))
    (local.set $p (call $put (local.get $p) (call $i32 (memory.size))))
    (local.set $p (call $put_args (local.get $p) (local.get $a) (local.get $n)))
    (call $emit (local.get $out) (local.get $lenp) (local.get $p)))

  ;; "cchat_create() cchat_send(1000, 2) log(...)"
  (func $try_chat {SIG} (local $p i32)
    (local.set $p (call $put (i32.const 0) (call $i32 (call $cchat_create))))
    (local.set $p (call $put (local.get $p)
      (call $i32 (call $cchat_send (i32.const 1000) (i32.const 2)))))
    (local.set $p (call $put (local.get $p)
      (call $i32 (call $log (i32.const 1) (local.get $a) (local.get $n)))))
    (call $emit (local.get $out) (local.get $lenp) (local.get $p)))

  (func $spin {SIG} (loop $l (br $l)) (i32.const 0))

  ;; the args twice
  (func $twice {SIG} (local $p i32)
    (memory.copy (i32.const 2048) (local.get $a) (local.get $n))
    (memory.copy (i32.add (i32.const 2048) (local.get $n)) (local.get $a) (local.get $n))
    (call $emit (local.get $out) (local.get $lenp) (i32.shl (local.get $n) (i32.const 1))))
)
"""
REPORT, SCRIBBLE, WHERE, TRY_CHAT, SPIN, TWICE = range(1, 7)

# A spec-session tool module that uses the spear imports (tool mode), called by export name.
HOSTCALLS_WAT = f"""
(module
  (import "spear" "cchat_create" (func $cchat_create (result i32)))
  (import "spear" "log" (func $log (param i32 i32 i32) (result i32)))
  (import "spear" "time_now_ms" (func $now (result i64)))
  (import "spear" "wall_time_s" (func $wall (result i64)))
  (import "spear" "random_i64" (func $rand (result i64)))
  (import "spear" "sleep_ms" (func $sleep (param i32)))
  (import "spear" "spear_epoll_create" (func $epoll_create (result i32)))
  (import "spear" "spear_fd_ctl" (func $fd_ctl (param i32 i32 i32 i32) (result i32)))
  (import "spear" "mic_open" (func $mic_open (param i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "hello log")
  {HELPERS_WAT}
  (func $one (param $out i32) (param $lenp i32) (param $v i64) (result i32)
    (call $emit (local.get $out) (local.get $lenp) (call $put (i32.const 0) (local.get $v))))

  (func (export "create") {SIG}
    (call $one (local.get $out) (local.get $lenp) (call $i32 (call $cchat_create))))
  (func (export "log_good") {SIG}
    (call $one (local.get $out) (local.get $lenp)
      (call $i32 (call $log (i32.const 2) (i32.const 64) (i32.const 9)))))
  (func (export "log_long") {SIG}
    (call $one (local.get $out) (local.get $lenp)
      (call $i32 (call $log (i32.const 2) (i32.const 0) (i32.const 20000)))))
  (func (export "log_bad_ptr") {SIG}
    (call $one (local.get $out) (local.get $lenp)
      (call $i32 (call $log (i32.const 2) (i32.const -16) (i32.const 5)))))
  (func (export "now") {SIG}
    (call $emit (local.get $out) (local.get $lenp)
      (call $put (call $put (i32.const 0) (call $now)) (call $wall))))
  (func (export "rand") {SIG}
    (call $emit (local.get $out) (local.get $lenp)
      (call $put (call $put (i32.const 0) (call $rand)) (call $rand))))
  (func (export "sleep") {SIG}
    (call $sleep (i32.load8_u (local.get $a)))  ;; the first args byte, in ms
    (call $one (local.get $out) (local.get $lenp) (i64.const 0)))
  (func (export "sleep_long") {SIG}
    (call $sleep (i32.const 5000))
    (call $one (local.get $out) (local.get $lenp) (i64.const 0)))
  (func (export "fds") {SIG}
    (call $emit (local.get $out) (local.get $lenp)
      (call $put (call $put (i32.const 0) (call $i32 (call $epoll_create)))
        (call $i32 (call $fd_ctl (i32.const 1000) (i32.const 2) (i32.const 0) (i32.const 0))))))
  (func (export "mic") {SIG}
    (call $one (local.get $out) (local.get $lenp) (call $i32 (call $mic_open (i32.const 0)))))
)
"""

FROBNICATE_WAT = f"""
(module
  (import "spear" "frobnicate" (func (result i32)))
  (memory (export "memory") 1)
  (func (export "t") {SIG} (i32.const 0)))
"""

WRONG_LOG_TYPE_WAT = f"""
(module
  (import "spear" "log" (func (param i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "t") {SIG} (i32.const 0)))
"""


def u32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def snapshot(pages: int = 3) -> bytes:
    """A program memory at cchat_send: grown to `pages`, with values the module's initial
    data does not have."""
    mem = bytearray(pages * PAGE)
    mem[VALUE_ADDR : VALUE_ADDR + 4] = u32(4242)
    if pages >= 3:
        mem[TAIL_ADDR : TAIL_ADDR + 4] = u32(31337)
    return bytes(mem)


GLOBALS = {"counter": 77, "big": -5_000_000_000}
FORK_REPORT = "4242 77 -5000000000 {pages} 31337"


@pytest.fixture
def modules() -> Modules:
    return Modules()


# Fork blobs by sha256, as the program store keeps them for the tools worker (put at
# cchat_send): content-addressed, so the tests' runtimes share them.
FORK_BLOBS: dict[str, bytes] = {}


def stored(fork: ProgramFork) -> str:
    """The fork's sha256, which names it in a ToolCall, once its blob is in FORK_BLOBS."""
    blob = fork.to_blob()
    sha = hashlib.sha256(blob).hexdigest()
    FORK_BLOBS[sha] = blob
    return sha


@pytest.fixture
def runtime(tmp_path: Path, modules: Modules) -> Iterator[WasmToolRuntime]:
    rt = WasmToolRuntime(tmp_path / "cache", modules, load_fork_blob=FORK_BLOBS.__getitem__)
    yield rt
    rt.close()


@pytest.fixture
def program(modules: Modules) -> str:
    return modules.add(PROGRAM_WAT)


def fork_call(
    rt: WasmToolRuntime,
    sha: str,
    index: int | None,
    fork: ProgramFork,
    args: bytes = b"{}",
    host: ToolModeHost | None = None,
    **kw: Unpack[Limits],
) -> str:
    return rt.run(ToolCall(sha, None, index, stored(fork), args, **kw), host)


# -- restore -------------------------------------------------------------------------------------


def test_tool_sees_the_snapshot_not_the_initial_state(
    runtime: WasmToolRuntime, program: str
) -> None:
    fork = ProgramFork(snapshot(), dict(GLOBALS))
    # 3 snapshot pages + 1 scratch page; `_start` (unreachable) was not run
    assert fork_call(runtime, program, REPORT, fork) == FORK_REPORT.format(pages=4)


def test_globals_not_in_the_fork_keep_their_initial_value(
    runtime: WasmToolRuntime, program: str
) -> None:
    fork = ProgramFork(snapshot(2), {})
    assert fork_call(runtime, program, REPORT, fork).split()[:3] == ["4242", "7", "1"]


def test_fork_isolation(runtime: WasmToolRuntime, program: str) -> None:
    snap = snapshot()
    fork = ProgramFork(snap, dict(GLOBALS))
    assert fork_call(runtime, program, SCRIBBLE, fork) == "999 1000 1000 4 888"
    assert fork.snapshot == snapshot() and fork.snapshot is snap
    assert fork.globals == GLOBALS
    # the next tool call of the same send sees the send's state again
    assert fork_call(runtime, program, REPORT, fork) == FORK_REPORT.format(pages=4)


def test_restore_fork_alone(modules: Modules) -> None:
    store = Store()
    store.set_wasi(WasiConfig())
    module = Module(store.engine, modules.blobs[modules.add(PROGRAM_WAT)])
    linker = Linker(store.engine)
    linker.define_wasi()
    define_spear(linker, module, ToolModeHost())
    instance = linker.instantiate(store, module)
    memory = restore_fork(store, instance, ProgramFork(snapshot(), dict(GLOBALS)))
    counter, big = instance.exports(store)["counter"], instance.exports(store)["big"]
    assert isinstance(counter, Global) and isinstance(big, Global)
    assert memory.data_len(store) == 3 * PAGE
    assert bytes(memory.read(store, VALUE_ADDR, VALUE_ADDR + 4)) == u32(4242)
    assert bytes(memory.read(store, TAIL_ADDR, TAIL_ADDR + 4)) == u32(31337)
    assert counter.value(store) == 77
    assert big.value(store) == -5_000_000_000


@pytest.mark.parametrize(
    ("fork", "message"),
    [
        (ProgramFork(b"\0" * (PAGE + 1), {}), "not a whole number of pages"),
        (ProgramFork(b"\0" * PAGE, {}), "smaller than the module's memory"),
        (ProgramFork(snapshot(), {"nope": 1}), "fork global 'nope' is not an exported global"),
        (ProgramFork(snapshot(), {"fixed": 1}), "'fixed' is not a mutable i32/i64 global"),
        (ProgramFork(snapshot(), {"ratio": 1}), "'ratio' is not a mutable i32/i64 global"),
    ],
)
def test_fork_that_does_not_fit_the_module(
    runtime: WasmToolRuntime, program: str, fork: ProgramFork, message: str
) -> None:
    with pytest.raises(ToolRuntimeError, match=message):
        fork_call(runtime, program, REPORT, fork)


def test_i32_global_given_unsigned(runtime: WasmToolRuntime, program: str) -> None:
    fork = ProgramFork(snapshot(), {"counter": 0xFFFF_FFFF, "big": (1 << 64) - 2})
    assert fork_call(runtime, program, REPORT, fork) == "4242 -1 -2 4 31337"


def test_snapshot_above_the_memory_limit(runtime: WasmToolRuntime, program: str) -> None:
    fork = ProgramFork(snapshot(8), {})
    with pytest.raises(ToolRuntimeError, match=r"^tool memory limit reached$"):
        fork_call(runtime, program, REPORT, fork, memory_bytes=4 * PAGE)


def test_fork_needs_a_table_index(runtime: WasmToolRuntime, program: str) -> None:
    fork = ProgramFork(snapshot(), {})
    with pytest.raises(ToolRuntimeError, match="needs a table index"):
        runtime.run(ToolCall(program, "report", None, stored(fork), b"{}"))


def test_a_runtime_without_a_fork_loader_runs_no_program_tool(
    tmp_path: Path, modules: Modules, program: str
) -> None:
    rt = WasmToolRuntime(tmp_path / "cache", modules)
    try:
        with pytest.raises(GuestError, match=r"^this runtime cannot load program forks$"):
            fork_call(rt, program, REPORT, ProgramFork(snapshot(), {}))
    finally:
        rt.close()


def test_fork_times_out(runtime: WasmToolRuntime, program: str) -> None:
    with pytest.raises(ToolTimeoutError, match=r"^tool timed out after 200 ms$"):
        fork_call(runtime, program, SPIN, ProgramFork(snapshot(), {}), timeout_ms=200)


# -- buffers -------------------------------------------------------------------------------------


def test_no_arena_uses_scratch_pages_past_the_snapshot(
    runtime: WasmToolRuntime, program: str
) -> None:
    out = fork_call(runtime, program, WHERE, ProgramFork(snapshot(), {}), b'{"q":1}')
    base = 3 * PAGE  # args at the first byte past the snapshot, then 4096 bytes of output
    assert out == f'{base} {base + 8} {base + 8 + 4096} 4096 4 {{"q":1}}'


def test_arena_layout(runtime: WasmToolRuntime, program: str) -> None:
    fork = ProgramFork(snapshot(), {}, arena_ptr=4096, arena_len=1024)
    out = fork_call(runtime, program, WHERE, fork, b'{"q":1}')
    # args at arena_ptr; out_ptr = 4096 + align8(7 + 1); cap = 1024 - 8 - 8; len cell after it
    assert out == '4096 4104 5112 1008 3 {"q":1}'  # memory not grown


def test_arena_capacity_is_capped_by_max_output_bytes(
    runtime: WasmToolRuntime, program: str
) -> None:
    fork = ProgramFork(snapshot(), {}, arena_ptr=4096, arena_len=1024)
    out = fork_call(runtime, program, WHERE, fork, b"abcdefghi", max_output_bytes=100)
    # out_ptr = 4096 + align8(10) = 4112; len cell at 4112 + align8(100)
    assert out == "4096 4112 4216 100 3 abcdefghi"


def test_arena_too_small_for_the_output_retries_in_scratch(
    runtime: WasmToolRuntime, program: str
) -> None:
    fork = ProgramFork(snapshot(), {}, arena_ptr=4096, arena_len=24)  # out_cap 8
    assert fork_call(runtime, program, TWICE, fork, b"abcdefg") == "abcdefgabcdefg"
    with pytest.raises(ToolOutputTooLargeError, match="tool output of 14 bytes exceeds"):
        fork_call(runtime, program, TWICE, fork, b"abcdefg", max_output_bytes=13)


def test_args_that_do_not_fit_the_arena_use_scratch(runtime: WasmToolRuntime, program: str) -> None:
    fork = ProgramFork(snapshot(), {}, arena_ptr=4096, arena_len=16)
    out = fork_call(runtime, program, WHERE, fork, b"0123456789")
    base = 3 * PAGE
    assert out == f"{base} {base + 16} {base + 16 + 4096} 4096 4 0123456789"


@pytest.mark.parametrize(
    ("ptr", "length", "message"),
    [
        (3 * PAGE - 16, 64, "tool arena outside memory"),
        (3 * PAGE, 8, "tool arena outside memory"),
        (-8, 64, "tool arena outside memory"),
        (4096, -1, "tool arena outside memory"),
        (3 * PAGE - 17, 17, "tool arena outside memory"),  # SPEAR's cell would pass the end
        (4096, None, "needs both tool_arena_ptr and tool_arena_len"),
    ],
)
def test_bad_arena(
    runtime: WasmToolRuntime, program: str, ptr: int, length: int | None, message: str
) -> None:
    fork = ProgramFork(snapshot(), {}, arena_ptr=ptr, arena_len=length)
    with pytest.raises(ToolRuntimeError, match=message):
        fork_call(runtime, program, WHERE, fork, b"x")


# -- tool-mode hostcalls -------------------------------------------------------------------------


@pytest.fixture
def hostcalls(modules: Modules) -> str:
    return modules.add(HOSTCALLS_WAT)


def call(
    rt: WasmToolRuntime,
    sha: str,
    export: str,
    args: bytes = b"{}",
    host: ToolModeHost | None = None,
    **kw: Unpack[Limits],
) -> str:
    return rt.run(ToolCall(sha, export, None, None, args, **kw), host)


def test_chat_and_fd_hostcalls_are_eperm(runtime: WasmToolRuntime, hostcalls: str) -> None:
    assert call(runtime, hostcalls, "create") == "-1"
    assert call(runtime, hostcalls, "fds") == "-1 -1"


def logged(host: ToolModeHost) -> list[tuple[str, str]]:
    return [(line.level, line.message) for line in host.logs.lines]


def test_chat_hostcalls_are_eperm_in_a_fork_and_log_works(
    runtime: WasmToolRuntime, program: str
) -> None:
    host = ToolModeHost()
    out = fork_call(runtime, program, TRY_CHAT, ProgramFork(snapshot(), {}), b"from a fork", host)
    assert out == "-1 -1 0"
    assert logged(host) == [("debug", "from a fork")]


def test_log(runtime: WasmToolRuntime, hostcalls: str, capfd: pytest.CaptureFixture[str]) -> None:
    host = ToolModeHost()
    assert call(runtime, hostcalls, "log_good", host=host) == "0"
    assert call(runtime, hostcalls, "log_long", host=host) == "-22"
    assert call(runtime, hostcalls, "log_bad_ptr", host=host) == "-14"
    assert logged(host) == [("info", "hello log")]
    out, err = capfd.readouterr()
    assert "hello log" not in out + err


def test_log_lines_are_capped(runtime: WasmToolRuntime, hostcalls: str) -> None:
    host = ToolModeHost(logs=ToolLogs(max_bytes=12))
    for _ in range(3):
        assert call(runtime, hostcalls, "log_good", host=host) == "0"
    assert logged(host) == [("info", "hello log")]
    assert host.logs.dropped == 2


def test_time_and_random(runtime: WasmToolRuntime, hostcalls: str) -> None:
    now_ms, wall_s = map(int, call(runtime, hostcalls, "now").split())
    assert abs(now_ms - time.time() * 1000) < 1000
    assert abs(wall_s - time.time()) <= 1
    a, b = map(int, call(runtime, hostcalls, "rand").split())
    assert a != b
    assert all(-(1 << 63) <= v < 1 << 63 for v in (a, b))


def test_sleep(runtime: WasmToolRuntime, hostcalls: str) -> None:
    start = time.monotonic()
    assert call(runtime, hostcalls, "sleep", b"\x32") == "0"  # 50 ms
    assert time.monotonic() - start >= 0.05


def test_sleep_is_bounded_by_the_deadline(runtime: WasmToolRuntime, hostcalls: str) -> None:
    start = time.monotonic()
    try:  # the tool may or may not reach its next epoch check after the deadline
        call(runtime, hostcalls, "sleep_long", timeout_ms=300)
    except ToolTimeoutError as exc:
        assert exc.message == "tool timed out after 300 ms"
    assert time.monotonic() - start < 2.0


def test_unserved_imports_are_enosys(runtime: WasmToolRuntime, hostcalls: str) -> None:
    assert call(runtime, hostcalls, "mic") == "-38"


def test_unknown_spear_import_names_it(runtime: WasmToolRuntime, modules: Modules) -> None:
    with pytest.raises(GuestError, match=r"spear::frobnicate"):
        call(runtime, modules.add(FROBNICATE_WAT), "t")


def test_known_spear_import_with_the_wrong_type(runtime: WasmToolRuntime, modules: Modules) -> None:
    with pytest.raises(GuestError, match=r"spear::log has the wrong type"):
        call(runtime, modules.add(WRONG_LOG_TYPE_WAT), "t")


# -- blob ----------------------------------------------------------------------------------------


def two_mib_memory() -> bytes:
    mem = bytearray(32 * PAGE)
    mem[1024:9216] = os.urandom(8192)  # some heap with high entropy
    mem[40_000:41_000] = b"tool json " * 100
    mem[VALUE_ADDR : VALUE_ADDR + 4] = u32(4242)
    return bytes(mem)


def test_blob_round_trip() -> None:
    fork = ProgramFork(two_mib_memory(), dict(GLOBALS), arena_ptr=4096, arena_len=1024)
    blob = fork.to_blob()
    assert ProgramFork.from_blob(blob) == fork
    assert ProgramFork.from_blob(bytearray(blob)) == fork
    assert fork.to_blob() == blob  # deterministic: the program side stores it by its sha
    assert len(blob) < 40_000
    bare = ProgramFork(b"", {})
    assert ProgramFork.from_blob(bare.to_blob()) == bare


def test_blob_fork_runs(runtime: WasmToolRuntime, program: str) -> None:
    blob = ProgramFork(snapshot(), dict(GLOBALS)).to_blob()
    fork = ProgramFork.from_blob(blob)
    assert fork_call(runtime, program, REPORT, fork) == FORK_REPORT.format(pages=4)


def _with_header(header: bytes, body: bytes) -> bytes:
    return b"CQF1" + len(header).to_bytes(4, "little") + header + body


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"CQF", "truncated"),
        (b"XXXX" + bytes(4), "bad header"),
        (_with_header(b"{not json", b""), "bad header"),
        (_with_header(b'{"size":-1,"globals":{}}', b""), "bad header"),
        (_with_header(b'{"size":1,"globals":{"g":"x"}}', b""), "bad header"),
        (_with_header(b'{"size":1,"globals":{},"arena_ptr":true}', b""), "bad header"),
        (_with_header(b'{"size":8,"globals":{}}', zlib.compress(bytes(9), 1)), "corrupt"),
        (_with_header(b'{"size":9,"globals":{}}', zlib.compress(bytes(8), 1)), "corrupt"),
        (_with_header(b'{"size":8,"globals":{}}', zlib.compress(bytes(8))[:-3]), "corrupt"),
        (_with_header(b'{"size":8,"globals":{}}', zlib.compress(bytes(8)) + b"x"), "corrupt"),
        (_with_header(b'{"size":8,"globals":{}}', b"not zlib"), "corrupt"),
    ],
)
def test_damaged_blob(blob: bytes, message: str) -> None:
    with pytest.raises(ToolRuntimeError, match=message):
        ProgramFork.from_blob(blob)


def test_a_tool_may_not_start_chats_touch_fds_or_talk_to_the_programs_user() -> None:
    from worker.guest.fork import ToolModeHost

    host = ToolModeHost()
    for name in ("cchat_create", "spear_fd_ctl", "spear_epoll_create", "user_stream_open",
                 "user_stream_write"):  # fmt: skip
        # -EPERM, before the memory is looked at
        assert host.hostcall(name, None, ()) == -1  # type: ignore[arg-type]

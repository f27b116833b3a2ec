"""WasmToolRuntime against real wasmtime, with tool modules built from WAT in the test."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict, Unpack

import pytest
from wasmtime import Instance, Store, wat2wasm

from worker.edges.wasm_modules import WASMTIME_VERSION
from worker.edges.wasm_runtime import WasmToolRuntime
from worker.errors import (
    GuestError,
    ToolOutputTooLargeError,
    ToolRuntimeError,
    ToolTimeoutError,
)
from worker.guest.imports import GuestMemory
from worker.guest.memory import as_i32, plan_arena, plan_scratch
from worker.guest.runner import ProgramRun, run_program
from worker.session.ports import ToolCall
from worker.session.tool_logs import ToolLogLine, ToolLogs

GUESTS = Path(__file__).resolve().parents[1] / "fixtures" / "guests"

# Tool signature: (args_ptr, args_len, out_ptr, out_len_ptr) -> rc
SIG = "(param $a i32) (param $n i32) (param $out i32) (param $lenp i32) (result i32)"

TOOLS_WAT = f"""
(module
  (memory (export "memory") 1)
  (table (export "__indirect_function_table") 4 funcref)
  (elem (i32.const 1) $echo $wrong_sig)

  ;; copies the args to the output; -ENOSPC with the needed length when the buffer is small
  (func $echo (export "echo") {SIG}
    (if (i32.lt_u (i32.load (local.get $lenp)) (local.get $n))
      (then (i32.store (local.get $lenp) (local.get $n)) (return (i32.const -28))))
    (memory.copy (local.get $out) (local.get $a) (local.get $n))
    (i32.store (local.get $lenp) (local.get $n))
    (i32.const 0))

  ;; like echo, but also copies the byte after the args (the host's NUL)
  (func (export "echo_nul") {SIG}
    (local.set $n (i32.add (local.get $n) (i32.const 1)))
    (memory.copy (local.get $out) (local.get $a) (local.get $n))
    (i32.store (local.get $lenp) (local.get $n))
    (i32.const 0))

  ;; always asks for one byte more than it was given
  (func (export "greedy") {SIG}
    (i32.store (local.get $lenp) (i32.add (i32.load (local.get $lenp)) (i32.const 1)))
    (i32.const -28))

  (func (export "rc5") {SIG} (i32.const -5))
  (func (export "boom") {SIG} unreachable)
  (func (export "spin") {SIG} (loop $l (br $l)) (i32.const 0))

  (func (export "bad_utf8") {SIG}
    (i32.store8 (local.get $out) (i32.const 0xff))
    (i32.store (local.get $lenp) (i32.const 1))
    (i32.const 0))

  (func (export "overlong") {SIG}
    (i32.store (local.get $lenp) (i32.add (i32.load (local.get $lenp)) (i32.const 1)))
    (i32.const 0))

  ;; grows memory until refused, then reports -ENOMEM
  (func (export "hog") {SIG}
    (block $done
      (loop $l
        (br_if $done (i32.eq (memory.grow (i32.const 16)) (i32.const -1)))
        (br $l)))
    (i32.const -12))

  (func $wrong_sig (export "wrong_sig") (param i32) (result i32) (local.get 0))
)
"""

# Writes "a b c ..." (decimal) into the output buffer.
ITOA_WAT = """
  (func $itoa (param $v i32) (param $dst i32) (result i32)
    (local $len i32) (local $t i32) (local $i i32)
    (local.set $t (local.get $v)) (local.set $len (i32.const 1))
    (block $b (loop $l
      (br_if $b (i32.lt_u (local.get $t) (i32.const 10)))
      (local.set $t (i32.div_u (local.get $t) (i32.const 10)))
      (local.set $len (i32.add (local.get $len) (i32.const 1)))
      (br $l)))
    (local.set $i (local.get $len))
    (loop $w
      (local.set $i (i32.sub (local.get $i) (i32.const 1)))
      (i32.store8 (i32.add (local.get $dst) (local.get $i))
                  (i32.add (i32.const 48) (i32.rem_u (local.get $v) (i32.const 10))))
      (local.set $v (i32.div_u (local.get $v) (i32.const 10)))
      (br_if $w (local.get $i)))
    (local.get $len))
  ;; appends " v" (or "v" at the start) at out+pos, returns the new pos
  (func $put (param $out i32) (param $pos i32) (param $v i32) (result i32)
    (if (local.get $pos) (then
      (i32.store8 (i32.add (local.get $out) (local.get $pos)) (i32.const 32))
      (local.set $pos (i32.add (local.get $pos) (i32.const 1)))))
    (i32.add (local.get $pos)
             (call $itoa (local.get $v) (i32.add (local.get $out) (local.get $pos)))))
"""

WASI_WAT = f"""
(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_sizes_get"
    (func $environ_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_sizes_get"
    (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_prestat_get"
    (func $fd_prestat_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "hello from the tool\\n")
  (data (i32.const 128) "etc/passwd")
  {ITOA_WAT}

  ;; output: "errno nwritten" of fd_write(1, "hello from the tool\\n")
  (func (export "say") {SIG} (local $p i32)
    (i32.store (i32.const 0) (i32.const 64))
    (i32.store (i32.const 4) (i32.const 20))
    (local.set $p (call $put (local.get $out) (i32.const 0)
      (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
    (local.set $p (call $put (local.get $out) (local.get $p) (i32.load (i32.const 8))))
    (i32.store (local.get $lenp) (local.get $p))
    (i32.const 0))

  ;; output: "errno env_count env_bytes errno argc argv_bytes"
  (func (export "env") {SIG} (local $p i32)
    (local.set $p (call $put (local.get $out) (i32.const 0)
      (call $environ_sizes_get (i32.const 16) (i32.const 20))))
    (local.set $p (call $put (local.get $out) (local.get $p) (i32.load (i32.const 16))))
    (local.set $p (call $put (local.get $out) (local.get $p) (i32.load (i32.const 20))))
    (local.set $p (call $put (local.get $out) (local.get $p)
      (call $args_sizes_get (i32.const 16) (i32.const 20))))
    (local.set $p (call $put (local.get $out) (local.get $p) (i32.load (i32.const 16))))
    (local.set $p (call $put (local.get $out) (local.get $p) (i32.load (i32.const 20))))
    (i32.store (local.get $lenp) (local.get $p))
    (i32.const 0))

  ;; output: "prestat_errno path_open_errno" for fd 3, the first preopen if there were one
  (func (export "files") {SIG} (local $p i32)
    (local.set $p (call $put (local.get $out) (i32.const 0)
      (call $fd_prestat_get (i32.const 3) (i32.const 32))))
    (local.set $p (call $put (local.get $out) (local.get $p)
      (call $path_open (i32.const 3) (i32.const 0) (i32.const 128) (i32.const 10)
                       (i32.const 0) (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 24))))
    (i32.store (local.get $lenp) (local.get $p))
    (i32.const 0))

  ;; rights that do not fit WASI's type: wasmtime aborts the call with a host error
  (func (export "bad_rights") {SIG}
    (drop (call $path_open (i32.const 3) (i32.const 0) (i32.const 128) (i32.const 10)
      (i32.const 0) (i64.const -1) (i64.const -1) (i32.const 0) (i32.const 24)))
    (i32.const 0))

  (func (export "quit") {SIG} (call $proc_exit (i32.const 3)) (i32.const 0))
)
"""

REACTOR_WAT = f"""
(module
  (memory (export "memory") 1)
  (global $inits (mut i32) (i32.const 0))
  {ITOA_WAT}
  (func (export "_initialize") (global.set $inits (i32.add (global.get $inits) (i32.const 1))))
  (func (export "_start") unreachable)
  (func (export "inits") {SIG}
    (i32.store (local.get $lenp) (call $put (local.get $out) (i32.const 0) (global.get $inits)))
    (i32.const 0))
)
"""

UNKNOWN_IMPORT_WAT = f"""
(module
  (import "env" "mystery" (func (param i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "t") {SIG} (i32.const 0))
)
"""

SPEAR_REACTOR_WAT = f"""
(module
  (import "spear" "log" (func $log (param i32 i32 i32) (result i32)))
  (import "spear" "cchat_create" (func $cchat_create (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "ready")
  (global $inits (mut i32) (i32.const 0))
  (func (export "_initialize")
    (drop (call $log (i32.const 1) (i32.const 64) (i32.const 5)))
    (global.set $inits (i32.add (global.get $inits) (i32.const 1))))
  ;; logs its args; output: "inits" and then 1 if cchat_create gave -EPERM
  (func (export "t") {SIG}
    (drop (call $log (i32.const 2) (local.get $a) (local.get $n)))
    (i32.store8 (local.get $out) (i32.add (i32.const 48) (global.get $inits)))
    (i32.store8 (i32.add (local.get $out) (i32.const 1))
      (i32.add (i32.const 48) (i32.eq (call $cchat_create) (i32.const -1))))
    (i32.store (local.get $lenp) (i32.const 2))
    (i32.const 0))
)
"""

BIG_MEMORY_WAT = f'(module (memory (export "memory") 100) (func (export "t") {SIG} (i32.const 0)))'


class Modules:
    """A content-addressed module store that counts loads."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.loads: Counter[str] = Counter()

    def add_bytes(self, blob: bytes) -> str:
        sha = hashlib.sha256(blob).hexdigest()
        self.blobs[sha] = blob
        return sha

    def add(self, wat: str) -> str:
        return self.add_bytes(bytes(wat2wasm(wat)))

    def __call__(self, sha: str) -> bytes:
        self.loads[sha] += 1
        return self.blobs[sha]


@pytest.fixture
def modules() -> Modules:
    return Modules()


@pytest.fixture
def runtime(tmp_path: Path, modules: Modules) -> Iterator[WasmToolRuntime]:
    rt = WasmToolRuntime(tmp_path / "cache", modules, initial_output_bytes=16)
    yield rt
    rt.close()


@pytest.fixture
def tools(modules: Modules) -> str:
    return modules.add(TOOLS_WAT)


class Limits(TypedDict, total=False):
    """The per-call limits of a `ToolCall`, as keyword arguments."""

    timeout_ms: int
    memory_bytes: int
    max_output_bytes: int


def call(
    rt: WasmToolRuntime, sha: str, export: str | None, args: bytes = b"{}", **kw: Unpack[Limits]
) -> str:
    return rt.run(ToolCall(sha, export, None, None, args, **kw))


# -- calling ------------------------------------------------------------------------------------


def test_call_by_export_name(runtime: WasmToolRuntime, tools: str) -> None:
    assert call(runtime, tools, "echo", b'{"city":"Paris"}') == '{"city":"Paris"}'


def test_args_are_followed_by_a_nul(runtime: WasmToolRuntime, tools: str) -> None:
    assert call(runtime, tools, "echo_nul", b'{"a":1}') == '{"a":1}\x00'


def test_call_by_table_index(runtime: WasmToolRuntime, tools: str) -> None:
    tool_call = ToolCall(tools, None, 1, None, b'{"x":"y"}')
    assert runtime.run(tool_call) == '{"x":"y"}'


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (0, "table index 0 is not a function"),
        (2, "table index 2 has type (i32) -> (i32)"),
        (99, "table index 99 is out of bounds (table size 4)"),
    ],
)
def test_bad_table_slots(runtime: WasmToolRuntime, tools: str, index: int, message: str) -> None:
    with pytest.raises(ToolRuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runtime.run(ToolCall(tools, None, index, None, b"{}"))


def test_missing_export_and_non_function_export(runtime: WasmToolRuntime, tools: str) -> None:
    with pytest.raises(ToolRuntimeError, match="module has no export 'nope'"):
        call(runtime, tools, "nope")
    with pytest.raises(ToolRuntimeError, match="export 'memory' is not a function"):
        call(runtime, tools, "memory")
    with pytest.raises(ToolRuntimeError, match="export 'wrong_sig' has type"):
        call(runtime, tools, "wrong_sig")


def test_export_wins_over_table_index_and_neither_is_an_error(
    runtime: WasmToolRuntime, tools: str
) -> None:
    assert runtime.run(ToolCall(tools, "echo", 2, None, b"by name")) == "by name"
    with pytest.raises(ToolRuntimeError, match="neither an export nor a table index"):
        runtime.run(ToolCall(tools, None, None, None, b"{}"))


def test_non_positive_limits_fail_closed(runtime: WasmToolRuntime, tools: str) -> None:
    with pytest.raises(ToolRuntimeError, match="tool memory limit reached"):
        call(runtime, tools, "echo", memory_bytes=-1)  # never "no limit"
    with pytest.raises(ToolOutputTooLargeError, match="exceeds max_tool_output_bytes -1"):
        call(runtime, tools, "echo", b"x", max_output_bytes=-1)
    with pytest.raises(ToolTimeoutError, match="timed out"):
        call(runtime, tools, "spin", timeout_ms=0)


# -- output buffer ------------------------------------------------------------------------------


def test_enospc_retry_gets_the_needed_buffer(runtime: WasmToolRuntime, tools: str) -> None:
    args = b'{"text":"' + b"x" * 5000 + b'"}'  # far over initial_output_bytes=16
    assert call(runtime, tools, "echo", args) == args.decode()


def test_enospc_beyond_max_output_bytes(runtime: WasmToolRuntime, tools: str) -> None:
    args = b"y" * 100
    with pytest.raises(ToolOutputTooLargeError) as info:
        call(runtime, tools, "echo", args, max_output_bytes=64)
    assert info.value.message == "tool output of 100 bytes exceeds max_tool_output_bytes 64"


def test_enospc_is_retried_only_once(runtime: WasmToolRuntime, tools: str) -> None:
    with pytest.raises(ToolRuntimeError, match=r"^tool rc: -28$"):
        call(runtime, tools, "greedy")


def test_other_negative_rc(runtime: WasmToolRuntime, tools: str) -> None:
    with pytest.raises(ToolRuntimeError) as info:
        call(runtime, tools, "rc5")
    assert info.value.message == "tool rc: -5"
    assert info.value.code == "RUNTIME_ERROR"


def test_invalid_utf8_output(runtime: WasmToolRuntime, tools: str) -> None:
    with pytest.raises(ToolRuntimeError, match="tool output is not valid UTF-8"):
        call(runtime, tools, "bad_utf8")


def test_length_beyond_buffer(runtime: WasmToolRuntime, tools: str) -> None:
    with pytest.raises(ToolRuntimeError, match="tool wrote a length beyond its buffer"):
        call(runtime, tools, "overlong")


# -- traps, time and memory ---------------------------------------------------------------------


def test_trap(runtime: WasmToolRuntime, tools: str) -> None:
    with pytest.raises(ToolRuntimeError) as info:
        call(runtime, tools, "boom")
    assert info.value.message == "tool trapped: wasm trap: wasm `unreachable` instruction executed"


def test_infinite_loop_times_out_and_runtime_still_serves(
    runtime: WasmToolRuntime, tools: str
) -> None:
    start = time.monotonic()
    with pytest.raises(ToolTimeoutError, match=r"^tool timed out after 200 ms$"):
        call(runtime, tools, "spin", timeout_ms=200)
    elapsed = time.monotonic() - start
    assert 0.19 < elapsed < 2.0
    assert call(runtime, tools, "echo", b"again") == "again"


def test_guest_memory_growth_is_capped(runtime: WasmToolRuntime, tools: str) -> None:
    # memory.grow returns -1 at the store limit; the tool then reports -ENOMEM
    with pytest.raises(ToolRuntimeError, match=r"^tool rc: -12$"):
        call(runtime, tools, "hog", memory_bytes=8 << 20)


def test_host_scratch_growth_refused(runtime: WasmToolRuntime, tools: str) -> None:
    # one page of module memory fills the limit: no room for the args and output pages
    with pytest.raises(ToolRuntimeError, match=r"^tool memory limit reached$"):
        call(runtime, tools, "echo", memory_bytes=65_536)


def test_module_memory_above_limit(runtime: WasmToolRuntime, modules: Modules) -> None:
    sha = modules.add(BIG_MEMORY_WAT)  # 100 pages = 6.25 MiB
    with pytest.raises(ToolRuntimeError, match=r"^tool memory limit reached$"):
        call(runtime, sha, "t", memory_bytes=1 << 20)


# -- module loading and linking -----------------------------------------------------------------


def test_initialize_runs_once_per_instance_and_start_never(
    runtime: WasmToolRuntime, modules: Modules
) -> None:
    sha = modules.add(REACTOR_WAT)
    assert call(runtime, sha, "inits") == "1"
    assert call(runtime, sha, "inits") == "1"  # a fresh instance each call


def test_spec_session_tool_gets_the_tool_mode_spear_imports(
    runtime: WasmToolRuntime, modules: Modules
) -> None:
    sha = modules.add(SPEAR_REACTOR_WAT)
    logs = ToolLogs()
    assert runtime.run(ToolCall(sha, "t", None, None, b'{"k":1}', logs=logs)) == "11"
    assert logs.lines == [  # _initialize ran, in tool mode too
        ToolLogLine("debug", "ready", "log"),
        ToolLogLine("info", '{"k":1}', "log"),
    ]


# the tool ABI's own imports (module cchatq): output, one char a call, chr(64 - rc)
CCHATQ_PROBE_WAT = f"""
(module
  (import "cchatq" "attempt" (func $attempt (result i32)))
  (import "cchatq" "progress" (func $progress (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "halfway")
  (func $put (param $out i32) (param $k i32) (param $rc i32)
    (i32.store8 (i32.add (local.get $out) (local.get $k)) (i32.sub (i32.const 64) (local.get $rc))))
  (func (export "t") {SIG}
    (call $put (local.get $out) (i32.const 0) (call $attempt))
    (call $put (local.get $out) (i32.const 1)
      (call $progress (i32.const 50) (i32.const 64) (i32.const 7)))
    (call $put (local.get $out) (i32.const 2)  ;; a message outside the memory
      (call $progress (i32.const 60) (i32.const 0x7fff0000) (i32.const 4)))
    (call $put (local.get $out) (i32.const 3)  ;; one at the top of the address space
      (call $progress (i32.const 60) (i32.const -16) (i32.const 32)))
    (call $put (local.get $out) (i32.const 4)
      (call $progress (i32.const 101) (i32.const 64) (i32.const 7)))
    (call $put (local.get $out) (i32.const 5)
      (call $progress (i32.const 70) (i32.const 64) (i32.const -1)))
    (i32.store (local.get $lenp) (i32.const 6))
    (i32.const 0))
)
"""


class Heard:
    """A background call's watcher that keeps what it hears."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, str]] = []

    def progress(self, percent: int, message: str) -> None:
        self.reports.append((percent, message))

    def check(self) -> None:
        pass


def test_the_tool_abis_own_hostcalls_return_efault_for_a_bad_pointer(
    runtime: WasmToolRuntime, modules: Modules
) -> None:
    """`cchatq.progress` given a message outside the guest's memory returns -EFAULT, as every
    hostcall does (docs/guest-abi.md), and never traps the call; a percent outside 0..100 or
    a negative length is -EINVAL. Only the good report reaches the watcher."""
    sha = modules.add(CCHATQ_PROBE_WAT)
    heard = Heard()
    out = runtime.run(ToolCall(sha, "t", None, None, b"{}", attempt=2, watcher=heard))
    assert out == "".join(chr(64 - rc) for rc in (2, 0, -14, -14, -22, -22))  # ">@NNVV"
    assert heard.reports == [(50, "halfway")]


def test_sha_mismatch(runtime: WasmToolRuntime, modules: Modules, tools: str) -> None:
    modules.blobs[tools] = bytes(wat2wasm(REACTOR_WAT))
    with pytest.raises(GuestError, match="do not match sha256"):
        call(runtime, tools, "echo")


def test_invalid_sha_and_non_wasm_bytes(runtime: WasmToolRuntime, modules: Modules) -> None:
    with pytest.raises(GuestError, match="invalid module sha256"):
        call(runtime, "../../etc/passwd", "echo")
    sha = modules.add_bytes(b"(module)")  # WAT text is not a module binary
    with pytest.raises(GuestError, match="not a WebAssembly binary"):
        call(runtime, sha, "echo")
    sha = modules.add_bytes(b"\x00asm\x01\x00\x00\x00garbage")
    with pytest.raises(GuestError, match="does not compile"):
        call(runtime, sha, "echo")


def test_unknown_import_names_it(runtime: WasmToolRuntime, modules: Modules) -> None:
    sha = modules.add(UNKNOWN_IMPORT_WAT)
    with pytest.raises(GuestError, match="env::mystery"):
        call(runtime, sha, "t")


def test_disk_cache_is_used_by_a_second_runtime(
    tmp_path: Path, modules: Modules, tools: str
) -> None:
    cache = tmp_path / "cache"
    first = WasmToolRuntime(cache, modules)
    try:
        assert call(first, tools, "echo", b"one") == "one"
        assert call(first, tools, "echo", b"two") == "two"  # in-process cache
    finally:
        first.close()
    assert modules.loads[tools] == 1
    cwasm = cache / f"{tools}-wasmtime-{WASMTIME_VERSION}.cwasm"
    assert cwasm.is_file()
    assert [p.name for p in cache.iterdir()] == [cwasm.name]  # no temp file left behind

    second = WasmToolRuntime(cache, modules)
    try:
        assert call(second, tools, "echo", b"three") == "three"
    finally:
        second.close()
    assert modules.loads[tools] == 1  # loaded from the .cwasm file


def test_corrupt_cache_file_is_replaced(tmp_path: Path, modules: Modules, tools: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cwasm = cache / f"{tools}-wasmtime-{WASMTIME_VERSION}.cwasm"
    cwasm.write_bytes(b"\x7fELF not really")
    rt = WasmToolRuntime(cache, modules)
    try:
        assert call(rt, tools, "echo", b"ok") == "ok"
    finally:
        rt.close()
    assert modules.loads[tools] == 1
    assert cwasm.read_bytes() != b"\x7fELF not really"


# -- WASI with nothing granted -------------------------------------------------------------------


def test_wasi_stdout_goes_nowhere(
    runtime: WasmToolRuntime, modules: Modules, capfd: pytest.CaptureFixture[str]
) -> None:
    sha = modules.add(WASI_WAT)
    assert call(runtime, sha, "say") == "0 20"  # the write "succeeds"
    out, err = capfd.readouterr()
    assert "hello from the tool" not in out + err


def test_wasi_grants_no_environment_args_or_files(
    runtime: WasmToolRuntime, modules: Modules
) -> None:
    sha = modules.add(WASI_WAT)
    assert call(runtime, sha, "env") == "0 0 0 0 0 0"
    assert call(runtime, sha, "files") == "8 8"  # WASI errno 8 = EBADF: no preopened fd 3


def test_wasi_host_error_is_a_tool_failure(runtime: WasmToolRuntime, modules: Modules) -> None:
    sha = modules.add(WASI_WAT)
    with pytest.raises(
        ToolRuntimeError, match=r"^tool trapped: In func wasi_snapshot_preview1::path_open"
    ):
        call(runtime, sha, "bad_rights")


def test_proc_exit_is_a_tool_failure(runtime: WasmToolRuntime, modules: Modules) -> None:
    sha = modules.add(WASI_WAT)
    with pytest.raises(ToolRuntimeError, match=r"^tool called proc_exit\(3\)$"):
        call(runtime, sha, "quit")


# -- engine lifecycle ---------------------------------------------------------------------------


def _tickers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "wasm-epoch-ticker"}


def test_close_stops_the_ticker(tmp_path: Path, modules: Modules, tools: str) -> None:
    before = _tickers()
    rt = WasmToolRuntime(tmp_path / "cache", modules)
    call(rt, tools, "echo")
    started = _tickers() - before
    assert len(started) == 1
    rt.close()
    assert not any(t.is_alive() for t in started)
    assert call(rt, tools, "echo", b"reopened") == "reopened"  # lazily restarted
    rt.close()


def test_a_program_module_after_close_is_of_the_new_engine(
    tmp_path: Path, modules: Modules, tools: str
) -> None:
    rt = WasmToolRuntime(tmp_path / "cache", modules)
    _, first = rt.compiled(tools)
    rt.close()
    try:
        engine, module = rt.compiled(tools)
        assert module is not first
        Instance(Store(engine), module, [])  # a module of the old engine would not instantiate
    finally:
        rt.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_working_engine(runtime: WasmToolRuntime, tools: str) -> None:
    assert call(runtime, tools, "echo", b"parent") == "parent"  # engine + ticker exist now
    pid = os.fork()
    if pid == 0:  # child: the parent's ticker thread is gone, so a timeout needs a new one
        signal.alarm(10)
        try:
            with pytest.raises(ToolTimeoutError, match="timed out"):
                call(runtime, tools, "spin", timeout_ms=100)
            ok = call(runtime, tools, "echo", b"child") == "child"
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- scratch layout (pure) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "args_len", "cap", "expected"),
    [
        (65_536, 0, 0, (65_536, 65_544, 65_544, 1)),
        (65_536, 7, 16, (65_536, 65_544, 65_560, 1)),
        (65_536, 8, 13, (65_536, 65_552, 65_568, 1)),
        (0, 65_530, 4096, (0, 65_536, 69_632, 2)),
        (131_072, 10, 65_536 - 16, (131_072, 131_088, 196_608, 2)),
    ],
)
def test_plan_scratch(
    base: int, args_len: int, cap: int, expected: tuple[int, int, int, int]
) -> None:
    layout = plan_scratch(base, args_len, cap)
    assert (layout.args_ptr, layout.out_ptr, layout.len_ptr, layout.grow_pages) == expected
    assert layout.out_ptr % 8 == 0 and layout.len_ptr % 8 == 0


@pytest.mark.parametrize(
    ("arena", "args_len", "max_out", "expected"),
    [
        ((4096, 1024), 7, 65_536, (4096, 4104, 1008, 5112)),
        ((4096, 1024), 8, 100, (4096, 4112, 100, 4216)),
        ((4100, 64), 0, 65_536, (4100, 4108, 48, 4156)),  # SPEAR aligns relative to the arena
        ((4096, 16), 9, 65_536, None),  # args + NUL + cell do not fit: scratch pages instead
    ],
)
def test_plan_arena(
    arena: tuple[int, int],
    args_len: int,
    max_out: int,
    expected: tuple[int, int, int, int] | None,
) -> None:
    buf = plan_arena(*arena, args_len, max_out, 65_536)
    got = None if buf is None else (buf.args_ptr, buf.out_ptr, buf.cap, buf.len_ptr)
    assert got == expected


@pytest.mark.parametrize("arena", [(65_000, 600), (-8, 64), (0, -1), (65_519, 17)])
def test_plan_arena_outside_memory(arena: tuple[int, int]) -> None:
    with pytest.raises(ToolRuntimeError, match=r"^tool arena outside memory$"):
        plan_arena(*arena, 1, 65_536, 65_536)


def test_as_i32_wraps_high_addresses() -> None:
    assert as_i32(5) == 5
    assert as_i32(0x8000_0000) == -(1 << 31)
    assert as_i32(0xFFFF_FFFF) == -1


# -- the C fixtures (fixtures/guests/*.wasm, built by their Makefile) ---------------------------


@pytest.fixture
def c_runtime(tmp_path: Path, modules: Modules) -> Iterator[WasmToolRuntime]:
    rt = WasmToolRuntime(tmp_path / "cache", modules)  # default initial_output_bytes=4096
    yield rt
    rt.close()


def c_tool(modules: Modules, name: str) -> str:
    return modules.add_bytes((GUESTS / f"{name}.wasm").read_bytes())


def test_c_weather(c_runtime: WasmToolRuntime, modules: Modules) -> None:
    out = call(c_runtime, c_tool(modules, "weather"), "get_weather", b'{"city":"Paris"}')
    reply = json.loads(out)
    assert reply["city"] == "Paris"
    assert set(reply) == {"city", "conditions", "temp_c"}


def test_c_calculator(c_runtime: WasmToolRuntime, modules: Modules) -> None:
    sha = c_tool(modules, "calculator")
    assert call(c_runtime, sha, "calculate", b'{"a":2,"b":3,"op":"add"}') == '{"result":5}'
    with pytest.raises(ToolRuntimeError, match=r"^tool rc: -33$"):  # EDOM
        call(c_runtime, sha, "calculate", b'{"a":1,"b":0,"op":"div"}')


def test_c_big_output_via_enospc_retry(c_runtime: WasmToolRuntime, modules: Modules) -> None:
    sha = c_tool(modules, "large_output")
    out = call(c_runtime, sha, "big_output", b'{"bytes":20000}')
    assert len(out) == 20000
    assert out.startswith("0123456789012")
    with pytest.raises(ToolOutputTooLargeError, match="tool output of 100000 bytes exceeds"):
        call(c_runtime, sha, "big_output", b'{"bytes":100000}')


def test_c_spin_times_out(c_runtime: WasmToolRuntime, modules: Modules) -> None:
    with pytest.raises(ToolTimeoutError, match=r"^tool timed out after 200 ms$"):
        call(c_runtime, c_tool(modules, "spin"), "spin", timeout_ms=200)


def test_c_boom_traps(c_runtime: WasmToolRuntime, modules: Modules) -> None:
    with pytest.raises(ToolRuntimeError, match=r"^tool trapped: wasm trap: wasm `unreachable`"):
        call(c_runtime, c_tool(modules, "trap"), "boom")


def test_c_bad_utf8(c_runtime: WasmToolRuntime, modules: Modules) -> None:
    with pytest.raises(ToolRuntimeError, match=r"^tool output is not valid UTF-8$"):
        call(c_runtime, c_tool(modules, "bad_utf8"), "bad_utf8")


# -- a trapped call's memory ------------------------------------------------


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10


@pytest.fixture
def no_gc() -> Iterator[None]:
    # The cyclic GC frees what a reference cycle holds at a moment of its own: off, a store left
    # to it stays, as it did in a pool process between two trapping 1 GiB calls.
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


HOG_MIB = 512  # each call writes every page of 512 MiB before it traps


def test_a_trapped_calls_memory_is_freed_at_once(
    c_runtime: WasmToolRuntime, modules: Modules, no_gc: None
) -> None:
    sha = c_tool(modules, "hog_trap")
    before = _rss_mib()
    for args in (b'{"mib":512}', b'{"mib":512,"oob":1}', b'{"mib":512}'):
        # "trapped", not rc -12: the memory was granted and written before the trap
        with pytest.raises(ToolRuntimeError, match=r"^tool trapped: "):
            call(c_runtime, sha, "hog_trap", args, memory_bytes=(HOG_MIB + 64) << 20)
    # kept, the three calls' memory would be 1.5 GiB
    assert _rss_mib() - before < HOG_MIB // 4


class _IdleHost:
    """A program host for a run that makes no hostcalls."""

    def hostcall(self, name: str, mem: GuestMemory, args: tuple[int, ...]) -> int | None:
        raise AssertionError(f"unexpected hostcall {name}")

    def attach(self, exported_globals: list[str], table_name: str | None) -> None:
        pass

    def abort_reason(self) -> None:
        return None


def test_a_trapped_program_runs_memory_is_freed_at_once(
    c_runtime: WasmToolRuntime, modules: Modules, no_gc: None
) -> None:
    sha = c_tool(modules, "prog_hog_trap")
    run = ProgramRun(sha, args=[str(HOG_MIB)], memory_bytes=(HOG_MIB + 64) << 20)
    before = _rss_mib()
    for _ in range(3):
        outcome = run_program(c_runtime, run, _IdleHost())
        # a trap, not exit code 12: the allocation was granted and written
        assert (outcome.error_code, outcome.exit_code) == ("guest_trap", None)
    assert _rss_mib() - before < HOG_MIB // 4

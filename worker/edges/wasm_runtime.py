"""Runs one tool call in a fresh wasmtime instance (guest-abi.md, "Tool ABI"): of its module
after `_initialize`, or, for a program's tool, a fork of the program (worker/guest/fork.py).
Linked: WASI with nothing granted (stdout/stderr go to the call's ToolLogs, with its `log`
lines), and the `spear` imports in tool mode. wasmtime exceptions of a call are translated
here, once, into worker.errors: a timeout -> ToolTimeoutError, output over the cap ->
ToolOutputTooLargeError, other tool misbehaviour (trap, rc < 0, bad output, memory limit) ->
ToolRuntimeError; a module that cannot load or link -> GuestError. An error found before the
tool's function was entered says so (`ran=False`): such a call may be retried even when the
tool is not idempotent.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import math
import os
import re
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wasmtime import (
    Config,
    Engine,
    ExitTrap,
    Func,
    InstancePre,
    Linker,
    Memory,
    Module,
    Store,
    Table,
    Trap,
    TrapCode,
    ValType,
    WasiConfig,
    WasmtimeError,
)

from worker.errors import (
    CchatqError,
    GuestError,
    ToolOutputTooLargeError,
    ToolRuntimeError,
    ToolTimeoutError,
)
from worker.guest.fork import (
    HostSwitch,
    ProgramFork,
    ToolModeHost,
    place_buffers,
    restore_fork,
)
from worker.guest.imports import (
    define_spear,
    define_tool_imports,
    function_table,
    wasmtime_reason,
)
from worker.guest.memory import as_i32, pack_u32, unpack_u32
from worker.session.ports import CallWatcher, ToolCall
from worker.session.tool_logs import ToolLogs

log = logging.getLogger(__name__)

WASMTIME_VERSION = importlib.metadata.version("wasmtime")
ENOSPC = -28
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ToolInvocation:
    module_sha256: str  # hex sha256 of the module bytes
    export: str | None  # call by export name ...
    table_index: int | None  # ... or by index into the exported function table
    arguments: bytes  # UTF-8 JSON text from the model
    timeout_ms: int = 10_000
    memory_bytes: int = 256 << 20
    max_output_bytes: int = 65_536
    fork: ProgramFork | None = None  # a program's tool: run in a fork of the program
    attempt: int = 0  # what the tool's `cchatq::attempt` import answers
    watcher: CallWatcher | None = None  # hears `cchatq::progress`, may stop the call
    logs: ToolLogs | None = None  # gets its `log` lines and stdout/stderr (else the host's own)


@dataclass
class _EngineState:
    """One engine per process: wasmtime state does not survive a fork (Celery prefork)."""

    pid: int
    engine: Engine
    hosts: HostSwitch  # the spear host every linked module calls: the current call's
    stop: threading.Event
    ticker: threading.Thread
    prepared: dict[str, InstancePre] = field(default_factory=dict)  # sha -> linked module


@dataclass(frozen=True)
class _Outcome:
    rc: int
    cell: int  # the u32 at len_ptr after the call
    output: bytes  # read only when rc >= 0


def _tick(engine: Engine, stop: threading.Event, tick_s: float) -> None:
    while not stop.wait(tick_s):
        engine.increment_epoch()


def _is_memory_limit(err: WasmtimeError) -> bool:
    return "exceeds memory limits" in str(err)


def _wasi(logs: ToolLogs) -> WasiConfig:
    """Nothing granted: no dirs, env, args or stdin. stdout and stderr are the tool's log."""
    wasi = WasiConfig()

    def stream(name: str) -> Callable[[bytes], None]:
        def write(data: bytes) -> None:  # None: all taken (ToolLogs bounds what it keeps)
            logs.write(name, data)

        return write

    wasi.stdout_custom = stream("stdout")
    wasi.stderr_custom = stream("stderr")
    return wasi


def _signature(ty: Any) -> str:
    params = ", ".join(str(p) for p in ty.params)
    results = ", ".join(str(r) for r in ty.results)
    return f"({params}) -> ({results})"


class WasmToolRuntime:
    def __init__(
        self,
        cache_dir: Path,
        load_module_bytes: Callable[[str], bytes],
        initial_output_bytes: int = 4096,
        epoch_tick_ms: int = 10,
        load_fork_blob: Callable[[str], bytes] | None = None,
    ) -> None:
        if epoch_tick_ms <= 0 or initial_output_bytes < 0:
            raise ValueError("epoch_tick_ms must be > 0 and initial_output_bytes >= 0")
        self._cache_dir = Path(cache_dir)
        self._load_module_bytes = load_module_bytes
        self._load_fork_blob = load_fork_blob
        self._initial_output_bytes = initial_output_bytes
        self._epoch_tick_ms = epoch_tick_ms
        self._lock = threading.Lock()
        self._program_modules: dict[tuple[int, str], Module] = {}
        self._state: _EngineState | None = None

    # -- public -------------------------------------------------------------------------------

    def run(self, call: ToolCall) -> str:
        """The session's ToolRuntime port: a stored call, its program fork loaded by sha."""
        fork = None
        if call.fork_sha256 is not None:
            if self._load_fork_blob is None:
                raise GuestError("this runtime cannot load program forks")
            fork = ProgramFork.from_blob(self._load_fork_blob(call.fork_sha256))
        return self.call_tool(
            ToolInvocation(
                module_sha256=call.module_sha256,
                export=call.export,
                table_index=call.table_index,
                arguments=call.arguments,
                timeout_ms=call.timeout_ms,
                memory_bytes=call.memory_bytes,
                max_output_bytes=call.max_output_bytes,
                fork=fork,
                attempt=call.attempt,
                watcher=call.watcher,
                logs=call.logs,
            )
        )

    def call_tool(self, inv: ToolInvocation, host: ToolModeHost | None = None) -> str:
        """Run the tool once (twice after -ENOSPC) and return its output text.

        `host` serves the tool's `spear` hostcalls (a fresh one, writing to `inv.logs`, when
        None). Its `deadline` is set to this call's. The tool's `log` lines and stdout/stderr
        go to its `logs`, whatever the call's end (a failing tool's lines matter most)."""
        if inv.fork is not None and inv.table_index is None:
            raise ToolRuntimeError("a tool of a program fork needs a table index")
        deadline = time.monotonic() + inv.timeout_ms / 1000
        host = ToolModeHost(logs=inv.logs) if host is None else host
        host.deadline = deadline
        host.attempt = inv.attempt
        host.watcher = inv.watcher
        state = self._engine_state()
        pre = self._prepared(state, inv.module_sha256)
        cap = max(0, min(self._initial_output_bytes, inv.max_output_bytes))
        logs = host.logs
        with state.hosts.serving(host):
            try:
                outcome = self._attempt(state, pre, inv, cap, self._ticks(inv.timeout_ms), logs)
                if outcome.rc == ENOSPC:
                    need = outcome.cell
                    if need > inv.max_output_bytes:
                        raise ToolOutputTooLargeError(
                            f"tool output of {need} bytes exceeds max_tool_output_bytes "
                            f"{inv.max_output_bytes}"
                        )
                    # The retry (a fresh instance or fork, scratch buffers even after an arena
                    # proved too small) gets what is left of the same budget, not a new
                    # timeout. Its lines follow the first run's: the tool did run twice.
                    left_ms = max(0.0, (deadline - time.monotonic()) * 1000)
                    outcome = self._attempt(
                        state, pre, inv, need, self._ticks(left_ms), logs, use_arena=False
                    )
            finally:
                logs.flush()
        if outcome.rc < 0:
            raise ToolRuntimeError(f"tool rc: {outcome.rc}")
        try:
            return outcome.output.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolRuntimeError("tool output is not valid UTF-8") from None

    def close(self) -> None:
        """Stop the epoch ticker. A later call_tool starts a new engine."""
        with self._lock:
            state, self._state = self._state, None
        if state is not None and state.pid == os.getpid():
            state.stop.set()
            state.ticker.join(timeout=1.0)

    # -- for program runs (worker.guest.runner.ModuleSource) -------------------------------

    def compiled(self, sha256: str) -> tuple[Engine, Module]:
        """The engine and a compiled module, sharing this runtime's caches and epoch ticker."""
        state = self._engine_state()
        key = (state.pid, sha256)
        module = self._program_modules.get(key)
        if module is None:
            module = self._program_modules[key] = self._module(state.engine, sha256)
        return state.engine, module

    def deadline_ticks(self, budget_ms: float) -> int:
        return self._ticks(budget_ms)

    # -- engine and modules -------------------------------------------------------------------

    def _engine_state(self) -> _EngineState:
        pid = os.getpid()
        with self._lock:
            if self._state is None or self._state.pid != pid:
                # After a fork the parent's ticker thread does not exist here: start over.
                self._state = self._new_engine(pid)
            return self._state

    def _new_engine(self, pid: int) -> _EngineState:
        config = Config()
        config.epoch_interruption = True
        engine = Engine(config)
        stop = threading.Event()
        ticker = threading.Thread(
            target=_tick,
            args=(engine, stop, self._epoch_tick_ms / 1000),
            name="wasm-epoch-ticker",
            daemon=True,
        )
        ticker.start()
        weakref.finalize(self, stop.set)  # a runtime dropped without close() stops its ticker
        return _EngineState(pid, engine, HostSwitch(), stop, ticker)

    def _ticks(self, budget_ms: float) -> int:
        # +1: the first tick may land at any point within the current period.
        return math.ceil(budget_ms / self._epoch_tick_ms) + 1

    def _prepared(self, state: _EngineState, sha: str) -> InstancePre:
        pre = state.prepared.get(sha)
        if pre is None:
            module = self._module(state.engine, sha)
            # One linker per module: define_spear links the spear imports with the module's
            # own types (mic_* and the like may have any). Both are store-independent.
            linker = Linker(state.engine)
            linker.define_wasi()
            try:
                define_spear(linker, module, state.hosts)
                define_tool_imports(linker, module, state.hosts)
                pre = linker.instantiate_pre(module)
            except GuestError as err:
                raise GuestError(f"module {sha} cannot be linked: {err.message}") from None
            except WasmtimeError as err:
                reason = wasmtime_reason(str(err))
                raise GuestError(f"module {sha} cannot be linked: {reason}") from None
            state.prepared[sha] = pre
        return pre

    def _module(self, engine: Engine, sha: str) -> Module:
        if not _SHA256_HEX.fullmatch(sha):  # it becomes a file name: no path tricks
            raise GuestError(f"invalid module sha256 {sha!r}")
        path = self._cache_dir / f"{sha}-wasmtime-{WASMTIME_VERSION}.cwasm"
        if path.is_file():
            try:
                return Module.deserialize_file(engine, str(path))
            except WasmtimeError as err:
                log.warning("dropping unreadable cache %s: %s", path, wasmtime_reason(str(err)))
                path.unlink(missing_ok=True)
        wasm = self._load_module_bytes(sha)
        if hashlib.sha256(wasm).hexdigest() != sha:
            raise GuestError(f"module bytes do not match sha256 {sha}")
        if not wasm.startswith(b"\0asm"):  # wasmtime-py would parse any other bytes as WAT text
            raise GuestError(f"module {sha} is not a WebAssembly binary")
        try:
            module = Module(engine, wasm)
        except WasmtimeError as err:
            raise GuestError(
                f"module {sha} does not compile: {wasmtime_reason(str(err))}"
            ) from None
        self._write_cache(path, module.serialize())
        return module

    def _write_cache(self, path: Path, blob: bytes | bytearray) -> None:
        # Temp file + rename: a concurrent reader sees the old file or the whole new one.
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as err:  # the cache is an optimisation; the call can still run
            log.warning("cannot write module cache %s: %s", path, err)

    # -- one attempt --------------------------------------------------------------------------

    def _attempt(
        self,
        state: _EngineState,
        pre: InstancePre,
        inv: ToolInvocation,
        cap: int,
        ticks: int,
        logs: ToolLogs,
        use_arena: bool = True,
    ) -> _Outcome:
        store = Store(state.engine)
        try:
            return self._run(store, pre, inv, cap, ticks, logs, use_arena)
        finally:
            # Frees the call's linear memory now. Without it a trap left the store to the
            # cyclic GC: wasmtime-py keeps the raised Trap in a local of its own frame, which
            # the Trap's traceback holds, and so every frame of the call (issue 10, point 7).
            store.close()

    def _run(
        self,
        store: Store,
        pre: InstancePre,
        inv: ToolInvocation,
        cap: int,
        ticks: int,
        logs: ToolLogs,
        use_arena: bool,
    ) -> _Outcome:
        store.set_limits(memory_size=max(0, inv.memory_bytes))  # negative would mean no limit
        store.set_wasi(_wasi(logs))
        store.set_epoch_deadline(ticks)
        try:
            instance = pre.instantiate(store)
        except (Trap, WasmtimeError) as err:
            raise self._translate(err, inv, instantiating=True) from None
        try:
            exports = instance.exports(store)
            if inv.fork is None:
                init = exports.get("_initialize")
                if isinstance(init, Func):  # WASI reactor; `_start` is never called
                    init(store)
                func = self._resolve(store, exports, inv.export, inv.table_index)
                memory = exports.get("memory")
                if not isinstance(memory, Memory):
                    raise ToolRuntimeError(
                        "module exports no linear memory named `memory`", ran=False
                    )
            else:  # neither `_initialize` nor `_start`: the program's state is the snapshot
                memory = restore_fork(store, instance, inv.fork)
                func = self._resolve(store, exports, None, inv.table_index)
            arena_of = inv.fork if use_arena else None  # the retry never uses the arena
            buf = place_buffers(
                store, memory, arena_of, len(inv.arguments), cap, inv.max_output_bytes
            )
            memory.write(store, inv.arguments + b"\0", buf.args_ptr)
            memory.write(store, pack_u32(buf.cap), buf.len_ptr)
            rc = int(
                func(
                    store,
                    as_i32(buf.args_ptr),
                    as_i32(len(inv.arguments)),
                    as_i32(buf.out_ptr),
                    as_i32(buf.len_ptr),
                )
            )
            cell = unpack_u32(memory.read(store, buf.len_ptr, buf.end))
            if rc < 0:
                return _Outcome(rc, cell, b"")
            if cell > buf.cap:
                raise ToolRuntimeError("tool wrote a length beyond its buffer")
            output = bytes(memory.read(store, buf.out_ptr, buf.out_ptr + cell))
            return _Outcome(rc, cell, output)
        except (Trap, WasmtimeError) as err:
            raise self._translate(err, inv, instantiating=False) from None

    def _resolve(
        self,
        store: Store,
        exports: Mapping[str, Any],
        export: str | None,
        index: int | None,
    ) -> Func:
        if export is not None:
            what = f"export {export!r}"
            func = exports.get(export)
            if func is None:
                raise ToolRuntimeError(f"module has no {what}", ran=False)
        elif index is not None:
            what = f"table index {index}"
            table = self._function_table(exports)
            if table is None:
                raise ToolRuntimeError("module exports no function table", ran=False)
            size = int(table.size(store))
            if not 0 <= index < size:
                raise ToolRuntimeError(f"{what} is out of bounds (table size {size})", ran=False)
            func = table.get(store, index)  # a null slot comes back as a Val or None
        else:
            raise ToolRuntimeError("tool names neither an export nor a table index", ran=False)
        if not isinstance(func, Func):
            raise ToolRuntimeError(f"{what} is not a function (null slot or not a func)", ran=False)
        ty = func.type(store)
        i32 = ValType.i32()
        if list(ty.params) != [i32] * 4 or list(ty.results) != [i32]:
            raise ToolRuntimeError(
                f"{what} has type {_signature(ty)}, a tool must be (i32, i32, i32, i32) -> (i32)",
                ran=False,
            )
        return func

    @staticmethod
    def _function_table(exports: Mapping[str, Any]) -> Table | None:
        table = function_table(exports.get)
        return table or next((e for e in exports.values() if isinstance(e, Table)), None)

    @staticmethod
    def _translate(
        err: Trap | WasmtimeError, inv: ToolInvocation, *, instantiating: bool
    ) -> CchatqError:
        # The error's traceback is in a reference cycle (see _attempt); the translated error
        # replaces it, so dropping it lets the call's frames go without the cyclic GC.
        err.__traceback__ = None
        if isinstance(err, Trap):
            if err.trap_code == TrapCode.INTERRUPT:
                return ToolTimeoutError(f"tool timed out after {inv.timeout_ms} ms")
            return ToolRuntimeError(f"tool trapped: {wasmtime_reason(str(err))}")
        if isinstance(err, ExitTrap):
            return ToolRuntimeError(f"tool called proc_exit({err.code})")
        if _is_memory_limit(err):  # e.g. a module whose initial memory exceeds memory_bytes
            return ToolRuntimeError("tool memory limit reached", ran=not instantiating)
        if instantiating:
            return GuestError(f"module {inv.module_sha256}: {wasmtime_reason(str(err))}")
        # A host-function error while the tool runs (e.g. a WASI call with invalid arguments)
        # aborts the call like a trap, and the tool is at fault.
        return ToolRuntimeError(f"tool trapped: {wasmtime_reason(str(err))}")

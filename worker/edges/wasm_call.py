"""Runs one tool call in a fresh wasmtime instance (docs/guest-abi.md, "Tool ABI"): of its module
after `_initialize`, or, for a program's tool, a fork of the program (worker/guest/fork.py).
Linked: WASI with nothing granted (stdout/stderr go to the call's ToolLogs, with its `log`
lines), and the `spear` imports in tool mode. wasmtime exceptions of a call are translated
here, once, into worker.errors: a timeout -> ToolTimeoutError, output over the cap ->
ToolOutputTooLargeError, other tool misbehaviour (trap, rc < 0, bad output, memory limit) ->
ToolRuntimeError; a module that cannot be instantiated -> GuestError (one that cannot load or
link raises it in wasm_modules.py). An error found before the tool's function was entered says
so (`ran=False`): such a call may be retried even when the tool is not idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from wasmtime import (
    ExitTrap,
    Func,
    InstancePre,
    Memory,
    Store,
    Table,
    Trap,
    TrapCode,
    ValType,
    WasiConfig,
    WasmtimeError,
)

from worker.edges.wasm_engine import EngineState, WasmEngine
from worker.edges.wasm_modules import ModuleCache
from worker.errors import (
    CchatqError,
    GuestError,
    ToolOutputTooLargeError,
    ToolRuntimeError,
    ToolTimeoutError,
)
from worker.guest.fork import ProgramFork, ToolModeHost, place_buffers, restore_fork
from worker.guest.imports import function_table, wasmtime_reason
from worker.guest.memory import as_i32, pack_u32, unpack_u32
from worker.session.ports import ToolCall
from worker.session.tool_logs import ToolLogs

ENOSPC = -28


@dataclass(frozen=True)
class _Outcome:
    rc: int
    cell: int  # the u32 at len_ptr after the call
    output: bytes  # read only when rc >= 0


def call_tool(
    engine: WasmEngine,
    modules: ModuleCache,
    call: ToolCall,
    fork: ProgramFork | None,
    host: ToolModeHost | None,
    initial_output_bytes: int,
) -> str:
    """Run the tool once (twice after -ENOSPC) and return its output text; a program's tool
    (`fork`, the one `call.fork_sha256` names) in a fork of the program.

    `host` serves the tool's `spear` hostcalls (a fresh one, writing to `call.logs`, when
    None). Its `deadline` is set to this call's. The tool's `log` lines and stdout/stderr
    go to its `logs`, whatever the call's end (a failing tool's lines matter most)."""
    if fork is not None and call.table_index is None:
        raise ToolRuntimeError("a tool of a program fork needs a table index")
    deadline = time.monotonic() + call.timeout_ms / 1000
    host = ToolModeHost(logs=call.logs) if host is None else host
    host.deadline = deadline
    host.attempt = call.attempt
    host.watcher = call.watcher
    state = engine.current()
    pre = modules.linked(state, call.module_sha256)
    cap = max(0, min(initial_output_bytes, call.max_output_bytes))
    logs = host.logs
    with state.hosts.serving(host):
        try:
            outcome = _attempt(state, pre, call, fork, cap, engine.ticks(call.timeout_ms), logs)
            if outcome.rc == ENOSPC:
                need = outcome.cell
                if need > call.max_output_bytes:
                    raise ToolOutputTooLargeError(
                        f"tool output of {need} bytes exceeds max_tool_output_bytes "
                        f"{call.max_output_bytes}"
                    )
                # The retry (a fresh instance or fork, scratch buffers even after an arena
                # proved too small) gets what is left of the same budget, not a new
                # timeout. Its lines follow the first run's: the tool did run twice.
                left_ms = max(0.0, (deadline - time.monotonic()) * 1000)
                outcome = _attempt(
                    state, pre, call, fork, need, engine.ticks(left_ms), logs, use_arena=False
                )
        finally:
            logs.flush()
    if outcome.rc < 0:
        raise ToolRuntimeError(f"tool rc: {outcome.rc}")
    try:
        return outcome.output.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolRuntimeError("tool output is not valid UTF-8") from None


def _attempt(
    state: EngineState,
    pre: InstancePre,
    call: ToolCall,
    fork: ProgramFork | None,
    cap: int,
    ticks: int,
    logs: ToolLogs,
    use_arena: bool = True,
) -> _Outcome:
    store = Store(state.engine)
    try:
        return _run(store, pre, call, fork, cap, ticks, logs, use_arena)
    finally:
        # Frees the call's linear memory now. Without it a trap left the store to the
        # cyclic GC: wasmtime-py keeps the raised Trap in a local of its own frame, which
        # the Trap's traceback holds, and so every frame of the call.
        store.close()


def _run(
    store: Store,
    pre: InstancePre,
    call: ToolCall,
    fork: ProgramFork | None,
    cap: int,
    ticks: int,
    logs: ToolLogs,
    use_arena: bool,
) -> _Outcome:
    store.set_limits(memory_size=max(0, call.memory_bytes))  # negative would mean no limit
    store.set_wasi(_wasi(logs))
    store.set_epoch_deadline(ticks)
    try:
        instance = pre.instantiate(store)
    except (Trap, WasmtimeError) as err:
        raise _translate(err, call, instantiating=True) from None
    try:
        exports = instance.exports(store)
        if fork is None:
            init = exports.get("_initialize")
            if isinstance(init, Func):  # WASI reactor; `_start` is never called
                init(store)
            func = _resolve(store, exports, call.export, call.table_index)
            memory = exports.get("memory")
            if not isinstance(memory, Memory):
                raise ToolRuntimeError("module exports no linear memory named `memory`", ran=False)
        else:  # neither `_initialize` nor `_start`: the program's state is the snapshot
            memory = restore_fork(store, instance, fork)
            func = _resolve(store, exports, None, call.table_index)
        arena_of = fork if use_arena else None  # the retry never uses the arena
        buf = place_buffers(
            store, memory, arena_of, len(call.arguments), cap, call.max_output_bytes
        )
        memory.write(store, call.arguments + b"\0", buf.args_ptr)
        memory.write(store, pack_u32(buf.cap), buf.len_ptr)
        rc = int(
            func(
                store,
                as_i32(buf.args_ptr),
                as_i32(len(call.arguments)),
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
        raise _translate(err, call, instantiating=False) from None


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


def _resolve(
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
        table = _function_table(exports)
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


def _function_table(exports: Mapping[str, Any]) -> Table | None:
    table = function_table(exports.get)
    return table or next((e for e in exports.values() if isinstance(e, Table)), None)


def _signature(ty: Any) -> str:
    params = ", ".join(str(p) for p in ty.params)
    results = ", ".join(str(r) for r in ty.results)
    return f"({params}) -> ({results})"


def _translate(err: Trap | WasmtimeError, call: ToolCall, *, instantiating: bool) -> CchatqError:
    # The error's traceback is in a reference cycle (see _attempt); the translated error
    # replaces it, so dropping it lets the call's frames go without the cyclic GC.
    err.__traceback__ = None
    if isinstance(err, Trap):
        if err.trap_code == TrapCode.INTERRUPT:
            return ToolTimeoutError(f"tool timed out after {call.timeout_ms} ms")
        return ToolRuntimeError(f"tool trapped: {wasmtime_reason(str(err))}")
    if isinstance(err, ExitTrap):
        return ToolRuntimeError(f"tool called proc_exit({err.code})")
    if _is_memory_limit(err):  # e.g. a module whose initial memory exceeds memory_bytes
        return ToolRuntimeError("tool memory limit reached", ran=not instantiating)
    if instantiating:
        return GuestError(f"module {call.module_sha256}: {wasmtime_reason(str(err))}")
    # A host-function error while the tool runs (e.g. a WASI call with invalid arguments)
    # aborts the call like a trap, and the tool is at fault.
    return ToolRuntimeError(f"tool trapped: {wasmtime_reason(str(err))}")

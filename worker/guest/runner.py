"""Running a WASM agent program (`_start`) with the `spear` hostcalls: WASI with only what the
spec grants (args, stdin, env), stdout/stderr captured, a memory cap, and one deadline for
the whole run (epoch interruption for guest code; hostcalls raise RunAborted to trap it).

Traps and wasmtime errors become a ProgramOutcome here; nothing crashes the worker.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import wasmtime

from worker.errors import DeadlineExceededError, GuestError, GuestTrapError, RunAborted
from worker.guest.imports import SpearHost, define_spear, wasmtime_reason


class ModuleSource(Protocol):
    def compiled(self, sha256: str) -> tuple[wasmtime.Engine, wasmtime.Module]: ...

    def deadline_ticks(self, budget_ms: float) -> int: ...


@dataclass(frozen=True)
class ProgramRun:
    module_sha256: str
    args: list[str] = field(default_factory=list)
    stdin: bytes = b""
    env: dict[str, str] = field(default_factory=dict)
    timeout_ms: int = 60_000
    memory_bytes: int = 256 << 20
    max_output_bytes: int = 1 << 20  # of stdout and of stderr each


@dataclass(frozen=True)
class ProgramOutcome:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    error_code: str | None = None
    error: str | None = None


class HostWithAbort(SpearHost, Protocol):
    def attach(self, exported_globals: list[str], table_name: str | None) -> None:
        """What a fork needs to know of the module: its mutable globals, its function table."""
        ...

    def abort_reason(self) -> RunAborted | None:
        """Why the host stopped the run, if it did (wasmtime-py keeps the exception raised in
        a hostcall in a module global, so the host also remembers its own reason)."""
        ...


def run_program(source: ModuleSource, run: ProgramRun, host: HostWithAbort) -> ProgramOutcome:
    engine, module = source.compiled(run.module_sha256)
    with tempfile.TemporaryDirectory(prefix="cchatq-run-") as tmp:
        stdin_path, stdout_path, stderr_path = (
            Path(tmp) / n for n in ("stdin", "stdout", "stderr")
        )
        stdin_path.write_bytes(run.stdin)
        wasi = wasmtime.WasiConfig()
        wasi.argv = ["program", *run.args]
        wasi.env = list(run.env.items())
        wasi.stdin_file = str(stdin_path)
        wasi.stdout_file = str(stdout_path)
        wasi.stderr_file = str(stderr_path)
        store = wasmtime.Store(engine)
        try:
            store.set_limits(memory_size=run.memory_bytes)
            store.set_wasi(wasi)
            store.set_epoch_deadline(source.deadline_ticks(run.timeout_ms))
            code, error_code, error = _execute(store, engine, module, host, run.timeout_ms)
        finally:
            # Frees the run's linear memory now: a trap's traceback is in a reference cycle
            # that holds the store (wasm_call._attempt says how), which only the cyclic
            # GC would free.
            store.close()
        return ProgramOutcome(
            exit_code=code,
            stdout=_capped(stdout_path, run.max_output_bytes),
            stderr=_capped(stderr_path, run.max_output_bytes),
            error_code=error_code,
            error=error,
        )


def _execute(
    store: wasmtime.Store,
    engine: wasmtime.Engine,
    module: wasmtime.Module,
    host: HostWithAbort,
    timeout_ms: int,
) -> tuple[int | None, str | None, str | None]:
    try:
        linker = wasmtime.Linker(engine)
        linker.define_wasi()
        define_spear(linker, module, host)
        globals_ = [
            e.name
            for e in module.exports
            if isinstance(e.type, wasmtime.GlobalType) and e.type.mutable
        ]
        tables = [e.name for e in module.exports if isinstance(e.type, wasmtime.TableType)]
        host.attach(globals_, tables[0] if tables else None)
        instance = linker.instantiate(store, module)
        start = instance.exports(store).get("_start")
        if not isinstance(start, wasmtime.Func):
            return None, GuestError.code, "the program exports no _start function"
        start(store)
        return 0, None, None
    except (wasmtime.Trap, wasmtime.WasmtimeError, RunAborted, GuestError) as exc:
        # The run ends here. The error's traceback is in a reference cycle (a trap's, and a
        # hostcall's error re-raised by wasmtime-py) through the run's frames and its host,
        # which only the cyclic GC would free: dropping it lets them go now.
        exc.__traceback__ = None
        return _ending(exc, host, timeout_ms)


def _ending(
    exc: wasmtime.Trap | wasmtime.WasmtimeError | RunAborted | GuestError,
    host: HostWithAbort,
    timeout_ms: int,
) -> tuple[int | None, str | None, str | None]:
    if isinstance(exc, wasmtime.ExitTrap):
        return int(exc.code), None, None
    if isinstance(exc, (RunAborted, GuestError)):
        return None, exc.code, exc.message
    aborted = host.abort_reason()
    if aborted is not None:
        return None, aborted.code, aborted.message
    if isinstance(exc, wasmtime.WasmtimeError):
        return None, GuestError.code, f"program failed: {wasmtime_reason(str(exc))}"
    if exc.trap_code == wasmtime.TrapCode.INTERRUPT:
        return None, DeadlineExceededError.code, f"program exceeded its deadline of {timeout_ms} ms"
    return None, GuestTrapError.code, f"program trapped: {wasmtime_reason(str(exc))}"


def _capped(path: Path, limit: int) -> bytes:
    if not path.exists():
        return b""
    with path.open("rb") as fh:
        return fh.read(limit)

"""The WASM tool runtime: the session's ToolRuntime port (one tool call, wasm_call.py) and the
program runs' ModuleSource, over one engine per process (wasm_engine.py) and its compiled
modules (wasm_modules.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from wasmtime import Engine, Module

from worker.edges.wasm_call import call_tool
from worker.edges.wasm_engine import WasmEngine
from worker.edges.wasm_modules import ModuleCache
from worker.errors import GuestError
from worker.guest.fork import ProgramFork, ToolModeHost
from worker.session.ports import ToolCall


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
        self._engine = WasmEngine(epoch_tick_ms)
        self._modules = ModuleCache(cache_dir, load_module_bytes)
        self._load_fork_blob = load_fork_blob
        self._initial_output_bytes = initial_output_bytes

    def run(self, call: ToolCall, host: ToolModeHost | None = None) -> str:
        """The session's ToolRuntime port (wasm_call.call_tool): a program's tool runs in the
        fork `call.fork_sha256` names, loaded here. `host` serves the tool's `spear`
        hostcalls (a fresh one when None)."""
        fork = None
        if call.fork_sha256 is not None:
            if self._load_fork_blob is None:
                raise GuestError("this runtime cannot load program forks")
            fork = ProgramFork.from_blob(self._load_fork_blob(call.fork_sha256))
        return call_tool(self._engine, self._modules, call, fork, host, self._initial_output_bytes)

    def close(self) -> None:
        """Stop the epoch ticker. A later call starts a new engine."""
        self._engine.close()

    # -- for program runs (worker.guest.runner.ModuleSource) ---------------------------------

    def compiled(self, sha256: str) -> tuple[Engine, Module]:
        """The engine and a compiled module, sharing this runtime's caches and epoch ticker."""
        state = self._engine.current()
        return state.engine, self._modules.module(state, sha256)

    def deadline_ticks(self, budget_ms: float) -> int:
        return self._engine.ticks(budget_ms)

"""Compiled modules, by sha256: kept per engine in memory, and on disk as serialized modules
(one file per sha256 and wasmtime version) shared by every process and runtime of a machine.
Bytes loaded to compile must match their sha256 and be a WebAssembly binary. A tool module is
linked once per engine into an InstancePre: WASI and the `spear` imports in tool mode, served
by the engine's HostSwitch. A module that cannot load, compile or link raises GuestError.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from wasmtime import InstancePre, Linker, Module, WasmtimeError

from worker.edges.wasm_engine import EngineState
from worker.errors import GuestError
from worker.guest.imports import define_spear, define_tool_imports, wasmtime_reason

log = logging.getLogger(__name__)

WASMTIME_VERSION = importlib.metadata.version("wasmtime")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ModuleCache:
    def __init__(self, cache_dir: Path, load_module_bytes: Callable[[str], bytes]) -> None:
        self._cache_dir = Path(cache_dir)
        self._load_module_bytes = load_module_bytes

    def module(self, state: EngineState, sha: str) -> Module:
        """The module compiled for this engine."""
        module = state.modules.get(sha)
        if module is None:
            module = state.modules[sha] = self._compiled(state, sha)
        return module

    def linked(self, state: EngineState, sha: str) -> InstancePre:
        """The tool module linked for this engine, ready to instantiate in a fresh Store."""
        pre = state.linked.get(sha)
        if pre is None:
            module = self.module(state, sha)
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
            state.linked[sha] = pre
        return pre

    def _compiled(self, state: EngineState, sha: str) -> Module:
        if not _SHA256_HEX.fullmatch(sha):  # it becomes a file name: no path tricks
            raise GuestError(f"invalid module sha256 {sha!r}")
        path = self._cache_dir / f"{sha}-wasmtime-{WASMTIME_VERSION}.cwasm"
        if path.is_file():
            try:
                return Module.deserialize_file(state.engine, str(path))
            except WasmtimeError as err:
                log.warning("dropping unreadable cache %s: %s", path, wasmtime_reason(str(err)))
                path.unlink(missing_ok=True)
        wasm = self._load_module_bytes(sha)
        if hashlib.sha256(wasm).hexdigest() != sha:
            raise GuestError(f"module bytes do not match sha256 {sha}")
        if not wasm.startswith(b"\0asm"):  # wasmtime-py would parse any other bytes as WAT text
            raise GuestError(f"module {sha} is not a WebAssembly binary")
        try:
            module = Module(state.engine, wasm)
        except WasmtimeError as err:
            raise GuestError(
                f"module {sha} does not compile: {wasmtime_reason(str(err))}"
            ) from None
        _write_cache(path, module.serialize())
        return module


def _write_cache(path: Path, blob: bytes | bytearray) -> None:
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

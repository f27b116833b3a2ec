"""The `spear` and `cchatq` import modules for wasmtime: guest memory access with bounds
checks, and the link step shared by program runs and tool calls, which checks each import
against its declaration (hostcalls.py).

A host object implements the calls; this module only adapts wasm values and memory to it.
Unserved SPEAR families (mic_*, rtasr_*) link and return -ENOSYS.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any, Protocol

import wasmtime

from worker.errors import GuestError, GuestFault
from worker.guest.abi import EFAULT, ENOSYS
from worker.guest.hostcalls import SPEAR_IMPORTS, TOOL_IMPORTS, UNSERVED_PREFIXES, Hostcall


class GuestMemory:
    """Bounds-checked access to the calling instance's exported `memory`."""

    def __init__(self, caller: wasmtime.Caller) -> None:
        self._caller = caller
        memory = caller.get("memory")
        self._memory = memory if isinstance(memory, wasmtime.Memory) else None

    def _check(self, ptr: int, length: int) -> wasmtime.Memory:
        if self._memory is None:
            raise GuestFault("the guest exports no memory")
        ptr, length = ptr & 0xFFFFFFFF, length & 0xFFFFFFFF  # wasm i32 are unsigned addresses
        if ptr + length > self._memory.data_len(self._caller):
            raise GuestFault(f"{ptr}+{length} is outside guest memory")
        return self._memory

    def read(self, ptr: int, length: int) -> bytes:
        memory = self._check(ptr, length)
        return bytes(
            memory.read(self._caller, ptr & 0xFFFFFFFF, (ptr & 0xFFFFFFFF) + (length & 0xFFFFFFFF))
        )

    def write(self, ptr: int, data: bytes) -> None:
        memory = self._check(ptr, len(data))
        memory.write(self._caller, data, ptr & 0xFFFFFFFF)

    def read_u32(self, ptr: int) -> int:
        return int(struct.unpack("<I", self.read(ptr, 4))[0])

    def write_u32(self, ptr: int, value: int) -> None:
        self.write(ptr, struct.pack("<I", value & 0xFFFFFFFF))

    # what a fork of the guest needs (docs/guest-abi.md section 4) ---------------------------------

    def snapshot(self) -> bytes:
        """The whole linear memory, as a tool fork will see it."""
        if self._memory is None:
            return b""
        return bytes(self._memory.read(self._caller, 0, self._memory.data_len(self._caller)))

    def mutable_globals(self, names: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in names:
            glob = self._caller.get(name)
            if isinstance(glob, wasmtime.Global) and glob.type(self._caller).mutable:
                value = glob.value(self._caller)
                if isinstance(value, int):
                    out[name] = value
        return out

    def tool_function_problem(self, index: int, fallback_table: str | None = None) -> str | None:
        """Why `index` names no function of the tool signature in the exported table
        (`__indirect_function_table`, else `table`, else the first exported table), or None."""
        table = self._function_table(fallback_table)
        if table is None:
            return "the module exports no function table"
        size = table.size(self._caller)
        if index < 0 or index >= size:
            return f"outside the function table (size {size})"
        func = table.get(self._caller, index)  # type: ignore[arg-type]  # a Caller is a store here
        if not isinstance(func, wasmtime.Func):
            return "an empty slot of the function table"
        ty = func.type(self._caller)
        if [str(p) for p in ty.params] != ["i32"] * 4 or [str(r) for r in ty.results] != ["i32"]:
            return "not a function of the tool signature (i32, i32, i32, i32) -> i32"
        return None

    def _function_table(self, fallback: str | None) -> wasmtime.Table | None:
        return function_table(self._caller.get, fallback)


TABLE_NAMES = ("__indirect_function_table", "table")


def function_table(
    lookup: Callable[[str], object], fallback: str | None = None
) -> wasmtime.Table | None:
    """The module's function table: `__indirect_function_table`, else `table`, else
    `fallback` (one copy for program hosts and the tool runtime)."""
    for name in (*TABLE_NAMES, fallback):
        if name is not None:
            table = lookup(name)
            if isinstance(table, wasmtime.Table):
                return table
    return None


def wasmtime_reason(message: str, max_chars: int = 200) -> str:
    """The cause line of a wasmtime message ("wasm trap: ..."), not its backtrace header."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for n, line in enumerate(lines):
        if line.startswith("Caused by:") and n + 1 < len(lines):
            return re.sub(r"^\d+: ", "", lines[n + 1])[:max_chars]  # the "0: " of a cause chain
    return (lines[0] if lines else "unknown error")[:max_chars]


class SpearHost(Protocol):
    def hostcall(self, name: str, mem: GuestMemory, args: tuple[int, ...]) -> int | None:
        """Run one hostcall. Return its value; raise to trap the guest (deadline, cancel)."""
        ...


def define_spear(linker: wasmtime.Linker, module: wasmtime.Module, host: SpearHost) -> None:
    """Define every `spear` import `module` declares. Unknown ones fail here, by name."""
    for imp in module.imports:
        if imp.module != "spear" or imp.name is None:
            continue
        ty = imp.type
        if not isinstance(ty, wasmtime.FuncType):
            raise GuestError(f"import spear::{imp.name} is not a function")
        linker.define_func("spear", imp.name, ty, _adapter(imp.name, ty, host), access_caller=True)


def define_tool_imports(linker: wasmtime.Linker, module: wasmtime.Module, host: SpearHost) -> None:
    """Define the `cchatq` imports a tool declares; each reaches `host` as `cchatq.NAME`."""
    for imp in module.imports:
        if imp.module != "cchatq" or imp.name is None:
            continue
        name = imp.name
        declared = TOOL_IMPORTS.get(name)
        if declared is None:
            raise GuestError(f"unknown import cchatq::{name}")
        ty = _checked_type(declared, imp.type)

        linker.define_func("cchatq", name, ty, _served(declared.key, host), access_caller=True)


def _adapter(name: str, ty: wasmtime.FuncType, host: SpearHost) -> Callable[..., Any]:
    declared = SPEAR_IMPORTS.get(name)
    if declared is None:
        if not name.startswith(UNSERVED_PREFIXES):
            raise GuestError(f"unknown import spear::{name}")
        return _enosys(ty)
    _checked_type(declared, ty)
    return _served(name, host)


def _served(key: str, host: SpearHost) -> Callable[..., Any]:
    """An import served by `host` under `key`: a pointer outside the guest's memory is the
    call's -EFAULT (docs/guest-abi.md), never a trap, in every module a guest imports from."""

    def call(caller: wasmtime.Caller, *args: int) -> int | None:
        try:
            return host.hostcall(key, GuestMemory(caller), args)
        except GuestFault:
            return -EFAULT

    return call


def _checked_type(declared: Hostcall, ty: object) -> wasmtime.FuncType:
    """`ty`, the type a module gives an import, if it is the declared one."""
    if not isinstance(ty, wasmtime.FuncType) or (
        tuple(str(p) for p in ty.params),
        tuple(str(r) for r in ty.results),
    ) != (declared.params, declared.results):
        raise GuestError(f"import {declared.module}::{declared.name} has the wrong type {ty}")
    return ty


def _enosys(ty: wasmtime.FuncType) -> Callable[..., Any]:
    results = list(ty.results)

    def stub(caller: wasmtime.Caller, *args: Any) -> Any:
        if not results:
            return None
        values = [-ENOSYS if str(r) in ("i32", "i64") else 0 for r in results]
        return values[0] if len(values) == 1 else values

    return stub

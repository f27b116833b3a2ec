"""The WASM modules a spec file names, checked at submit before anything is enqueued: each
distinct file is read and compiled once (wasmtime, as the workers will), so a missing file, a
corrupt module, or a tool export or table index the module does not have is rejected with its
line and field, instead of ending sessions with a tool error at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import wasmtime

WASM_MAGIC = b"\0asm"
MAX_NAMES_SHOWN = 8


@dataclass(frozen=True)
class ModuleExports:
    functions: frozenset[str]
    table_size: int  # the exported function table's initial size (0: none)
    memory: bool  # exports a linear memory named `memory` (a tool reads its output there)


@dataclass
class ModuleChecker:
    """Resolves module paths against the spec file's folder; checks each file once."""

    base_dir: Path
    _found: dict[Path, ModuleExports | str] = field(default_factory=dict)
    _engine: wasmtime.Engine | None = None

    def check(self, module: str) -> tuple[str, str | None]:
        """(absolute path, the module's problem or None)."""
        path = self.resolve(module)
        found = self._load(path)
        return str(path), found if isinstance(found, str) else None

    def resolve(self, module: str) -> Path:
        candidate = Path(module).expanduser()
        return (candidate if candidate.is_absolute() else self.base_dir / candidate).resolve()

    def tool_problem(self, resolved: str, export: object, table_index: object) -> str | None:
        """Why a tool's export or table index does not fit its module (`check`'s path; None:
        it does, or the module's own problem is reported on its field already)."""
        module = Path(resolved)
        found = self._load(module)
        if isinstance(found, str):
            return None
        name = module.name
        if not found.memory:
            return f"{name} exports no linear memory named `memory`"
        if isinstance(export, str) and export not in found.functions:
            shown = ", ".join(sorted(found.functions)[:MAX_NAMES_SHOWN]) or "none"
            return f"{name} exports no function {export!r} (its functions: {shown})"
        if isinstance(table_index, int) and table_index >= found.table_size:
            return f"{name}'s function table has {found.table_size} entries, not {table_index + 1}"
        return None

    def _load(self, path: Path) -> ModuleExports | str:
        if path not in self._found:
            self._found[path] = self._read(path)
        return self._found[path]

    def _read(self, path: Path) -> ModuleExports | str:
        if not path.exists():
            return f"no such file: {path}"
        if not path.is_file():
            return f"not a regular file: {path}"
        try:
            data = path.read_bytes()
        except OSError as exc:
            return f"cannot read: {exc.strerror or exc}"
        if not data.startswith(WASM_MAGIC):
            return "not a WebAssembly module"
        if self._engine is None:
            self._engine = wasmtime.Engine()
        try:
            module = wasmtime.Module(self._engine, data)
        except wasmtime.WasmtimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
            return f"not a valid WebAssembly module: {first[:160]}"
        functions = frozenset(
            e.name for e in module.exports if isinstance(e.type, wasmtime.FuncType)
        )
        tables = [e.type for e in module.exports if isinstance(e.type, wasmtime.TableType)]
        memory = any(
            e.name == "memory" and isinstance(e.type, wasmtime.MemoryType) for e in module.exports
        )
        return ModuleExports(functions, tables[0].limits.min if tables else 0, memory)

"""A tiny generator of WAT guest programs for hostcall tests (docs/guest-abi.md).

A `Program` is a straight list of `spear` calls that `_start` runs in order. The result of
call i is stored as an i64 (i32 results sign-extended) at `RESULTS + 8*i`; an argument may
be a previous call's result (`Ref(i)`). Strings, JSON, out buffers and u32 length cells live
in data segments placed after the results. At the end `_start` writes the whole region, from
RESULTS to the last byte allocated, to stdout with WASI `fd_write`, so a test reads exact
return values and exactly what the host wrote into guest memory (`Dump`).

Tool functions for `cchat_write_fn` sit in a function table exported as
`__indirect_function_table` (or `table_export`): slot 0 is null, then the entries in the order
they were added, then two more null slots.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from worker.guest.hostcalls import SPEAR_IMPORTS

PAGE = 65_536
IOV = 16  # the iovec for fd_write
NWRITTEN = 32  # fd_write's out cell
RESULTS = 1024
MAX_CALLS = 256
DATA = RESULTS + 8 * MAX_CALLS
FILL = 0xAA  # what out buffers hold before a hostcall writes them
OOB = 0x7FFF_0000  # an address far beyond any memory built here
TOOL_SIG = "(param i32 i32 i32 i32) (result i32)"

# name -> (param types, result type or None) of every `spear` import, as hostcalls.py declares it
SPEAR_SIGS: dict[str, tuple[tuple[str, ...], str | None]] = {
    name: (call.params, call.results[0] if call.results else None)
    for name, call in SPEAR_IMPORTS.items()
}


@dataclass(frozen=True)
class Ref:
    """The (i32-wrapped) result of call `index`, as an argument of a later call."""

    index: int


Arg = int | Ref


@dataclass(frozen=True)
class Span:
    ptr: int
    len: int


@dataclass
class Program:
    """Build with data()/buffer()/cell()/tool()/call(), then wat()."""

    signatures: dict[str, tuple[tuple[str, ...], str | None]] = field(default_factory=dict)
    pages: int | None = None  # the memory's size in pages (default: just enough)
    table_export: str | None = "__indirect_function_table"  # None: the table is not exported
    _segments: list[tuple[int, bytes]] = field(default_factory=list)
    _top: int = DATA
    _steps: list[tuple[str, tuple[Arg, ...]] | None] = field(default_factory=list)
    _table: list[str] = field(default_factory=list)  # function bodies, slot 1 onwards
    _tool_imports: set[str] = field(default_factory=set)  # imports the table functions call

    # memory ---------------------------------------------------------------------------------

    def _place(self, content: bytes, align: int = 8) -> int:
        ptr = (self._top + align - 1) // align * align
        self._segments.append((ptr, content))
        self._top = ptr + max(len(content), 1)
        return ptr

    def data(self, content: bytes | str) -> Span:
        raw = content.encode() if isinstance(content, str) else content
        return Span(self._place(raw), len(raw))

    def buffer(self, size: int) -> int:
        """An out buffer of `size` bytes, each FILL before any call."""
        return self._place(bytes([FILL]) * size)

    def cell(self, value: int) -> int:
        """A u32 little-endian length cell holding `value`."""
        return self._place(struct.pack("<I", value & 0xFFFFFFFF), align=4)

    def arg(self, content: bytes | str) -> tuple[int, int]:
        """(arg_ptr, arg_len_ptr) for the SET commands: the bytes and a cell with their length."""
        span = self.data(content)
        return span.ptr, self.cell(span.len)

    def out(self, capacity: int, size: int | None = None) -> tuple[int, int]:
        """(out_ptr, out_len_ptr): a buffer of `size` (default `capacity`) bytes and a cell
        announcing `capacity`."""
        return self.buffer(capacity if size is None else size), self.cell(capacity)

    @property
    def end(self) -> int:
        return self._top

    # the function table ---------------------------------------------------------------------

    def tool(self, output: str) -> int:
        """A tool `(args, args_len, out, out_len_ptr) -> i32` answering `output`, with the
        ENOSPC rule; its table index."""
        text = self.data(output)
        self._table.append(
            f"(func {TOOL_SIG}\n"
            f"    (if (i32.lt_u (i32.load (local.get 3)) (i32.const {text.len}))\n"
            f"      (then (i32.store (local.get 3) (i32.const {text.len}))"
            f" (return (i32.const -28))))\n"
            f"    (memory.copy (local.get 2) (i32.const {text.ptr}) (i32.const {text.len}))\n"
            f"    (i32.store (local.get 3) (i32.const {text.len}))\n"
            f"    (i32.const 0))"
        )
        return len(self._table)

    def hostcall_tool(self, calls: list[tuple[str, tuple[int, ...]]]) -> int:
        """A tool that makes `calls` (each with an i32 result) when the model calls it and
        answers one character per call, chr(64 - rc): 0 -> "@", -1 -> "A", -22 -> "V"...;
        its table index."""
        n = len(calls)
        lines = [
            f"(func {TOOL_SIG}",
            f"    (if (i32.lt_u (i32.load (local.get 3)) (i32.const {n}))",
            f"      (then (i32.store (local.get 3) (i32.const {n})) (return (i32.const -28))))",
        ]
        for k, (name, args) in enumerate(calls):
            params, result = self._sig(name)
            if result != "i32" or len(args) != len(params):
                raise ValueError(f"{name}: a tool probe needs an i32 call with {len(params)} args")
            rendered = " ".join(_arg(a, t) for a, t in zip(args, params, strict=True))
            call = f"(call ${name} {rendered})".replace(" )", ")")
            lines.append(
                f"    (i32.store8 (i32.add (local.get 2) (i32.const {k}))"
                f" (i32.sub (i32.const 64) {call}))"
            )
            self._tool_imports.add(name)
        lines += [f"    (i32.store (local.get 3) (i32.const {n}))", "    (i32.const 0))"]
        self._table.append("\n".join(lines))
        return len(self._table)

    def other_function(self) -> int:
        """A table entry of another signature, `(i32) -> i32`."""
        self._table.append("(func (param i32) (result i32) (local.get 0))")
        return len(self._table)

    @property
    def table_size(self) -> int:
        return len(self._table) + 3

    # code -------------------------------------------------------------------------------------

    def _sig(self, name: str) -> tuple[tuple[str, ...], str | None]:
        return self.signatures.get(name) or SPEAR_SIGS[name]

    def call(self, name: str, *args: Arg) -> int:
        """Append a call; its index (for `Ref` and `Dump.results`)."""
        params, _ = self._sig(name)
        if len(args) != len(params):
            raise ValueError(f"{name} takes {len(params)} args, got {len(args)}")
        if len(self._steps) >= MAX_CALLS:
            raise ValueError("too many calls")
        for a in args:
            if isinstance(a, Ref) and not 0 <= a.index < len(self._steps):
                raise ValueError(f"Ref({a.index}) is not an earlier call")
        self._steps.append((name, args))
        return len(self._steps) - 1

    def trap(self) -> None:
        """`unreachable` at this point (also counts as a call slot)."""
        self._steps.append(None)

    def wat(self) -> str:
        names = sorted({s[0] for s in self._steps if s is not None} | self._tool_imports)
        imports = []
        for name in names:
            params, result = self._sig(name)
            p = f" (param {' '.join(params)})" if params else ""
            r = f" (result {result})" if result else ""
            imports.append(f'  (import "spear" "{name}" (func ${name}{p}{r}))')
        body = []
        for i, step in enumerate(self._steps):
            if step is None:
                body.append("    unreachable")
                continue
            name, args = step
            params, result = self._sig(name)
            rendered = " ".join(_arg(a, t) for a, t in zip(args, params, strict=True))
            call = f"(call ${name} {rendered})".replace(" )", ")")
            slot = RESULTS + 8 * i
            if result == "i32":
                body.append(f"    (i64.store (i32.const {slot}) (i64.extend_i32_s {call}))")
            elif result == "i64":
                body.append(f"    (i64.store (i32.const {slot}) {call})")
            else:
                body.append(f"    {call}")
        dump_len = self._top - RESULTS
        body += [
            f"    (i32.store (i32.const {IOV}) (i32.const {RESULTS}))",
            f"    (i32.store (i32.const {IOV + 4}) (i32.const {dump_len}))",
            f"    (drop (call $fd_write (i32.const 1) (i32.const {IOV}) (i32.const 1)"
            f" (i32.const {NWRITTEN})))",
        ]
        pages = (self._top + PAGE - 1) // PAGE
        if self.pages is not None:
            if self.pages < pages:
                raise ValueError(f"the data needs {pages} pages")
            pages = self.pages
        data = [f'  (data (i32.const {ptr}) "{_escape(raw)}")' for ptr, raw in self._segments]
        export = f' (export "{self.table_export}")' if self.table_export else ""
        table = [f"  (table{export} {self.table_size} funcref)"]
        funcs = []
        if self._table:
            refs = " ".join(f"$t{n + 1}" for n in range(len(self._table)))
            table.append(f"  (elem (i32.const 1) func {refs})")
            funcs = [
                f"  (func $t{n + 1} {src[len('(func ') :]}" for n, src in enumerate(self._table)
            ]
        return "\n".join(
            [
                "(module",
                '  (import "wasi_snapshot_preview1" "fd_write"'
                " (func $fd_write (param i32 i32 i32 i32) (result i32)))",
                *imports,
                f'  (memory (export "memory") {pages})',
                *table,
                *data,
                *funcs,
                '  (func (export "_start")',
                *body,
                "  )",
                ")",
            ]
        )

    def dump_len(self) -> int:
        return self._top - RESULTS


def _arg(a: Arg, ty: str) -> str:
    if isinstance(a, Ref):
        load = f"(i64.load (i32.const {RESULTS + 8 * a.index}))"
        return load if ty == "i64" else f"(i32.wrap_i64 {load})"
    if ty == "i64":
        return f"(i64.const {a})"
    return f"(i32.const {_i32(a)})"


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _escape(raw: bytes) -> str:
    return "".join(f"\\{b:02x}" for b in raw)


@dataclass(frozen=True)
class Dump:
    """What a Program wrote to stdout: the results and the memory region after the run."""

    raw: bytes

    def result(self, index: int) -> int:
        return int(struct.unpack_from("<q", self.raw, 8 * index)[0])

    def results(self, count: int) -> list[int]:
        return [self.result(i) for i in range(count)]

    def mem(self, ptr: int, length: int) -> bytes:
        start = ptr - RESULTS
        if start < 0 or start + length > len(self.raw):
            raise IndexError(f"{ptr}+{length} is outside the dumped region")
        return self.raw[start : start + length]

    def u32(self, ptr: int) -> int:
        return int(struct.unpack("<I", self.mem(ptr, 4))[0])

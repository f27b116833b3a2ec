"""Program forks and the tool-mode `spear` host (docs/guest-abi.md section 4, "Where a tool runs:
fork semantics", and section 6).

A tool registered by a WASM agent program runs in a fresh instance of the program's module
whose linear memory and exported mutable globals are restored from a `ProgramFork`, taken by
the program host at `cchat_send`. Inside a tool call the chat, fd, epoll and user stream
hostcalls return -EPERM; `log`, time, random and `sleep_ms` work, and the tool ABI's own
`cchatq` imports (`ToolModeHost`; hostcalls.py declares which is which).
"""

from __future__ import annotations

import ctypes
import json
import struct
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from wasmtime import Global, Instance, Memory, Store, Val, WasmtimeError

from worker.errors import ToolRuntimeError
from worker.guest.abi import EINVAL, ENOSYS, EPERM
from worker.guest.hostcalls import Part, dispatch_table
from worker.guest.imports import GuestMemory, SpearHost
from worker.guest.memory import ToolBuffers, as_i32, plan_arena, plan_scratch
from worker.guest.shared import SharedCalls
from worker.session.ports import CallWatcher
from worker.session.tool_logs import ToolLogs

_BLOB_MAGIC = b"CQF1"
_BLOB_HEAD = struct.Struct("<4sI")  # magic, length of the JSON header that follows
_BLOB_MAX_HEADER = 1 << 20
_BLOB_MAX_SNAPSHOT = 4 << 30  # a wasm32 memory is at most 4 GiB
PROGRESS_MAX_BYTES = 200  # a progress message, as trace events carry it


@dataclass(frozen=True)
class ProgramFork:
    """A program's state at `cchat_send`, for its tools to run in."""

    snapshot: bytes  # the program's whole linear memory at cchat_send (uncompressed)
    globals: dict[str, int]  # exported mutable i32/i64 globals at the send, by export name
    arena_ptr: int | None = None  # SPEAR tool arena, when the program set tool_arena_ptr/len
    arena_len: int | None = None

    def to_blob(self) -> bytes:
        """Magic, a small JSON header (size, globals, arena), then zlib level 1 of the memory."""
        header = json.dumps(
            {
                "arena_len": self.arena_len,
                "arena_ptr": self.arena_ptr,
                "globals": self.globals,
                "size": len(self.snapshot),
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        return _BLOB_HEAD.pack(_BLOB_MAGIC, len(header)) + header + zlib.compress(self.snapshot, 1)

    @classmethod
    def from_blob(cls, blob: bytes | bytearray | memoryview) -> ProgramFork:
        """The inverse of `to_blob`. A damaged blob raises ToolRuntimeError (the call fails)."""
        view = memoryview(blob)
        if len(view) < _BLOB_HEAD.size:
            raise ToolRuntimeError("program fork blob is truncated")
        magic, head_len = _BLOB_HEAD.unpack(view[: _BLOB_HEAD.size])
        if magic != _BLOB_MAGIC or head_len > _BLOB_MAX_HEADER:
            raise ToolRuntimeError("program fork blob has a bad header")
        body = _BLOB_HEAD.size + head_len
        try:
            header = json.loads(bytes(view[_BLOB_HEAD.size : body]))
        except (ValueError, UnicodeDecodeError):
            raise ToolRuntimeError("program fork blob has a bad header") from None
        size, fields = _header_fields(header)
        inflater = zlib.decompressobj()
        try:
            # max_length: a damaged blob cannot inflate to much more than the size it claims
            snapshot = inflater.decompress(view[body:], size + 1)
        except zlib.error:
            raise ToolRuntimeError("program fork blob is corrupt") from None
        if len(snapshot) != size or not inflater.eof or inflater.unused_data:
            raise ToolRuntimeError("program fork blob is corrupt")
        return cls(snapshot, fields["globals"], fields["arena_ptr"], fields["arena_len"])


def _header_fields(header: Any) -> tuple[int, dict[str, Any]]:
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    ok = (
        isinstance(header, dict)
        and is_int(header.get("size"))
        and 0 <= header["size"] <= _BLOB_MAX_SNAPSHOT
        and isinstance(header.get("globals"), dict)
        and all(is_int(v) for v in header["globals"].values())
        and all(header.get(k) is None or is_int(header[k]) for k in ("arena_ptr", "arena_len"))
    )
    if not ok:
        raise ToolRuntimeError("program fork blob has a bad header")
    return int(header["size"]), header


def restore_fork(store: Store, instance: Instance, fork: ProgramFork) -> Memory:
    """Make a fresh instance's `memory` and exported mutable globals those of the fork.

    Memory grows to the snapshot's size and the snapshot is copied over it; nothing of the
    module's start-up (`_initialize`, `_start`) runs. Returns the memory."""
    exports = instance.exports(store)
    memory = exports.get("memory")
    if not isinstance(memory, Memory):
        raise ToolRuntimeError("module exports no linear memory named `memory`")
    size, page = len(fork.snapshot), int(memory.page_size(store))
    have = int(memory.data_len(store))
    if size % page:
        raise ToolRuntimeError(f"fork snapshot of {size} bytes is not a whole number of pages")
    if size < have:
        raise ToolRuntimeError(
            f"fork snapshot of {size} bytes is smaller than the module's memory ({have} bytes)"
        )
    if size > have:
        try:
            memory.grow(store, (size - have) // page)
        except WasmtimeError:  # Store.set_limits or the module's declared maximum
            raise ToolRuntimeError("tool memory limit reached") from None
    if size:
        # One copy straight from the bytes object (Memory.write would copy it twice).
        snapshot = fork.snapshot if isinstance(fork.snapshot, bytes) else bytes(fork.snapshot)
        ctypes.memmove(memory.data_ptr(store), snapshot, size)
    for name, value in fork.globals.items():
        _set_global(store, exports.get(name), name, value)
    return memory


def _set_global(store: Store, glob: Any, name: str, value: int) -> None:
    if not isinstance(glob, Global):
        raise ToolRuntimeError(f"fork global {name!r} is not an exported global of the module")
    ty = glob.type(store)
    kind = str(ty.content)
    if not ty.mutable or kind not in ("i32", "i64"):
        raise ToolRuntimeError(f"fork global {name!r} is not a mutable i32/i64 global")
    if kind == "i32":
        glob.set_value(store, Val.i32(as_i32(value)))
    else:
        value &= (1 << 64) - 1
        glob.set_value(store, Val.i64(value - (1 << 64) if value >= 1 << 63 else value))


def place_buffers(
    store: Store,
    memory: Memory,
    fork: ProgramFork | None,
    args_len: int,
    cap: int,
    max_output_bytes: int,
) -> ToolBuffers:
    """The fork's tool arena when it has one, else scratch pages appended to the memory
    holding an output buffer of `cap` bytes (also when the args do not fit the arena)."""
    if fork is not None and (fork.arena_ptr, fork.arena_len) != (None, None):
        if fork.arena_ptr is None or fork.arena_len is None:
            raise ToolRuntimeError("tool arena needs both tool_arena_ptr and tool_arena_len")
        size = int(memory.data_len(store))
        buf = plan_arena(fork.arena_ptr, fork.arena_len, args_len, max_output_bytes, size)
        if buf is not None:
            return buf
    page = int(memory.page_size(store))
    layout = plan_scratch(int(memory.data_len(store)), args_len, cap, page)
    try:
        memory.grow(store, layout.grow_pages)
    except WasmtimeError:  # refused by Store.set_limits or the module's declared maximum
        raise ToolRuntimeError("tool memory limit reached") from None
    return ToolBuffers(layout.args_ptr, layout.out_ptr, cap, layout.len_ptr)


class ToolModeHost:
    """The `spear` host inside a tool call (program forks and spec-session tools alike).

    `log` lines go to `logs` (the call's ToolLogs, bounded; WasmToolRuntime sends the tool's
    stdout/stderr there too), never printed. `deadline` is a time.monotonic() value that bounds
    `sleep_ms`; WasmToolRuntime.run (wasm_call.call_tool) sets it."""

    def __init__(self, deadline: float | None = None, logs: ToolLogs | None = None) -> None:
        self.deadline = deadline
        self.attempt = 0  # the call's retry number, for `cchatq::attempt`
        self.watcher: CallWatcher | None = None  # a background call's: progress, cancel
        self.logs = ToolLogs() if logs is None else logs
        self.shared = SharedCalls(
            lambda level, text: self.logs.log(level, text),
            lambda: self.deadline,
            self._check_watcher,
        )
        self._calls = dispatch_table("tool", {Part.SHARED: self.shared, Part.TOOL: self})

    def hostcall(self, name: str, mem: GuestMemory, args: tuple[int, ...]) -> int | None:
        call = self._calls.get(name)
        if call is None:
            return -ENOSYS  # define_spear links no other name to a host
        return call(mem, *args)

    # the tool ABI's own imports (module cchatq) ---------------------------------------------

    def cchatq_attempt(self, mem: GuestMemory) -> int:
        return self.attempt

    def cchatq_progress(self, mem: GuestMemory, percent: int, ptr: int, length: int) -> int:
        """A tool's progress report: 0..100 and a short message (cut at PROGRESS_MAX_BYTES)."""
        if not 0 <= percent <= 100 or not length >= 0:
            return -EINVAL
        text = mem.read(ptr, min(length, PROGRESS_MAX_BYTES)).decode(errors="replace")
        if self.watcher is not None:
            self.watcher.check()
            self.watcher.progress(percent, text)
        return 0

    def _check_watcher(self) -> None:
        if self.watcher is not None:  # a watcher may stop a long sleep
            self.watcher.check()


class HostSwitch:
    """The SpearHost linked into every cached tool module. A linked module outlives any one
    call, so each hostcall goes to the host of the call running on the calling thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def hostcall(self, name: str, mem: GuestMemory, args: tuple[int, ...]) -> int | None:
        host: SpearHost | None = getattr(self._local, "host", None)
        if host is None:  # not inside serving(): only a bug could get here
            return -EPERM
        return host.hostcall(name, mem, args)

    @contextmanager
    def serving(self, host: SpearHost) -> Iterator[None]:
        previous = getattr(self._local, "host", None)
        self._local.host = host
        try:
            yield
        finally:
            self._local.host = previous

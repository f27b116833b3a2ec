"""Byte layout of a tool call's buffers in guest memory (pure arithmetic, no wasmtime).

With no tool arena (docs/guest-abi.md "Tool ABI", beyond SPEAR) the host appends fresh pages to
the instance's memory and lays out, from the first new byte:

    args_ptr  args bytes + NUL            (8-aligned: it is a page boundary)
    out_ptr   output buffer of `cap` bytes (8-aligned)
    len_ptr   u32 LE length cell           (8-aligned)

With a tool arena (a program fork whose guest set tool_arena_ptr/len) the buffers follow
SPEAR's arena layout inside the existing memory (`abi.arena_layout`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from worker.errors import ToolRuntimeError
from worker.guest.abi import align8, arena_layout

WASM_PAGE_BYTES = 65_536
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class ScratchLayout:
    args_ptr: int
    out_ptr: int
    len_ptr: int
    grow_pages: int  # pages to append so that every buffer fits

    @property
    def end(self) -> int:
        return self.len_ptr + 4


def plan_scratch(
    base: int, args_len: int, cap: int, page_bytes: int = WASM_PAGE_BYTES
) -> ScratchLayout:
    """Lay out the buffers from `base`, the current end of memory (a page boundary)."""
    if base % page_bytes or args_len < 0 or cap < 0:
        raise ValueError(f"bad scratch request: base={base} args_len={args_len} cap={cap}")
    args_ptr = base
    out_ptr = args_ptr + align8(args_len + 1)  # +1: the NUL after the args
    len_ptr = out_ptr + align8(cap)
    needed = len_ptr + 4 - base
    return ScratchLayout(args_ptr, out_ptr, len_ptr, -(-needed // page_bytes))


@dataclass(frozen=True)
class ToolBuffers:
    """Where one attempt's args (+ NUL), output buffer and u32 length cell live."""

    args_ptr: int
    out_ptr: int
    cap: int  # output capacity, written into the length cell before the call
    len_ptr: int

    @property
    def end(self) -> int:
        return self.len_ptr + 4


def plan_arena(
    arena_ptr: int, arena_len: int, args_len: int, max_output_bytes: int, memory_len: int
) -> ToolBuffers | None:
    """SPEAR's arena layout, checked against a memory of `memory_len` bytes. ToolRuntimeError if
    the arena (or its length cell) lies outside the memory; None if the arena cannot hold the
    args, their NUL and a length cell (the host then uses scratch pages)."""
    if arena_ptr < 0 or arena_len < 0 or arena_ptr + arena_len > memory_len:
        raise ToolRuntimeError("tool arena outside memory")
    layout = arena_layout(arena_ptr, arena_len, args_len, max_output_bytes)
    if layout is None:
        return None
    # SPEAR's cell may end up to 3 bytes past an arena whose length is not a multiple of 8
    if layout.out_len_ptr + 4 > memory_len:
        raise ToolRuntimeError("tool arena outside memory")
    return ToolBuffers(layout.args_ptr, layout.out_ptr, layout.out_cap, layout.out_len_ptr)


def as_i32(value: int) -> int:
    """An address or length as the signed i32 a wasm32 function takes (>= 2 GiB wraps)."""
    value &= 0xFFFF_FFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def unpack_u32(raw: bytes | bytearray) -> int:
    return int(_U32.unpack(bytes(raw))[0])

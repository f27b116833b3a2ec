"""The `spear` hostcall ABI as pure data and functions (docs/guest-abi.md): errno numbers, flags,
commands, the write-with-len rule, SET_PARAM parsing (a tool's JSON: write_fn.py), epoll
records, the SPEAR tool-arena layout. No wasmtime here: the edge maps these onto guest memory."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

# Linux errno numbers (not wasi-libc's)
EPERM, ENOENT, EIO, EBADF, EAGAIN, ENOMEM, EACCES, EFAULT = 1, 2, 5, 9, 11, 12, 13, 14
EINVAL, ENOSPC, EPIPE, ENOSYS, ENOTCONN, ETIMEDOUT = 22, 28, 32, 38, 107, 110

FIRST_FD = 1000
LOG_MAX_BYTES = 16_384

# cchat_send flags
SEND_METRICS = 1
SEND_AUTO_TOOL_CALL = 2

# cchat_ctl commands
CTL_SET_PARAM = 1
CTL_GET_METRICS = 2

# spear_fd_ctl commands
FD_SET_FLAGS, FD_GET_FLAGS, FD_GET_KIND, FD_GET_STATUS, FD_GET_METRICS = 1, 2, 3, 4, 5
O_NONBLOCK = "O_NONBLOCK"

# epoll
EPOLL_CTL_ADD, EPOLL_CTL_MOD, EPOLL_CTL_DEL = 1, 2, 3
EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP = 0x1, 0x4, 0x8, 0x10
EPOLL_RECORD_BYTES = 8

# fd kinds as GET_KIND / GET_STATUS name them
KIND_SESSION = "ChatSession"
KIND_RESPONSE = "ChatResponse"
KIND_EPOLL = "Epoll"
KIND_USER_STREAM = "UserStream"
KIND_USER_STREAM_CTL = "UserStreamCtl"


def write_with_len_plan(capacity: int, data: bytes) -> tuple[int, bool]:
    """(value for *out_len_ptr, whether to write the bytes): the write-with-len rule."""
    return len(data), capacity >= len(data)


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """A guest's JSON argument as an object, or None (not JSON, not UTF-8, not an object)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def parse_set_param(raw: bytes) -> tuple[str, Any] | int:
    """`{"key":..,"value":..}` -> (key, value), or -EIO for bad JSON or an empty key."""
    obj = _json_object(raw)
    if obj is None or not isinstance(obj.get("key"), str) or not obj["key"]:
        return -EIO
    return obj["key"], obj.get("value")


def parse_flag_change(raw: bytes) -> tuple[set[str], set[str]] | int:
    """SET_FLAGS `{"set":[..],"clear":[..]}` -> (set, clear), or -EINVAL."""
    obj = _json_object(raw)
    if obj is None:
        return -EINVAL
    sets, clears = obj.get("set", []), obj.get("clear", [])
    if not isinstance(sets, list) or not isinstance(clears, list):
        return -EINVAL
    names = set(sets) | set(clears)
    if not all(isinstance(n, str) for n in names) or names - {O_NONBLOCK}:
        return -EINVAL
    return set(sets), set(clears)


def pack_epoll_records(ready: list[tuple[int, int]], capacity: int) -> tuple[bytes, int] | int:
    """Records sorted by fd, as many as fit; -ENOSPC when not even one fits (SPEAR v1)."""
    max_records = capacity // EPOLL_RECORD_BYTES
    if max_records == 0:
        return -ENOSPC
    chosen = sorted(ready)[:max_records]
    return b"".join(struct.pack("<ii", fd, ev) for fd, ev in chosen), len(chosen)


def align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class ArenaLayout:
    args_ptr: int
    out_ptr: int
    out_cap: int
    out_len_ptr: int


def arena_layout(
    arena_ptr: int, arena_len: int, args_len: int, max_output_bytes: int
) -> ArenaLayout | None:
    """SPEAR's tool arena: args, then the output buffer, then its length cell. None if the
    arena cannot hold the arguments plus a length cell."""
    out_ptr = arena_ptr + align8(args_len + 1)
    out_cap = min(arena_len - (out_ptr - arena_ptr) - 8, max_output_bytes)
    if out_cap < 0:
        return None
    return ArenaLayout(arena_ptr, out_ptr, out_cap, out_ptr + align8(out_cap))

"""Every hostcall a guest may import, declared once (docs/guest-abi.md sections 3, 4 and 6): its
module and name, its wasm signature, and how each mode serves it.

    program  a WASM agent program's run (host.ProgramHost)
    tool     a tool call: a program's tool in its fork, or a spec session's tool
             (fork.ToolModeHost)

A mode serves a hostcall with one of its parts (`Part`), whose method named `Hostcall.method`
runs it with the guest's memory and the call's arguments; or refuses it with an errno without
looking at its arguments (`Refused`); or does not link it (None: a program run links module
`spear` only). Imports of the UNSERVED_PREFIXES families link with any type and return
-ENOSYS in both modes.

Built from this table: the import types define_spear and define_tool_imports check
(imports.py), both hosts' dispatch (`dispatch_table`), and the tests' WAT helper
(tests/wat_program.py). Adding a hostcall is a row here and a method of the part serving it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from worker.guest import abi

I32, I64 = "i32", "i64"
SPEAR, CCHATQ = "spear", "cchatq"  # SPEAR's ABI; the tool ABI's own (sdk/c/cchatq_tool.h)
UNSERVED_PREFIXES = ("mic_", "rtasr_")  # SPEAR families this system does not serve

Mode = Literal["program", "tool"]
Handler = Callable[..., int | None]  # (mem, *args) -> the call's value (None: no result)


class Part(Enum):
    """Which part of a host serves a hostcall."""

    CHAT = "chat"  # host.ProgramHost itself: the chat hostcalls
    FDS = "fds"  # epoll.EpollCalls
    STREAMS = "streams"  # user_streams.UserStreamCalls
    SHARED = "shared"  # shared.SharedCalls, the same in both modes
    TOOL = "tool"  # fork.ToolModeHost itself: the tool ABI's imports


@dataclass(frozen=True)
class Refused:
    errno: int  # the call returns -errno


# a tool cannot start chats, touch the program's fds or talk to the program's user
DENIED = Refused(abi.EPERM)


@dataclass(frozen=True)
class Hostcall:
    name: str
    params: tuple[str, ...]  # wasm value types
    results: tuple[str, ...]
    program: Part | Refused | None
    tool: Part | Refused | None
    module: str = SPEAR

    @property
    def key(self) -> str:
        """The name a host's `hostcall` gets: NAME in module spear, else MODULE.NAME."""
        return self.name if self.module == SPEAR else f"{self.module}.{self.name}"

    @property
    def method(self) -> str:
        """The serving part's method: NAME in module spear, else MODULE_NAME."""
        return self.name if self.module == SPEAR else f"{self.module}_{self.name}"

    def served(self, mode: Mode) -> Part | Refused | None:
        return self.program if mode == "program" else self.tool


# name, params, results, how a program run serves it, how a tool call does (module spear
# unless named); the parameters are those of docs/guest-abi.md's tables
HOSTCALLS: tuple[Hostcall, ...] = (
    Hostcall("cchat_create",         (),         (I32,), Part.CHAT,    DENIED),
    Hostcall("cchat_write_msg",      (I32,) * 5, (I32,), Part.CHAT,    DENIED),
    Hostcall("cchat_write_fn",       (I32,) * 4, (I32,), Part.CHAT,    DENIED),
    Hostcall("cchat_ctl",            (I32,) * 4, (I32,), Part.CHAT,    DENIED),
    Hostcall("cchat_send",           (I32,) * 2, (I32,), Part.CHAT,    DENIED),
    Hostcall("cchat_recv",           (I32,) * 3, (I32,), Part.CHAT,    DENIED),
    Hostcall("cchat_close",          (I32,),     (I32,), Part.CHAT,    DENIED),
    Hostcall("log",                  (I32,) * 3, (I32,), Part.SHARED,  Part.SHARED),
    Hostcall("time_now_ms",          (),         (I64,), Part.SHARED,  Part.SHARED),
    Hostcall("wall_time_s",          (),         (I64,), Part.SHARED,  Part.SHARED),
    Hostcall("random_i64",           (),         (I64,), Part.SHARED,  Part.SHARED),
    Hostcall("sleep_ms",             (I32,),     (),     Part.SHARED,  Part.SHARED),
    Hostcall("spear_fd_ctl",         (I32,) * 4, (I32,), Part.FDS,     DENIED),
    Hostcall("spear_epoll_create",   (),         (I32,), Part.FDS,     DENIED),
    Hostcall("spear_epoll_ctl",      (I32,) * 4, (I32,), Part.FDS,     DENIED),
    Hostcall("spear_epoll_wait",     (I32,) * 4, (I32,), Part.FDS,     DENIED),
    Hostcall("spear_epoll_close",    (I32,),     (I32,), Part.FDS,     DENIED),
    Hostcall("user_stream_open",     (I32,) * 2, (I32,), Part.STREAMS, DENIED),
    Hostcall("user_stream_read",     (I32,) * 3, (I32,), Part.STREAMS, DENIED),
    Hostcall("user_stream_write",    (I32,) * 3, (I32,), Part.STREAMS, DENIED),
    Hostcall("user_stream_close",    (I32,),     (I32,), Part.STREAMS, DENIED),
    Hostcall("user_stream_ctl_open", (),         (I32,), Part.STREAMS, DENIED),
    Hostcall("user_stream_ctl_read", (I32,) * 3, (I32,), Part.STREAMS, DENIED),
    # the tool ABI's own: the call's retry number; a background call's progress (percent,
    # message pointer, length)
    Hostcall("attempt",              (),         (I32,), None,         Part.TOOL, CCHATQ),
    Hostcall("progress",             (I32,) * 3, (I32,), None,         Part.TOOL, CCHATQ),
)  # fmt: skip


def imports_of(module: str) -> dict[str, Hostcall]:
    """The declared imports of one wasm import module, by name."""
    return {h.name: h for h in HOSTCALLS if h.module == module}


SPEAR_IMPORTS = imports_of(SPEAR)
TOOL_IMPORTS = imports_of(CCHATQ)


def dispatch_table(mode: Mode, parts: Mapping[Part, Any]) -> dict[str, Handler]:
    """A host's hostcalls in `mode`, by `Hostcall.key`: the method of the part serving each
    (`parts` holds every part the mode uses), or its refusal. Unlinked ones are left out."""
    table: dict[str, Handler] = {}
    for call in HOSTCALLS:
        how = call.served(mode)
        if isinstance(how, Refused):
            table[call.key] = _refusal(how.errno)
        elif how is not None:
            table[call.key] = getattr(parts[how], call.method)
    return table


def _refusal(errno: int) -> Handler:
    def refuse(mem: Any, *args: int) -> int:
        return -errno

    return refuse

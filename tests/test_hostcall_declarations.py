"""The one declaration of every hostcall (worker/guest/hostcalls.py) and what is built from
it: each host's dispatch serves exactly what its mode declares, with a handler taking the
declared arguments, and a refused call answers its errno before looking at anything."""

from __future__ import annotations

import inspect
import time

import pytest

from tests.wat_program import SPEAR_SIGS
from worker.guest.fork import ToolModeHost
from worker.guest.host import ChatDefaults, ProgramHost
from worker.guest.hostcalls import (
    CCHATQ,
    DENIED,
    HOSTCALLS,
    SPEAR,
    SPEAR_IMPORTS,
    TOOL_IMPORTS,
    Hostcall,
    Mode,
    Part,
    Refused,
)
from worker.session.twins.queue import StepQueue
from worker.session.twins.store import MemoryStore

EPERM = 1


def program_host() -> ProgramHost:
    defaults = ChatDefaults("decl", "decl#1", "0" * 64, None, None, time.monotonic() + 30)
    return ProgramHost(defaults, MemoryStore(), StepQueue())


def served(mode: Mode) -> list[Hostcall]:
    return [h for h in HOSTCALLS if h.served(mode) is not None]


def test_names_are_declared_once_and_every_type_is_a_wasm_number() -> None:
    assert len({(h.module, h.name) for h in HOSTCALLS}) == len(HOSTCALLS)
    assert {h.module for h in HOSTCALLS} == {SPEAR, CCHATQ}
    assert all(t in ("i32", "i64") for h in HOSTCALLS for t in h.params + h.results)
    assert all(len(h.results) <= 1 for h in HOSTCALLS)
    assert list(SPEAR_IMPORTS) + list(TOOL_IMPORTS) == [h.name for h in HOSTCALLS]


def test_the_wat_helper_signatures_are_the_declared_ones() -> None:
    assert {
        h.name: (h.params, h.results[0] if h.results else None)
        for h in HOSTCALLS
        if h.module == SPEAR
    } == SPEAR_SIGS


@pytest.mark.parametrize("mode", ["program", "tool"])
def test_each_host_serves_what_its_mode_declares_with_the_declared_arguments(
    mode: Mode,
) -> None:
    host = program_host() if mode == "program" else ToolModeHost()
    table = host._calls
    assert sorted(table) == sorted(h.key for h in served(mode))
    for h in served(mode):
        if isinstance(h.served(mode), Part):
            params = inspect.signature(table[h.key]).parameters
            assert len(params) == 1 + len(h.params), h.key  # the guest's memory, then its args


def test_a_program_links_spear_only_and_a_tool_is_refused_the_program_only_calls() -> None:
    assert [h.key for h in served("program")] == [h.name for h in HOSTCALLS if h.module == SPEAR]
    program_only = [h.key for h in HOSTCALLS if h.program in (Part.CHAT, Part.FDS, Part.STREAMS)]
    refused = [h.key for h in HOSTCALLS if isinstance(h.tool, Refused)]
    assert refused == program_only
    assert all(h.tool == DENIED for h in HOSTCALLS if h.key in refused)
    host = ToolModeHost()
    for key in refused:  # -EPERM before the memory or the arguments are looked at
        assert host.hostcall(key, None, ()) == -EPERM  # type: ignore[arg-type]
    assert host.hostcall("cchatq.attempt", None, ()) == 0  # type: ignore[arg-type]
    assert host.hostcall("frobnicate", None, ()) == -38  # type: ignore[arg-type]

"""The hostcalls a program run and a tool call both serve (docs/guest-abi.md section 6): `log`,
`time_now_ms`, `wall_time_s`, `random_i64` and `sleep_ms`, one implementation for both.

What differs by mode is given to it: where a `log` line goes (a program's run log, a tool
call's bounded ToolLogs), the deadline that bounds a sleep, and the check a sleep makes
before each slice (a program's deadline and cancellation, which raise RunAborted; a tool's
watcher, which may stop a background call).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from worker.guest import abi
from worker.guest.imports import GuestMemory

SLEEP_SLICE_S = 1.0  # a sleep's check runs at least this often


class SharedCalls:
    """`log_line(level, text)` takes a checked `log` line; `deadline()` is the
    time.monotonic() value a sleep never passes (None: no bound); `check()` runs before each
    slice of a sleep, and at its end when the deadline cut it short; it raises to stop it."""

    def __init__(
        self,
        log_line: Callable[[int, str], None],
        deadline: Callable[[], float | None],
        check: Callable[[], None],
    ) -> None:
        self._log_line = log_line
        self._deadline = deadline
        self._check = check

    def log(self, mem: GuestMemory, level: int, ptr: int, length: int) -> int:
        # a length is a u32, as every length of the ABI: a negative i32 is over the cap
        if length & 0xFFFF_FFFF > abi.LOG_MAX_BYTES or not 0 <= level <= 4:
            return -abi.EINVAL
        text = mem.read(ptr, length).decode("utf-8", "replace")  # GuestFault -> -EFAULT
        self._log_line(level, text)
        return 0

    def time_now_ms(self, mem: GuestMemory) -> int:
        return time.time_ns() // 1_000_000  # integer time: no float rounding at a ms boundary

    def wall_time_s(self, mem: GuestMemory) -> int:
        return time.time_ns() // 1_000_000_000

    def random_i64(self, mem: GuestMemory) -> int:
        return int.from_bytes(os.urandom(8), "little", signed=True)

    def sleep_ms(self, mem: GuestMemory, ms: int) -> None:
        end = time.monotonic() + max(ms, 0) / 1000
        deadline = self._deadline()
        stop = end if deadline is None else min(end, deadline)
        while time.monotonic() < stop:
            self._check()
            time.sleep(max(0.0, min(stop - time.monotonic(), SLEEP_SLICE_S)))
        if stop < end:
            self._check()  # cut short by the deadline: a program's check ends its run here
        return None

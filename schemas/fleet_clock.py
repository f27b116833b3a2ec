"""The fleet's clock: Redis's (TIME). What one process stamps and another compares (when a
session was submitted, its marks of progress, when a retried step falls due) is on this clock,
so hosts whose wall clocks disagree (by minutes, even) agree on how old a session is and when
it last moved. Leases and heartbeats need none of it: they are durations kept by Redis (PX, EX).

A process reads it as its own wall clock plus an offset to Redis's, measured at first use and
again every `refresh_s` by the call that finds it due (one TIME command then, or up to three
when the round trips are slow: the quickest gives the offset; none per step),
and at once when the host's wall clock jumped against its monotonic clock (a clock stepped by
NTP or by hand). Shared by the producer and the worker: both sides of a comparison read it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

REFRESH_S = 30.0  # drift between two measures is ppm: this only bounds how long a change lasts
RETRY_S = 1.0  # after a measure that failed (Redis away): the offset kept until then
JUMP_MS = 1_000  # wall and monotonic clocks disagreeing by this much: the wall clock was set
SAMPLES = 3  # round trips at most a measure takes, the quickest kept
QUICK_MS = 1.0  # a round trip this quick gives the offset to half of it: no other one taken


def wall_ms() -> float:
    return time.time_ns() / 1_000_000


def server_ms(reply: tuple[int, int] | list[int]) -> float:
    """Milliseconds of a Redis TIME reply (seconds, microseconds)."""
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) / 1000


class FleetClock:
    """Redis's clock as this process reads it. `read_server_ms` asks Redis (TIME) and may
    raise: a clock that cannot measure keeps the offset it had (none, before its first
    measure) and tries again after RETRY_S; the command that needed the time meets the same
    failure on its own. Thread-safe: one thread measures, the others wait for its result."""

    def __init__(
        self,
        read_server_ms: Callable[[], float],
        refresh_s: float = REFRESH_S,
        wall: Callable[[], float] = wall_ms,
        monotonic_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read_server_ms = read_server_ms
        self.refresh_s = refresh_s
        self.wall = wall
        self.monotonic_s = monotonic_s
        self.measures = 0  # TIME commands sent (tests, the report)
        self._offset_ms = 0.0
        self._measured = False
        self._next_s = float("-inf")  # monotonic time of the next measure
        self._wall0 = self._mono0 = 0.0  # the clocks at the last measure (a jump's reference)
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        """Now on Redis's clock, in milliseconds since the epoch."""
        return int(self.wall() + self.offset_ms())

    def offset_ms(self) -> float:
        """Redis's clock minus this host's wall clock (measured first when due)."""
        if self._due():
            with self._lock:
                if self._due():  # another thread may have measured meanwhile
                    self._measure()
        return self._offset_ms

    def _due(self) -> bool:
        mono = self.monotonic_s()
        if mono >= self._next_s:
            return True
        drift_ms = (self.wall() - self._wall0) - (mono - self._mono0) * 1000
        return abs(drift_ms) > JUMP_MS

    def _measure(self) -> None:
        """The offset from the quickest of up to SAMPLES round trips: a reply is stamped about
        halfway through its round trip, so the error is at most half of it, and a round trip
        stretched by a busy host (a stall on either side) would shift the offset by as much."""
        best_ms = float("inf")
        for _ in range(SAMPLES):
            before = self.wall()
            try:
                server = self.read_server_ms()
            except Exception:  # Redis away: the offset it had until the next try
                if best_ms == float("inf"):
                    self._next_s = self.monotonic_s() + RETRY_S
                    if not self._measured:  # no reference yet for a jump
                        self._wall0, self._mono0 = self.wall(), self.monotonic_s()
                    return
                break
            after = self.wall()
            if after - before < best_ms:
                best_ms = after - before
                self._offset_ms = server - (before + after) / 2
            if best_ms <= QUICK_MS:
                break
        self._measured = True
        self.measures += 1
        self._mono0 = self.monotonic_s()
        self._wall0 = self.wall()
        self._next_s = self._mono0 + self.refresh_s

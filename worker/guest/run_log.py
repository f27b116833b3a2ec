"""A program run's log, as its record shows it (`logs`): its own `log` lines, the `warn` lines
of what its hostcalls refused, and its chats' tool lines where it saw each chat end.

Bounded per run (schemas.limits RUN_LOG_MAX_LINES lines, RUN_LOG_MAX_BYTES bytes of text): a
line past the bound is only counted, so a chatty program costs the worker's memory and its
record in Redis at most that, and the log ends with one `warn` line saying how many were
dropped."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from schemas.limits import RUN_LOG_MAX_BYTES, RUN_LOG_MAX_LINES


class RunLog:
    def __init__(
        self, max_lines: int = RUN_LOG_MAX_LINES, max_bytes: int = RUN_LOG_MAX_BYTES
    ) -> None:
        self.lines: list[dict[str, Any]] = []
        self.dropped = 0  # lines not kept
        self._max_lines = max_lines
        self._max_bytes = max_bytes
        self._room = max_bytes

    def add(self, line: dict[str, Any]) -> None:
        """One line: its `level` and `message` (and, a tool's, the call that wrote it)."""
        size = len(str(line.get("message", "")).encode())
        if len(self.lines) >= self._max_lines or size > self._room:
            self.dropped += 1
            return
        self._room -= size
        self.lines.append(line)

    def extend(self, lines: Iterable[dict[str, Any]]) -> None:
        for line in lines:
            self.add(line)

    def entries(self) -> list[dict[str, Any]]:
        """The lines kept, and a last one saying how many were not, if any."""
        if not self.dropped:
            return list(self.lines)
        note = (
            f"{self.dropped} more line(s) of this run dropped: a program run keeps at most "
            f"{self._max_lines} log lines, {self._max_bytes >> 10} KiB"
        )
        return [*self.lines, {"level": "warn", "message": note, "dropped": self.dropped}]

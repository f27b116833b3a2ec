"""What one tool call wrote for its user to read: its `log` hostcall lines
and its WASI stdout/stderr, in the order it wrote them, over every attempt of the call.

Bounded per call (MAX_LINES lines, MAX_BYTES bytes of text): later lines are only counted, so a
chatty tool costs the store and the record at most that. They are stored with the call's outcome
and shown in the session's record; being the tool's own text (it may echo its arguments), they
never go to trace events or worker log lines (those get counts only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LEVELS = ("trace", "debug", "info", "warn", "error")  # the `log` hostcall's levels 0..4
MAX_LINES = 64
MAX_BYTES = 16 << 10
STREAMS = ("log", "stdout", "stderr")


@dataclass(frozen=True)
class ToolLogLine:
    """One line: from the `log` hostcall (its level) or a WASI stream (level info)."""

    level: str
    message: str
    stream: str  # one of STREAMS
    attempt: int = 0  # the retry that wrote it (0: the first try)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"level": self.level, "message": self.message, "stream": self.stream}
        if self.attempt:
            out["attempt"] = self.attempt
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ToolLogLine:
        return cls(
            level=str(raw["level"]),
            message=str(raw["message"]),
            stream=str(raw.get("stream", "log")),
            attempt=int(raw.get("attempt", 0)),
        )


class ToolLogs:
    """The lines of one call as they come. `attempt` is set by whoever starts each attempt;
    `write` takes stream bytes in any pieces and makes lines of them (`flush` ends the last)."""

    def __init__(self, max_lines: int = MAX_LINES, max_bytes: int = MAX_BYTES) -> None:
        self.lines: list[ToolLogLine] = []
        self.dropped = 0  # lines not kept
        self.attempt = 0
        self._max_lines = max_lines
        self._room = max_bytes
        self._pending: dict[str, bytearray] = {}  # a stream's unfinished line
        self._skipping: set[str] = set()  # streams in a line too long to keep

    def log(self, level: int, text: str) -> None:
        """A `log` hostcall line (level already checked, 0..4)."""
        self._add(ToolLogLine(LEVELS[level], text, "log", self.attempt))

    def write(self, stream: str, data: bytes) -> None:
        """Bytes the tool wrote to its stdout or stderr: each finished line is one line."""
        pending = self._pending.setdefault(stream, bytearray())
        pending += data
        *done, rest = pending.split(b"\n")
        for line in done:
            if stream in self._skipping:  # the end of a line already counted as dropped
                self._skipping.discard(stream)
            else:
                self._add_bytes(stream, bytes(line))
        if len(rest) > self._room and stream not in self._skipping:
            self.dropped += 1  # too long to keep whatever follows: count it, hold none of it
            self._skipping.add(stream)
        self._pending[stream] = bytearray() if stream in self._skipping else bytearray(rest)

    def flush(self) -> None:
        """End the unfinished line of each stream (the call is over)."""
        for stream, rest in self._pending.items():
            if rest:
                self._add_bytes(stream, bytes(rest))
        self._pending.clear()
        self._skipping.clear()

    def _add_bytes(self, stream: str, line: bytes) -> None:
        text = line.removesuffix(b"\r").decode("utf-8", "replace")
        self._add(ToolLogLine("info", text, stream, self.attempt))

    def _add(self, line: ToolLogLine) -> None:
        size = len(line.message.encode())
        if len(self.lines) >= self._max_lines or size > self._room:
            self.dropped += 1
            return
        self._room -= size
        self.lines.append(line)


def record_entries(
    mark: dict[str, Any], lines: tuple[ToolLogLine, ...], dropped: int
) -> list[dict[str, Any]]:
    """A call's lines as a record shows them, each with `mark` (its call id, round, tool) and
    `source: tool`; a call that wrote past the bound ends with a line saying how much."""
    mark = {**mark, "source": "tool"}
    out = [{**mark, **line.to_json()} for line in lines]
    if dropped:
        note = (
            f"{dropped} more line(s) of this call dropped: a tool call keeps at most "
            f"{MAX_LINES} lines, {MAX_BYTES >> 10} KiB"
        )
        out.append(
            {**mark, "level": "warn", "message": note, "stream": "cchatq", "dropped": dropped}
        )
    return out

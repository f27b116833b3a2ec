"""Server-sent events: bytes in, `SseEvent`s out. Pure: no I/O.

Follows the WHATWG event-stream rules: lines end in LF, CRLF or CR (a CRLF split across two
reads is one line end); `field: value` with one optional space after the colon; several
`data:` lines join with "\\n"; a blank line dispatches; `:` lines are comments (keep-alives);
an unknown field is ignored; `id` persists until the stream sets another (the "last event
id"); `retry:` is kept in `retry_ms`. A block with no `data:` line dispatches nothing.
Unlike a browser, `close()` also dispatches a final event that lacks its blank line.
"""

from __future__ import annotations

import codecs
import re

from worker.codecs.protocol import SseEvent

_BOM = "\ufeff"
_LINE_END = re.compile(r"\r\n|\r|\n")


class SseParser:
    """Incremental: `feed` any split of the body, then `close` once at its end."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending: list[str] = []  # text after the last line end
        self._skip_lf = False  # the previous read ended in CR: a leading LF belongs to it
        self._at_start = True  # a UTF-8 BOM is stripped once, at the start of the stream
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None
        self.retry_ms: int | None = None  # the server's reconnection hint, if it sent one

    def feed(self, data: bytes) -> list[SseEvent]:
        return self._consume(self._decoder.decode(data), final=False)

    def close(self) -> list[SseEvent]:
        """End of body: a last line without its line end, and an event without its blank line."""
        return self._consume(self._decoder.decode(b"", final=True), final=True)

    def _consume(self, text: str, final: bool) -> list[SseEvent]:
        if self._at_start and text:
            self._at_start = False
            text = text.removeprefix(_BOM)
        if self._skip_lf and text:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
        if not final and "\n" not in text and "\r" not in text:
            if text:
                self._pending.append(text)  # a long line in many reads stays linear
            return []
        buffer = "".join(self._pending) + text
        events: list[SseEvent] = []
        start = 0
        for match in _LINE_END.finditer(buffer):
            self._line(buffer[start : match.start()], events)
            start = match.end()
            if match.group() == "\r" and start == len(buffer):
                self._skip_lf = True  # its LF, if any, comes with the next read
        rest = buffer[start:]
        self._pending = [rest] if rest else []
        if final:
            if rest:
                self._line(rest, events)
                self._pending = []
            self._dispatch(events)
        return events

    def _line(self, line: str, events: list[SseEvent]) -> None:
        if not line:
            self._dispatch(events)
            return
        if line[0] == ":":
            return  # a comment: `: keep-alive`, `: OPENROUTER PROCESSING`
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\x00" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)

    def _dispatch(self, events: list[SseEvent]) -> None:
        if self._data:
            events.append(SseEvent(self._event or "message", "\n".join(self._data), self._last_id))
        self._data = []
        self._event = ""


def looks_like_sse(content_type: str) -> bool:
    """Only `text/event-stream` is read as a stream; a JSON error body or a proxy's
    HTML page answering a stream request is an HTTP error, not an empty stream."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "text/event-stream"

"""Streams of the `<tool_call>` text-tag protocol: display Deltas that never show a tag,
even one split across chunks, and at the end the same result as `decode`. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from worker.codecs.openai_stream import OpenAIStreamAssembler
from worker.codecs.protocol import Delta, SseEvent
from worker.codecs.text_tags_parse import (
    CALL_CLOSE,
    CALL_OPEN,
    FENCE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    apply_text_tags,
)


class TextTagAssembler:
    """OpenAI chunks; content Deltas show only text outside tags, never a half tag
    (a suffix that may open one is held back), `<think>` text as reasoning. `result()` parses
    the final content exactly like `decode`."""

    def __init__(self, parse_calls: bool = True) -> None:
        self._inner = OpenAIStreamAssembler()
        self._parse_calls = parse_calls
        self._view = VisibleText(parse_calls)

    @property
    def finished(self) -> bool:
        return self._inner.finished

    @property
    def progress(self) -> int:
        return self._inner.progress  # text inside a tag is held back, but it is content

    def feed(self, event: SseEvent) -> list[Delta]:
        out: list[Delta] = []
        for delta in self._inner.feed(event):
            out.extend(self._view.push(delta.text) if delta.kind == "content" else [delta])
        if self._inner.finished:
            out.extend(self._view.flush())
        return out

    def result(self) -> dict[str, Any]:
        return apply_text_tags(self._inner.result(), self._parse_calls)


_CLOSERS = {"call": CALL_CLOSE, "think": THINK_CLOSE, "fence": FENCE}
_SHOWN_AS: dict[str, str | None] = {"text": "content", "fence": "content", "think": "reasoning"}


class VisibleText:
    """Streamed content -> display Deltas: fenced text shown, tool calls and made-up
    responses hidden, reasoning routed apart. Display only: the result never depends on it."""

    def __init__(self, parse_calls: bool = True) -> None:
        self._mode = "text"  # text | call | think | fence | cut
        self._held = ""
        self._last = ""  # the last character shown: a backtick makes `<tool_call>` prose
        self._openers = {FENCE: "fence", THINK_OPEN: "think", RESPONSE_OPEN: "cut"}
        if parse_calls:
            self._openers[CALL_OPEN] = "call"

    def push(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        buf = self._held + text
        self._held = ""
        while buf and self._mode != "cut":
            if self._mode == "text":
                hits = [(i, t) for t in self._openers if (i := buf.find(t)) >= 0]
                if not hits:
                    keep = _partial_suffix(buf, tuple(self._openers))
                    self._emit(out, buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                i, tag = min(hits)
                if tag == CALL_OPEN and (buf[i - 1] if i else self._last) == "`":
                    self._emit(out, buf[: i + len(tag)])
                    buf = buf[i + len(tag) :]
                    continue
                self._emit(out, buf[:i] + (tag if tag == FENCE else ""))
                self._mode, buf = self._openers[tag], buf[i + len(tag) :]
                continue
            closer = _CLOSERS[self._mode]
            j = buf.find(closer)
            if j < 0:
                keep = _partial_suffix(buf, (closer,))
                self._emit(out, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            self._emit(out, buf[:j] + (closer if self._mode == "fence" else ""))
            self._mode, buf = "text", buf[j + len(closer) :]
        return out

    def flush(self) -> list[Delta]:
        out: list[Delta] = []
        if self._mode != "cut":
            self._emit(out, self._held)
        self._held = ""
        return out

    def _emit(self, out: list[Delta], text: str) -> None:
        kind = _SHOWN_AS.get(self._mode)
        if text and kind == "content":
            out.append(Delta("content", text))
            self._last = text[-1]
        elif text and kind == "reasoning":
            out.append(Delta("reasoning", text))


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that could begin one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best

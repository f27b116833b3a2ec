"""Reading spec files' JSON: a JSONL file line by line in binary (each line decoded on its
own, so one bad line is one issue), a .json file whole; strict about what JSON can write but
nothing later can use (nesting past MAX_DEPTH, numbers past a float's range, lone surrogates).
Every problem is a SpecIssue on its line; an issue renders as one line."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

JSON_WHITESPACE = " \t\n\r"
# Containers nested deeper than this are refused: the schema checks (jsonschema's metaschema
# walk of a tool's parameters above all) recurse, and Python's stack is not the place to find
# out. 64 leaves a tool's JSON Schema some 29 levels of its own.
MAX_DEPTH = 64
MAX_LINE_BYTES = 64 << 20  # one spec line; a longer one is skipped unread, as one issue
PROGRESS_EVERY_S = 0.25
UTF8_BOM = b"\xef\xbb\xbf"
# Called while a file is validated, at most every PROGRESS_EVERY_S and once at the end:
# (lines read, bytes read, the file's size in bytes).
ProgressHook = Callable[[int, int, int], None]


@dataclass(frozen=True)
class SpecIssue:
    path: str
    line: int  # 1-based physical line; 0 for problems with the file as a whole
    field: str
    message: str

    def __str__(self) -> str:
        # a problem with the file as a whole names no line: `nope.jsonl: no such file`
        where = printable(self.path) + (f":{self.line}" if self.line else "")
        if self.field:
            return f"{where}: {printable(self.field)}: {printable(self.message)}"
        return f"{where}: {printable(self.message)}"


def file_problem(exc: BaseException) -> str:
    """Why a file could not be read, in a few words: `no such file`, `is a directory`."""
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    if isinstance(exc, IsADirectoryError):
        return "is a directory, not a file"
    if isinstance(exc, PermissionError):
        return "cannot read: permission denied"
    if isinstance(exc, UnicodeDecodeError):
        return "cannot read: not UTF-8 text"
    if isinstance(exc, OSError) and exc.strerror:
        return f"cannot read: {exc.strerror}"
    return f"cannot read: {exc}"


def printable(text: str) -> str:
    """`text` on one line: each character that is not printable (newlines, NUL, escapes,
    U+2028, lone surrogates) as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# --- values JSON can hold but nothing later can use -------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def screen_value(obj: Any) -> list[tuple[str, str]]:
    """(field, message) for each container nested deeper than MAX_DEPTH (the top-level object
    is level 1), each number that is not finite, and each key or string holding a lone
    surrogate, in document order. Iterative: any depth is walked without recursion."""
    return screen_object(obj)[0]


_PLAIN_TYPES = frozenset((dict, list, str, int, float, bool, type(None)))


def screen_object(obj: Any) -> tuple[list[tuple[str, str]], bool]:
    """screen_value's problems, and whether `obj` holds only JSON's own types (dicts with str
    keys, lists, str, int, float, bool, None): what the fast path takes."""
    problems: list[tuple[str, str]] = []
    plain = True
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(obj, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if plain and type(value) not in _PLAIN_TYPES:
            plain = False
        if isinstance(value, Mapping):
            if depth > MAX_DEPTH:
                problems.append((_path(path[:2]), f"nested deeper than {MAX_DEPTH} levels"))
                continue
            items = list(value.items())
            for key, _ in items:
                if type(key) is not str:
                    plain = False
                if isinstance(key, str) and _lone_surrogate(key):
                    problems.append((_path((*path, key)), _surrogate_message(key, "key")))
            stack.extend((item, (*path, key), depth + 1) for key, item in reversed(items))
        elif isinstance(value, list | tuple):
            if depth > MAX_DEPTH:
                problems.append((_path(path[:2]), f"nested deeper than {MAX_DEPTH} levels"))
                continue
            stack.extend((value[i], (*path, i), depth + 1) for i in reversed(range(len(value))))
        elif isinstance(value, str):
            if _lone_surrogate(value):
                problems.append((_path(path), _surrogate_message(value, "string")))
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append((_path(path), "numbers must be finite"))
    return problems, plain


def _lone_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _surrogate_message(text: str, what: str) -> str:
    found = _SURROGATE.search(text)
    assert found is not None
    return f"{what} holds a lone surrogate ({repr(found.group())[1:-1]}): not valid Unicode"


def _path(parts: Iterable[Any]) -> str:
    return ".".join(path_key(p) for p in parts)


# --- reading ----------------------------------------------------------------------------


class _NonFinite(Exception):
    """A JSON number out of float's range (1e400): the line is walked to name its field."""


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NonFinite
    return value


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are Python extensions, not JSON; upstream APIs would reject them later.
    raise ValueError(f"{name} is not valid JSON")


_STRICT = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_LENIENT = json.JSONDecoder(parse_constant=_reject_constant)
_TOO_DEEP = f"invalid JSON: nested deeper than {MAX_DEPTH} levels"


class JsonlReader:
    """A JSONL file's specs: (line, value, whether to screen it), one line at a time. A line
    that cannot be decoded is one issue; the next line is read all the same."""

    def __init__(
        self,
        fh: IO[bytes],
        shown: str,
        issues: list[SpecIssue],
        size: int,
        on_progress: ProgressHook | None,
    ) -> None:
        self.fh, self.shown, self.issues, self.size = fh, shown, issues, size
        self.on_progress = on_progress
        self.bytes_read = 0

    def __iter__(self) -> Iterator[tuple[int, Any, bool]]:
        readline, issues, shown = self.fh.readline, self.issues, self.shown
        progress, next_report = self.on_progress, time.monotonic() + PROGRESS_EVERY_S
        number = 0
        limit = MAX_LINE_BYTES
        while raw := readline(limit + 1):
            number += 1
            self.bytes_read += len(raw)
            # the clock is read every 64 lines: a report is due at most every PROGRESS_EVERY_S
            if progress is not None and not number & 63 and time.monotonic() >= next_report:
                progress(number, self.bytes_read, self.size)
                next_report = time.monotonic() + PROGRESS_EVERY_S
            if len(raw) > limit and not raw.endswith(b"\n"):
                self._skip_rest()
                message = f"line longer than {limit:,} bytes: not read"
                issues.append(SpecIssue(shown, number, "", message))
                continue
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            if number == 1 and raw.startswith(UTF8_BOM):  # some editors write one
                raw = raw[len(UTF8_BOM) :]
            stripped = raw.strip()
            if not stripped or stripped.startswith(b"#"):
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                issues.append(SpecIssue(shown, number, "", _bad_utf8(raw, exc.start)))
                continue
            screen = False
            try:
                try:
                    # the raw line, not the stripped one, so columns are physical columns
                    obj = _STRICT.decode(text)
                except _NonFinite:
                    obj, screen = _LENIENT.decode(text), True
            except json.JSONDecodeError as exc:
                message = f"invalid JSON: {exc.msg} (column {exc.colno})"
                issues.append(SpecIssue(shown, number, "", message))
                continue
            except RecursionError:
                issues.append(SpecIssue(shown, number, "", _TOO_DEEP))
                continue
            except ValueError as exc:
                issues.append(SpecIssue(shown, number, "", f"invalid JSON: {exc}"))
                continue
            # Only a line with enough brackets can nest too deep, and only a \uD800-\uDFFF
            # escape can make a surrogate (a strict UTF-8 decode refuses encoded ones).
            screen = (
                screen
                or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
                or b"\\ud" in raw
                or b"\\uD" in raw
            )
            yield number, obj, screen
        if progress is not None:
            progress(number, self.bytes_read, self.size)

    def _skip_rest(self) -> None:
        while chunk := self.fh.readline(1 << 20):
            self.bytes_read += len(chunk)
            if chunk.endswith(b"\n"):
                return


def _bad_utf8(raw: bytes, start: int) -> str:
    column = len(raw[:start].decode("utf-8", "replace")) + 1
    return f"invalid UTF-8: byte 0x{raw[start]:02x} at column {column}"


def json_entries(data: bytes, shown: str, issues: list[SpecIssue]) -> list[tuple[int, Any]]:
    """A .json file: one object, or an array of objects each reported at the line where it
    starts. The top-level array is walked by hand, decoding each item with raw_decode,
    because json.loads keeps no positions."""
    if data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line = data.count(b"\n", 0, exc.start) + 1
        issues.append(
            SpecIssue(shown, line, "", _bad_utf8(data[line_start:], exc.start - line_start))
        )
        return []
    return _parse_json(text, shown, issues)


def _parse_json(text: str, shown: str, issues: list[SpecIssue]) -> list[tuple[int, Any]]:
    decoder = _LENIENT  # every item is screened: a non-finite number is named there

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in JSON_WHITESPACE:
            pos += 1
        return pos

    def fail(pos: int, message: str) -> list[tuple[int, Any]]:
        issues.append(SpecIssue(shown, line_of(pos), "", f"invalid JSON: {message}"))
        return []

    pos = skip(0)
    if pos == len(text):
        return []
    entries: list[tuple[int, Any]] = []
    start = pos
    try:
        if text[pos] != "[":
            obj, pos = decoder.raw_decode(text, pos)
            entries.append((line_of(start), obj))
        else:
            pos = skip(pos + 1)
            if text.startswith("]", pos):
                pos += 1
            else:
                while True:
                    start = pos
                    obj, pos = decoder.raw_decode(text, start)
                    entries.append((line_of(start), obj))
                    pos = skip(pos)
                    if text.startswith(",", pos):
                        pos = skip(pos + 1)
                    elif text.startswith("]", pos):
                        pos += 1
                        break
                    else:
                        return fail(pos, f"expected ',' or ']' (column {_column(text, pos)})")
    except json.JSONDecodeError as exc:
        return fail(exc.pos, f"{exc.msg} (column {exc.colno})")
    except RecursionError:
        return fail(start, _TOO_DEEP.removeprefix("invalid JSON: "))
    except ValueError as exc:
        return fail(pos, str(exc))
    pos = skip(pos)
    if pos != len(text):
        return fail(pos, f"extra data after the top-level value (column {_column(text, pos)})")
    return entries


def _column(text: str, pos: int) -> int:
    return pos - (text.rfind("\n", 0, pos) + 1) + 1


def json_type(obj: Any) -> str:
    names: Iterable[tuple[type, str]] = (
        (bool, "boolean"),
        (int, "number"),
        (float, "number"),
        (str, "string"),
        (list, "array"),
    )
    for kind, name in names:
        if isinstance(obj, kind):
            return name
    return "null" if obj is None else type(obj).__name__


def path_key(key: Any) -> str:
    """A path component: an empty key shows as "" (else the field would read as none)."""
    return str(key) or '""'

"""Load and validate a whole spec file before anything is enqueued.

Every problem in the file is collected and reported at once (path:line: field: message),
so a producer fixes a batch in one pass instead of one error per submit. No input, however
malformed, ends in another exception: a line that is not UTF-8, JSON nested deeper than
MAX_DEPTH, a number JSON can write but nothing can use (1e400 reads as infinity), a string
holding a lone surrogate (it has no UTF-8 form, so the spec could not be stored) is each an
issue on its line, naming the field when the problem is inside an object. An issue renders
as one line: control characters in paths, fields and messages are shown escaped.

A JSONL file is streamed: read in binary a line at a time, each line decoded on its own (one
bad line is one issue; the rest of the file is still checked), so validation holds the specs
it returns and one line, never the file's text. A .json file (one object, or an array of
them) is read whole.

A session spec in the common shapes is loaded by producer/fast_specs.py (its tools, flags,
limits and permissions validated once per distinct content); anything else, and anything
invalid, goes through the schemas, which word every issue.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from marshmallow import ValidationError

from producer.fast_specs import FastSessions
from producer.modules import ModuleChecker
from schemas.program_spec import ProgramSpecSchema, is_program
from schemas.spec import SessionSpecSchema
from schemas.spec_types import ProgramSpec, Spec

MAX_LISTED_ISSUES = 20
JSON_WHITESPACE = " \t\n\r"
# Containers nested deeper than this are refused: the schema checks (jsonschema's metaschema
# walk of a tool's parameters above all) recurse, and Python's stack is not the place to find
# out. 64 leaves a tool's JSON Schema some 29 levels of its own.
MAX_DEPTH = 64
MAX_LINE_BYTES = 64 << 20  # one spec line; a longer one is skipped unread, as one issue
PROGRESS_EVERY_S = 0.25
UTF8_BOM = b"\xef\xbb\xbf"
# marshmallow files errors about an object as a whole under "_schema", and the "Unknown
# field." of a key named "_schema" lands there too: that one message names the key.
SCHEMA_ERRORS = "_schema"
UNKNOWN_FIELD = "Unknown field."


@dataclass(frozen=True)
class SpecIssue:
    path: str
    line: int  # 1-based physical line; 0 for problems with the file as a whole
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{printable(self.path)}:{self.line}"
        if self.field:
            return f"{where}: {printable(self.field)}: {printable(self.message)}"
        return f"{where}: {printable(self.message)}"


class SpecFileError(Exception):
    def __init__(self, issues: Sequence[SpecIssue]) -> None:
        self.issues: list[SpecIssue] = list(issues)
        lines = [str(issue) for issue in self.issues[:MAX_LISTED_ISSUES]]
        hidden = len(self.issues) - MAX_LISTED_ISSUES
        if hidden > 0:
            lines.append(f"... and {hidden} more")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class LoadedSpec:
    line: int
    spec: Spec


# A check of a spec that passed the schema, against what the file cannot say by itself (the
# fleet's configuration: its backends and their keys): (field, message) per problem.
SpecCheck = Callable[[Spec], list[tuple[str, str]]]
# Called while a file is validated, at most every PROGRESS_EVERY_S and once at the end:
# (lines read, bytes read, the file's size in bytes).
ProgressHook = Callable[[int, int, int], None]


@dataclass(frozen=True)
class Conversion:
    """What a SpecConvert makes of one parsed object: the object to validate as a spec and how
    its issues' fields are named (in the input's own terms), or the problems that stop it."""

    obj: Any = None
    problems: Sequence[tuple[str, str]] = ()  # (field, message): the object is not validated
    field_name: Callable[[str], str] | None = None  # a spec field -> the input's name for it


# Applied to each parsed object before validation (an OpenAI Batch request line made a spec:
# producer/openai_batch.py), so its issues keep the object's physical line.
SpecConvert = Callable[[Any], Conversion]


def load_spec_file(
    path: str | Path,
    check: SpecCheck | None = None,
    convert: SpecConvert | None = None,
    on_progress: ProgressHook | None = None,
) -> list[LoadedSpec]:
    """Parse, validate and canonicalise every spec in ``path``; raise SpecFileError if any
    problem exists (nothing is returned partially). A JSONL file is streamed a line at a time;
    a .json file is read whole. `on_progress`: see ProgressHook (a .json file reports once,
    at its end)."""
    shown = str(path)
    file_path = Path(path)
    try:
        base_dir = file_path.resolve().parent
        fh = file_path.open("rb")
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise SpecFileError([SpecIssue(shown, 0, "", f"cannot read: {exc}")]) from None
    validator = _Validator(shown, base_dir, check, convert)
    with fh:
        try:
            size = os.fstat(fh.fileno()).st_size
            if file_path.suffix.lower() == ".json":
                data = fh.read()
                for line, obj in _json_entries(data, shown, validator.issues):
                    validator.add(line, obj, screen=True)
                if on_progress is not None:
                    on_progress(data.count(b"\n") + 1 if data else 0, len(data), size)
            else:
                reader = _JsonlReader(fh, shown, validator.issues, size, on_progress)
                for line, obj, screen in reader:
                    validator.add(line, obj, screen)
        except OSError as exc:
            validator.issues.append(SpecIssue(shown, 0, "", f"cannot read: {exc}"))
    return validator.finish()


def load_spec_from_objects(
    objs: Sequence[Any],
    base_dir: Path | None = None,
    check: SpecCheck | None = None,
    shown: str = "<arguments>",
) -> list[Spec]:
    """Specs built in memory (`cchatq run`, `Client.submit`), through the same validation as
    a file's; an issue's line is the object's position, from 1."""
    validator = _Validator(shown, base_dir or Path.cwd(), check)
    for number, obj in enumerate(objs, start=1):
        validator.add(number, obj, screen=True)
    return [item.spec for item in validator.finish()]


class _Validator:
    """One load: each object checked as it comes, the issues and specs so far. Once an issue
    is found no spec is kept (none will be returned), only the ids, for duplicates."""

    def __init__(
        self,
        shown: str,
        base_dir: Path,
        check: SpecCheck | None,
        convert: SpecConvert | None = None,
    ) -> None:
        self.shown = shown
        self.check = check
        self.convert = convert
        self.issues: list[SpecIssue] = []
        self.loaded: list[LoadedSpec] = []
        self.objects = 0
        self.modules = ModuleChecker(base_dir)
        self._module_of: dict[str, tuple[str, str | None]] = {}
        self._seen_ids: dict[str, int] = {}
        self._session_schema = SessionSpecSchema()
        self._program_schema = ProgramSpecSchema()
        self._fast = FastSessions(self.module, self.modules.tool_problem)

    def add(self, line: int, obj: Any, screen: bool) -> None:
        """`screen`: walk the value for what JSON parses but nothing later can use; a JSONL
        line skips it when its bytes show there is nothing to find. A converted object's
        issues are named in the input's own terms."""
        if self.convert is None:
            return self._add(line, obj, screen)
        conversion = self.convert(obj)
        if conversion.problems:
            self.objects += 1
            self.issues.extend(SpecIssue(self.shown, line, f, m) for f, m in conversion.problems)
            return None
        first = len(self.issues)
        self._add(line, conversion.obj, screen=True)
        name = conversion.field_name
        if name is not None:
            self.issues[first:] = [replace(i, field=name(i.field)) for i in self.issues[first:]]
        return None

    def _add(self, line: int, obj: Any, screen: bool) -> None:
        self.objects += 1
        issues = self.issues
        if not isinstance(obj, dict):
            message = f"expected a JSON object, got {_json_type(obj)}"
            issues.append(SpecIssue(self.shown, line, "", message))
            return
        spec_id = obj.get("id")
        if isinstance(spec_id, str):
            first = self._seen_ids.setdefault(spec_id, line)
            if first != line:
                issues.append(SpecIssue(self.shown, line, "id", f"duplicate of line {first}"))
        plain = True  # parsed JSON: only JSON's types
        if screen:
            problems, plain = _screen(obj)
            if problems:
                issues.extend(SpecIssue(self.shown, line, f, m) for f, m in problems)
                return
        try:
            # the common session in the common shapes, else (or when unsure) the schemas
            spec: Spec | None = self._fast.load(obj) if plain else None
            if spec is None:
                spec = self._checked(line, obj)
        except Exception as exc:  # a bug of ours: still this line's issue, not a traceback
            message = f"could not be checked ({type(exc).__name__}: {exc}); please report this"
            issues.append(SpecIssue(self.shown, line, "", message))
            return
        if spec is None:
            return
        if self.check is not None:
            issues.extend(SpecIssue(self.shown, line, f, m) for f, m in self.check(spec))
        if issues:
            self.loaded.clear()
        else:
            self.loaded.append(LoadedSpec(line, spec))

    def finish(self) -> list[LoadedSpec]:
        if not self.objects and not self.issues:
            self.issues.append(SpecIssue(self.shown, 0, "", "no specs in file"))
        if self.issues:
            raise SpecFileError(self.issues)
        return self.loaded

    def module(self, module: str) -> tuple[str, str | None]:
        """(resolved path, its problem or None), once per distinct module string."""
        found = self._module_of.get(module)
        if found is None:
            try:
                found = self.modules.check(module)
            except (OSError, ValueError, RuntimeError) as exc:  # too long, a NUL, no ~user
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                found = (module, f"cannot use this path: {reason}")
            self._module_of[module] = found
        return found

    def _checked(self, line: int, obj: dict[str, Any]) -> Spec | None:
        """The spec, or None with its issues added. Module files are checked on the raw
        object, so they are reported even when the schema rejects something else."""
        shown, issues = self.shown, self.issues
        module_paths: dict[int, str] = {}
        raw_tools = obj.get("tools")
        for index, tool in enumerate(raw_tools if isinstance(raw_tools, list) else []):
            module = tool.get("module") if isinstance(tool, dict) else None
            if isinstance(module, str) and module:
                resolved, problem = self.module(module)
                if problem:
                    issues.append(SpecIssue(shown, line, f"tools.{index}.module", problem))
                    continue
                module_paths[index] = resolved
                export, table_index = tool.get("export"), tool.get("table_index")
                misfit = self.modules.tool_problem(resolved, export, table_index)
                if misfit:
                    where = "export" if isinstance(export, str) else "table_index"
                    issues.append(SpecIssue(shown, line, f"tools.{index}.{where}", misfit))
        program = obj.get("program")
        program_module: str | None = None
        module = program.get("module") if isinstance(program, dict) else None
        if isinstance(module, str) and module:
            program_module, problem = self.module(module)
            if problem:
                issues.append(SpecIssue(shown, line, "program.module", problem))
        schema = self._program_schema if is_program(obj) else self._session_schema
        try:
            spec: Spec = schema.load(obj)
        except ValidationError as exc:
            issues.extend(
                SpecIssue(shown, line, field, message)
                for field, message in flatten_errors(exc.messages)
            )
            return None
        if len(module_paths) < len(getattr(spec, "tools", ())):
            return None  # a module's problem is reported already
        return _with_module_paths(spec, program_module, module_paths)


def _with_module_paths(
    spec: Spec, program_module: str | None, tool_modules: dict[int, str]
) -> Spec:
    """The spec with its modules as resolved paths (relative to the spec file)."""
    if isinstance(spec, ProgramSpec):
        if program_module is None:
            return spec
        return replace(spec, program=replace(spec.program, module=program_module))
    tools = tuple(replace(t, module=tool_modules[i]) for i, t in enumerate(spec.tools))
    return replace(spec, tools=tools)


def flatten_errors(messages: Any, prefix: str = "") -> list[tuple[str, str]]:
    """marshmallow's nested error dict -> [(dotted field path, message)].

    ``_schema`` keys (errors about an object as a whole) add nothing to the path, except for
    the "Unknown field." of a key that is itself named ``_schema``.
    """
    if isinstance(messages, Mapping):
        out: list[tuple[str, str]] = []
        for key, value in messages.items():
            if key == SCHEMA_ERRORS and isinstance(value, list):
                for message in value:
                    if message == UNKNOWN_FIELD:
                        out.append((_join(prefix, SCHEMA_ERRORS, literal=True), message))
                    else:
                        out.extend(flatten_errors(message, prefix))
                continue
            out.extend(flatten_errors(value, _join(prefix, key)))
        return out
    if isinstance(messages, list | tuple):
        if all(isinstance(m, str) for m in messages):
            return [(prefix, m) for m in messages]
        return [pair for m in messages for pair in flatten_errors(m, prefix)]
    return [(prefix, str(messages))]


def _join(prefix: str, key: Any, literal: bool = False) -> str:
    if key == SCHEMA_ERRORS and not literal:
        return prefix
    return f"{prefix}.{_key(key)}" if prefix else _key(key)


def _key(key: Any) -> str:
    """A path component: an empty key shows as "" (else the field would read as none)."""
    return str(key) or '""'


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
    return _screen(obj)[0]


_PLAIN_TYPES = frozenset((dict, list, str, int, float, bool, type(None)))


def _screen(obj: Any) -> tuple[list[tuple[str, str]], bool]:
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
    return ".".join(_key(p) for p in parts)


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


class _JsonlReader:
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


def _json_entries(data: bytes, shown: str, issues: list[SpecIssue]) -> list[tuple[int, Any]]:
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


def _json_type(obj: Any) -> str:
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

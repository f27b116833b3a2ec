"""Load and validate a whole spec file before anything is enqueued.

Every problem in the file is collected and reported at once (path:line: field: message),
so a producer fixes a batch in one pass instead of one error per submit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from marshmallow import ValidationError

from producer.modules import ModuleChecker
from schemas.program_spec import ProgramSpecSchema, is_program
from schemas.spec import SessionSpecSchema
from schemas.spec_types import ProgramSpec, Spec

MAX_LISTED_ISSUES = 20
JSON_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class SpecIssue:
    path: str
    line: int  # 1-based physical line; 0 for problems with the file as a whole
    field: str
    message: str

    def __str__(self) -> str:
        if self.field:
            return f"{self.path}:{self.line}: {self.field}: {self.message}"
        return f"{self.path}:{self.line}: {self.message}"


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
    path: str | Path, check: SpecCheck | None = None, convert: SpecConvert | None = None
) -> list[LoadedSpec]:
    """Parse, validate and canonicalise every spec in ``path``; raise SpecFileError if any
    problem exists (nothing is returned partially)."""
    shown = str(path)
    file_path = Path(path)
    try:
        # utf-8-sig: tolerate a BOM written by some editors.
        text = file_path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFileError([SpecIssue(shown, 0, "", f"cannot read: {exc}")]) from None

    issues: list[SpecIssue] = []
    if file_path.suffix.lower() == ".json":
        entries = _parse_json(text, shown, issues)
    else:
        entries = _parse_jsonl(text, shown, issues)

    return _validate(entries, shown, file_path.resolve().parent, issues, check, convert)


def load_spec_from_objects(
    objs: Sequence[Any],
    base_dir: Path | None = None,
    check: SpecCheck | None = None,
    shown: str = "<arguments>",
) -> list[Spec]:
    """Specs built in memory (`cchatq run`, `Client.submit`), through the same validation as
    a file's; an issue's line is the object's position, from 1."""
    entries = [(n + 1, obj) for n, obj in enumerate(objs)]
    loaded = _validate(entries, shown, base_dir or Path.cwd(), [], check)
    return [item.spec for item in loaded]


def _validate(
    entries: list[tuple[int, Any]],
    shown: str,
    base_dir: Path,
    issues: list[SpecIssue],
    check: SpecCheck | None = None,
    convert: SpecConvert | None = None,
) -> list[LoadedSpec]:
    modules = ModuleChecker(base_dir)
    session_schema, program_schema = SessionSpecSchema(), ProgramSpecSchema()
    seen_ids: dict[str, int] = {}
    loaded: list[LoadedSpec] = []
    # (first issue, how to name its field) of each run of issues from one converted object
    named: list[tuple[int, Callable[[str], str] | None]] = []
    for line, obj in entries:
        if convert is not None:
            conversion = convert(obj)
            named.append((len(issues), None))  # its problems, named by the conversion
            issues.extend(SpecIssue(shown, line, f, m) for f, m in conversion.problems)
            named.append((len(issues), conversion.field_name))  # what validation finds
            if conversion.problems:
                continue
            obj = conversion.obj
        if not isinstance(obj, dict):
            message = f"expected a JSON object, got {_json_type(obj)}"
            issues.append(SpecIssue(shown, line, "", message))
            continue
        # Duplicate ids and module files are checked on the raw object, so they are
        # reported even when the schema rejects something else in the same spec.
        spec_id = obj.get("id")
        if isinstance(spec_id, str):
            if spec_id in seen_ids:
                message = f"duplicate of line {seen_ids[spec_id]}"
                issues.append(SpecIssue(shown, line, "id", message))
            else:
                seen_ids[spec_id] = line
        module_paths: dict[int, str] = {}
        raw_tools = obj.get("tools")
        for index, tool in enumerate(raw_tools if isinstance(raw_tools, list) else []):
            module = tool.get("module") if isinstance(tool, dict) else None
            if isinstance(module, str) and module:
                resolved, problem = modules.check(module)
                if problem:
                    issues.append(SpecIssue(shown, line, f"tools.{index}.module", problem))
                module_paths[index] = resolved
                export, table_index = tool.get("export"), tool.get("table_index")
                misfit = modules.tool_problem(resolved, export, table_index)
                if misfit:
                    where = "export" if isinstance(export, str) else "table_index"
                    issues.append(SpecIssue(shown, line, f"tools.{index}.{where}", misfit))
        program = obj.get("program")
        program_module: str | None = None
        if (
            isinstance(program, dict)
            and isinstance(program.get("module"), str)
            and program["module"]
        ):
            program_module, problem = modules.check(program["module"])
            if problem:
                issues.append(SpecIssue(shown, line, "program.module", problem))
        schema = program_schema if is_program(obj) else session_schema
        try:
            spec: Spec = schema.load(obj)
        except ValidationError as exc:
            issues.extend(
                SpecIssue(shown, line, field, message)
                for field, message in flatten_errors(exc.messages)
            )
            continue
        if check is not None:
            issues.extend(SpecIssue(shown, line, field, message) for field, message in check(spec))
        loaded.append(LoadedSpec(line, _with_module_paths(spec, program_module, module_paths)))

    _rename_fields(issues, named)
    if not entries and not issues:
        issues.append(SpecIssue(shown, 0, "", "no specs in file"))
    if issues:
        raise SpecFileError(issues)
    return loaded


def _rename_fields(
    issues: list[SpecIssue], named: list[tuple[int, Callable[[str], str] | None]]
) -> None:
    """Each run of issues (from its first to the next run's) named by its object's conversion."""
    bounds = [start for start, _ in named] + [len(issues)]
    for (start, name), end in zip(named, bounds[1:], strict=True):
        if name is not None:
            issues[start:end] = [replace(i, field=name(i.field)) for i in issues[start:end]]


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

    ``_schema`` keys (errors about an object as a whole) add nothing to the path.
    """
    if isinstance(messages, Mapping):
        out: list[tuple[str, str]] = []
        for key, value in messages.items():
            path = _join(prefix, key)
            out.extend(flatten_errors(value, path))
        return out
    if isinstance(messages, list | tuple):
        if all(isinstance(m, str) for m in messages):
            return [(prefix, m) for m in messages]
        return [pair for m in messages for pair in flatten_errors(m, prefix)]
    return [(prefix, str(messages))]


def _join(prefix: str, key: Any) -> str:
    if key == "_schema":
        return prefix
    return f"{prefix}.{key}" if prefix else str(key)


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are Python extensions, not JSON; upstream APIs would reject them later.
    raise ValueError(f"{name} is not valid JSON")


def _parse_jsonl(text: str, shown: str, issues: list[SpecIssue]) -> list[tuple[int, Any]]:
    entries: list[tuple[int, Any]] = []
    # split("\n"), not splitlines(): the latter also breaks on U+2028 etc., which may sit
    # raw inside JSON strings, and would shift the physical line numbers.
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            # The raw line, not the stripped one, so columns are physical columns.
            entries.append((number, json.loads(raw, parse_constant=_reject_constant)))
        except json.JSONDecodeError as exc:
            message = f"invalid JSON: {exc.msg} (column {exc.colno})"
            issues.append(SpecIssue(shown, number, "", message))
        except ValueError as exc:
            issues.append(SpecIssue(shown, number, "", f"invalid JSON: {exc}"))
    return entries


def _parse_json(text: str, shown: str, issues: list[SpecIssue]) -> list[tuple[int, Any]]:
    """One object, or a list of objects each reported at the line where it starts.

    The top-level list is walked by hand, decoding each item with raw_decode, because
    json.loads keeps no positions.
    """
    decoder = json.JSONDecoder(parse_constant=_reject_constant)

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
    try:
        if text[pos] != "[":
            obj, pos = decoder.raw_decode(text, pos)
            entries.append((line_of(skip(0)), obj))
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

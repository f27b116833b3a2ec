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

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from marshmallow import ValidationError

from producer.fast_specs import FastSessions
from producer.modules import ModuleChecker

# re-exported: what callers of the loader name (its issues, limits, progress hook)
from producer.spec_json import MAX_DEPTH as MAX_DEPTH
from producer.spec_json import JsonlReader, json_entries, json_type, path_key, screen_object
from producer.spec_json import ProgressHook as ProgressHook
from producer.spec_json import SpecIssue as SpecIssue
from producer.spec_json import file_problem as file_problem
from producer.stored_specs import Compactor, StoredSpec
from schemas.program_spec import ProgramSpecSchema, is_program
from schemas.spec import SessionSpecSchema
from schemas.spec_types import ProgramSpec, Spec

MAX_LISTED_ISSUES = 20
# marshmallow files errors about an object as a whole under "_schema", and the "Unknown
# field." of a key named "_schema" lands there too: that one message names the key.
SCHEMA_ERRORS = "_schema"
UNKNOWN_FIELD = "Unknown field."


class SpecFileError(Exception):
    def __init__(self, issues: Sequence[SpecIssue]) -> None:
        self.issues: list[SpecIssue] = list(issues)
        super().__init__(self.listing(MAX_LISTED_ISSUES))

    def listing(self, most: int | None, more_hint: str = "") -> str:
        """The issues, one a line: the first `most` (None: all), then how many more (and
        `more_hint`: how to see them)."""
        shown = self.issues if most is None else self.issues[:most]
        lines = [str(issue) for issue in shown]
        hidden = len(self.issues) - len(shown)
        if hidden > 0:
            lines.append(f"... and {hidden} more{more_hint}")
        return "\n".join(lines)


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
    path: str | Path,
    check: SpecCheck | None = None,
    convert: SpecConvert | None = None,
    on_progress: ProgressHook | None = None,
) -> list[LoadedSpec]:
    """Parse, validate and canonicalise every spec in ``path``; raise SpecFileError if any
    problem exists (nothing is returned partially). A JSONL file is streamed a line at a time;
    a .json file is read whole. `on_progress`: see ProgressHook (a .json file reports once,
    at its end)."""
    return _load_file(path, check, convert, on_progress, lambda spec, line: LoadedSpec(line, spec))


def _load_file(
    path: str | Path,
    check: SpecCheck | None,
    convert: SpecConvert | None,
    on_progress: ProgressHook | None,
    keep: Callable[[Spec, int], Any],
) -> list[Any]:
    """`load_spec_file`, `keep` making what is kept of each valid spec as it is validated."""
    shown = str(path)
    file_path = Path(path)
    try:
        base_dir = file_path.resolve().parent
        fh = file_path.open("rb")
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise SpecFileError([SpecIssue(shown, 0, "", file_problem(exc))]) from None
    validator = _Validator(shown, base_dir, check, convert, keep)
    with fh:
        try:
            size = os.fstat(fh.fileno()).st_size
            if file_path.suffix.lower() == ".json":
                data = fh.read()
                for line, obj in json_entries(data, shown, validator.issues):
                    validator.add(line, obj, screen=True)
                if on_progress is not None:
                    on_progress(data.count(b"\n") + 1 if data else 0, len(data), size)
            else:
                reader = JsonlReader(fh, shown, validator.issues, size, on_progress)
                for line, obj, screen in reader:
                    validator.add(line, obj, screen)
        except OSError as exc:
            validator.issues.append(SpecIssue(shown, 0, "", file_problem(exc)))
    return validator.finish()


def load_stored_specs(
    path: str | Path,
    check: SpecCheck | None = None,
    convert: SpecConvert | None = None,
    on_progress: ProgressHook | None = None,
) -> list[StoredSpec]:
    """`load_spec_file`, each spec kept only in its compact stored form (producer/
    stored_specs.py) from the moment it is validated: what `cchatq submit` holds of a big
    file."""
    compactor = Compactor()
    return _load_file(path, check, convert, on_progress, compactor)


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
        keep: Callable[[Spec, int], Any] = lambda spec, line: LoadedSpec(line, spec),
    ) -> None:
        self.shown = shown
        self.check = check
        self.convert = convert
        self.keep = keep
        self.issues: list[SpecIssue] = []
        self.loaded: list[Any] = []  # what `keep` made of each spec, while no issue was found
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
            message = f"expected a JSON object, got {json_type(obj)}"
            issues.append(SpecIssue(self.shown, line, "", message))
            return
        spec_id = obj.get("id")
        if isinstance(spec_id, str):
            first = self._seen_ids.setdefault(spec_id, line)
            if first != line:
                issues.append(SpecIssue(self.shown, line, "id", f"duplicate of line {first}"))
        plain = True  # parsed JSON: only JSON's types
        if screen:
            problems, plain = screen_object(obj)
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
            self.loaded.append(self.keep(spec, line))

    def finish(self) -> list[Any]:
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
    return f"{prefix}.{path_key(key)}" if prefix else path_key(key)

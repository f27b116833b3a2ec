"""OpenAI Batch request lines in (`cchatq submit batch.jsonl`), made specs, so an eval pipeline
written for the OpenAI Batch API runs unchanged; its output and error lines out (`--format
openai`) are producer/openai_output.py's.

The format followed, as OpenAI's API reference documents the request input object of the Batch
API (https://platform.openai.com/docs/api-reference/batch): one request a line, `{"custom_id",
"method": "POST", "url": "/v1/chat/completions", "body": {chat completion request}}`;
`custom_id` matches outputs to inputs and is unique in a batch. Only `/v1/chat/completions` is
run here (no embeddings, completions, responses).

The tools a request offers (`body.tools`, OpenAI function tools) run as WASM exports: a tools
file (`--tools tools.json`) binds each function name to a module and an export (or table index)
and optionally a `policy`; module paths are relative to the tools file.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marshmallow import ValidationError

from producer.modules import ModuleChecker
from producer.specfile import Conversion, file_problem, flatten_errors
from schemas.policy_schema import ToolPolicySchema
from schemas.spec import ID_MAX_CHARS, ID_PATTERN, ToolSpecSchema
from schemas.strict import FUNCTION_NAME_PATTERN

CHAT_COMPLETIONS = "/v1/chat/completions"
REQUEST_FIELDS = ("custom_id", "method", "url", "body")
TOOL_FIELDS = ("type", "function")
# body fields that are the spec's own (the rest are passed upstream as params)
SPEC_FIELDS = ("model", "messages", "tools")
BINDING_FIELDS = ("module", "export", "table_index", "policy")
DROPPED_FUNCTION_FIELDS = ("strict",)  # the worker validates arguments against the schema
CUSTOM_ID_PREFIX = "cid-"  # a spec id made of a custom_id that is not one (spec_id_of)
CUSTOM_ID_KEY = "custom_id"  # where its metadata keeps that custom_id, as it was given

Problems = list[tuple[str, str]]  # (field, message)


# the tools file -----------------------------------------------------------------------------


class ToolsFileError(Exception):
    """Every problem of a tools file, each as `path: tool.field: message`."""

    def __init__(self, shown: str, problems: Problems) -> None:
        self.problems = problems
        super().__init__(
            "\n".join(f"{shown}: {f}: {m}" if f else f"{shown}: {m}" for f, m in problems)
        )


@dataclass(frozen=True)
class ToolBindings:
    """Function name -> the spec tool fields it runs as (module as an absolute path)."""

    source: str  # the tools file, as given
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)


def load_tool_bindings(path: str | Path) -> ToolBindings:
    """Read and check a tools file: `{"name": {"module", "export" | "table_index", "policy"?}}`.
    Each module is compiled once and its export or table index checked, as a spec's are."""
    shown, file_path = str(path), Path(path)
    try:
        raw = json.loads(file_path.read_text(encoding="utf-8-sig"))
    except OSError as exc:
        raise ToolsFileError(shown, [("", file_problem(exc))]) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ToolsFileError(shown, [("", f"invalid JSON: {exc}")]) from None
    if not isinstance(raw, dict):
        raise ToolsFileError(shown, [("", 'expected an object {"name": {"module", "export"}}')])
    modules = ModuleChecker(file_path.resolve().parent)
    problems: Problems = []
    tools = {}
    for name, entry in raw.items():
        found = _binding(name, entry, modules)
        if isinstance(found, list):
            problems.extend(found)
        else:
            tools[name] = found
    for name, tool in tools.items():
        fallback = tool.get("policy", {}).get("fallback")
        if fallback is not None and (fallback == name or fallback not in raw):
            problems.append((f"{name}.policy.fallback", "Must name another tool of this file."))
    if problems:
        raise ToolsFileError(shown, problems)
    return ToolBindings(shown, tools)


def _binding(name: str, entry: Any, modules: ModuleChecker) -> dict[str, Any] | Problems:
    if not re.match(FUNCTION_NAME_PATTERN, name):
        return [(name, "Not a tool name: 1-64 characters of A-Z a-z 0-9 _ -.")]
    if not isinstance(entry, dict):
        return [(name, 'expected an object {"module", "export"}')]
    policy = ToolPolicySchema().fields
    problems = [
        (f"{name}.{k}", "Unknown field." + (f" (policy.{k}?)" if k in policy else ""))
        for k in entry
        if k not in BINDING_FIELDS
    ]
    if problems:
        return problems
    try:  # the spec schema's own checks, on the tool this binding makes
        tool: dict[str, Any] = ToolSpecSchema().load({**entry, "function": {"name": name}})
    except ValidationError as exc:
        return [(f"{name}.{f}", m) for f, m in flatten_errors(exc.messages)]
    module, problem = modules.check(tool["module"])
    if problem:
        return [(f"{name}.module", problem)]
    misfit = modules.tool_problem(module, tool.get("export"), tool.get("table_index"))
    if misfit:
        return [(f"{name}.{'export' if tool.get('export') else 'table_index'}", misfit)]
    bound = {k: tool[k] for k in BINDING_FIELDS if tool.get(k) is not None}
    return {**bound, "module": module}


# request lines in ---------------------------------------------------------------------------


def is_request(obj: Any) -> bool:
    """An OpenAI Batch request line (decided per line: a file may mix them with specs)."""
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj


def request_to_spec(
    obj: dict[str, Any], bindings: ToolBindings | None = None, provider: str | None = None
) -> dict[str, Any] | Problems:
    """An OpenAI Batch request line as a spec (to be validated as any spec is), or its problems
    named by the request's own fields. `provider` (`--provider`) picks the backend; without it
    the configuration's default_backend runs it."""
    problems: Problems = [(k, "Unknown field.") for k in obj if k not in REQUEST_FIELDS]
    method, url, body = obj.get("method"), obj.get("url"), obj["body"]
    if method != "POST":
        problems.append(("method", "must be POST" + _got(method)))
    if url != CHAT_COMPLETIONS:
        problems.append(("url", f"only {CHAT_COMPLETIONS} is supported" + _got(url)))
    if not isinstance(body, dict):
        return [*problems, ("body", "must be a chat completion request (an object)")]
    if body.get("stream") not in (None, False):
        problems.append(("body.stream", "not in a batch (a backend's `stream` setting streams)"))
    for legacy in ("functions", "function_call"):
        if legacy in body:
            problems.append((f"body.{legacy}", "legacy functions are not run: give tools"))
    custom_id = obj["custom_id"]
    if not isinstance(custom_id, str) or not custom_id:
        problems.append(("custom_id", "must be a non-empty string" + _got(custom_id)))
    tools = _tools(body.get("tools"), bindings, problems)
    if problems:
        return problems
    spec: dict[str, Any] = {"id": spec_id_of(custom_id)}
    if spec["id"] != custom_id:  # the output names it as it was given
        spec["metadata"] = {CUSTOM_ID_KEY: custom_id}
    spec.update({k: body[k] for k in ("model", "messages") if k in body})
    if isinstance(spec.get("messages"), list):  # OpenAI's newer name for the system role
        spec["messages"] = [
            {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in spec["messages"]
        ]
    if tools:
        spec["tools"] = tools
    params = {k: v for k, v in body.items() if k not in (*SPEC_FIELDS, "stream")}
    if params:
        spec["params"] = params
    if provider:
        spec["provider"] = provider
    return spec


def spec_id_of(custom_id: str) -> str:
    """The spec id of a request: its custom_id when that is a spec id already, else one made
    of its digest (`cid-...`), the custom_id kept in the spec's metadata for its output."""
    if re.fullmatch(ID_PATTERN, custom_id) and len(custom_id) <= ID_MAX_CHARS:
        return custom_id
    return CUSTOM_ID_PREFIX + hashlib.sha256(custom_id.encode()).hexdigest()[:32]


def _tools(raw: Any, bindings: ToolBindings | None, problems: Problems) -> list[dict[str, Any]]:
    """`body.tools` as spec tools, each bound to its module; problems appended."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.append(("body.tools", "must be a list of function tools"))
        return []
    tools: list[dict[str, Any]] = []
    for n, tool in enumerate(raw):
        where = f"body.tools.{n}"
        if not isinstance(tool, dict):
            problems.append((where, 'must be an object {"type": "function", "function"}'))
            continue
        problems.extend((f"{where}.{k}", "Unknown field.") for k in tool if k not in TOOL_FIELDS)
        if tool.get("type") != "function":
            kind = _got(tool.get("type"))
            problems.append((f"{where}.type", f"only function tools are run{kind}"))
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict):
            problems.append((f"{where}.function", 'must be an object {"name", "parameters"}'))
        elif not isinstance(name, str):
            problems.append((f"{where}.function.name", "must be a string" + _got(name)))
        elif bindings is None or name not in bindings.tools:
            known = "--tools FILE" if bindings is None else f"not in --tools {bindings.source}"
            problems.append(
                (f"{where}.function.name", f"tool {name!r} is not bound to a module ({known})")
            )
        else:
            kept = {k: v for k, v in function.items() if k not in DROPPED_FUNCTION_FIELDS}
            tools.append({**bindings.tools[name], "function": kept})
    offered = {t["function"]["name"] for t in tools}
    for n, tool in enumerate(tools):
        fallback = tool.get("policy", {}).get("fallback")
        if fallback is not None and fallback not in offered:
            said = f"tool {tool['function']['name']!r} falls back on {fallback!r} (--tools)"
            problems.append((f"body.tools.{n}.function.name", f"{said}, not in this request"))
    return tools


def _got(value: Any) -> str:
    return "" if value is None else f", got {value!r}"


def openai_field(spec_field: str) -> str:
    """A field of the spec made from a request line -> that request's field."""
    head, _, rest = spec_field.partition(".")
    if head == "id":
        return "custom_id" + (f".{rest}" if rest else "")
    if head in ("", "provider"):  # the object as a whole; --provider
        return spec_field
    if head == "params":
        return f"body.{rest}" if rest else "body"
    return f"body.{spec_field}"


class Converter:
    """For load_spec_file: each OpenAI request line made a spec (its issues named by the
    request's fields, on its physical line); any other line as it is. Counts the request
    lines it made specs of (`requests`, their spec ids in `request_ids`)."""

    def __init__(self, bindings: ToolBindings | None = None, provider: str | None = None) -> None:
        self.bindings, self.provider = bindings, provider
        self.requests = 0
        self.request_ids: set[str] = set()

    def __call__(self, obj: Any) -> Conversion:
        if not is_request(obj):
            return Conversion(obj)
        spec = request_to_spec(obj, self.bindings, self.provider)
        if isinstance(spec, list):
            return Conversion(problems=spec)
        self.requests += 1
        self.request_ids.add(spec["id"])
        return Conversion(spec, field_name=openai_field)


def converter(bindings: ToolBindings | None = None, provider: str | None = None) -> Converter:
    return Converter(bindings, provider)

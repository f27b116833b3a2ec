"""A fast path for the session specs of a big batch: the same specs the marshmallow schemas
load (`schemas/spec.py`), at a fraction of the cost.

The lines of a batch mostly share their tools, flags, limits and permissions and differ in
their ids, prompts, params and metadata. Here the shared parts are validated once per
distinct content (keyed by their JSON), through the schemas themselves, and built once (the
specs share those immutable values); the rest is checked by hand, for the common shapes only.
Whatever this path is not sure of (a program, a key it does not know, any invalid part) it
declines with None, and the caller loads the spec through the schemas, whose messages name
every problem. It never rejects anything itself, so it cannot word an issue differently.

tests/test_specfile_fuzz.py checks that for generated specs it returns what the schemas
return, or declines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from marshmallow import Schema, ValidationError

from schemas.limits import Limits
from schemas.spec import (
    ID_PATTERN,
    RESERVED_PARAMS,
    FlagsSchema,
    LimitsSchema,
    PermissionsSchema,
    ToolListField,
)
from schemas.spec_types import (
    TASK_STATUS,
    Flags,
    Permissions,
    SessionSpec,
    ToolSpec,
    spec_from_json,
)

CACHE_ENTRIES = 4096  # per kind of part; past it the cache starts over
SESSION_KEYS = frozenset(
    ("id", "provider", "model", "messages", "tools", "params", "flags", "limits", "metadata",
     "permissions")
)  # fmt: skip
MESSAGE_KEYS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id"))
CALL_KEYS = frozenset(("id", "type", "function"))
CALL_FUNCTION_KEYS = frozenset(("name", "arguments"))
ROLES = {role: role for role in ("system", "user", "assistant", "tool")}  # one str each
MAX_ID_CHARS = 200
_ID = re.compile(ID_PATTERN)
_MISSING: Any = object()
_INVALID: Any = object()

ModuleCheck = Callable[[str], tuple[str, str | None]]  # module -> (resolved path, problem)
ToolFit = Callable[[str, Any, Any], str | None]  # (resolved, export, table_index) -> problem


class _ToolsSchema(Schema):
    """A spec's `tools` field alone: the very field SessionSpecSchema loads them with."""

    tools = ToolListField(load_default=list)


@dataclass(frozen=True)
class _Tools:
    tools: tuple[ToolSpec, ...]  # with their modules resolved, as the slow path's
    names: frozenset[str]
    task_status_clash: bool  # an async background tool beside a tool named task_status


_EMPTY_TOOLS = _Tools((), frozenset(), False)
_NO_SPEC: dict[str, Any] = {"id": "", "model": "", "messages": []}


class FastSessions:
    """One load's caches. `load` returns the spec the schemas would, or None: not sure."""

    def __init__(self, module: ModuleCheck, tool_fit: ToolFit) -> None:
        self._module, self._tool_fit = module, tool_fit
        self._tools: dict[str, _Tools | None] = {}
        self._parts: dict[tuple[str, str], Any] = {}
        self._strings: dict[str, str] = {}
        self._tools_schema = _ToolsSchema()
        self._part_schemas: dict[str, Schema] = {
            "flags": FlagsSchema(),
            "limits": LimitsSchema(),
            "permissions": PermissionsSchema(),
        }
        self._defaults: dict[str, Any] = {
            "flags": Flags(),
            "limits": Limits.resolve(None),
            "permissions": Permissions(),
        }

    def load(self, obj: dict[str, Any]) -> SessionSpec | None:
        """`obj`: parsed JSON (dicts with str keys, lists, str, int, finite float, bool, None),
        screened already (specfile.screen_value)."""
        if not obj.keys() <= SESSION_KEYS:
            return None
        spec_id, model = obj.get("id"), obj.get("model")
        if type(spec_id) is not str or not 0 < len(spec_id) <= MAX_ID_CHARS:
            return None
        if not _ID.match(spec_id) or type(model) is not str or not model:
            return None
        provider = obj.get("provider")
        if provider is not None and (type(provider) is not str or not provider):
            return None
        raw_messages = obj.get("messages")
        if type(raw_messages) is not list or not raw_messages:
            return None
        messages = []
        for raw in raw_messages:
            message = _message(raw)
            if message is None:
                return None
            messages.append(message)
        params = obj.get("params", _MISSING)
        if params is _MISSING:
            params = {}
        elif type(params) is not dict or not params.keys().isdisjoint(RESERVED_PARAMS):
            return None
        metadata = obj.get("metadata", _MISSING)
        if metadata is _MISSING:
            metadata = {}
        elif type(metadata) is not dict:
            return None
        raw_tools = obj.get("tools", _MISSING)
        tools = _EMPTY_TOOLS if raw_tools is _MISSING else self._tools_of(raw_tools)
        if tools is None or tools.task_status_clash:
            return None
        flags, limits = self._part("flags", obj), self._part("limits", obj)
        permissions = self._part("permissions", obj)
        if _INVALID in (flags, limits, permissions):
            return None
        if not tools.names.issuperset(permissions.grant):
            return None
        return SessionSpec(
            id=spec_id,
            model=self._shared(model),
            messages=tuple(messages),
            tools=tools.tools,
            params=dict(params),
            flags=flags,
            limits=limits,
            provider=provider if provider is None else self._shared(provider),
            metadata=dict(metadata),
            permissions=permissions,
        )

    def _tools_of(self, raw: Any) -> _Tools | None:
        if type(raw) is not list:
            return None
        try:
            key = json.dumps(raw)
        except ValueError:  # an int past str()'s digits limit (in memory only)
            return None
        found = self._tools.get(key, _MISSING)
        if found is _MISSING:
            found = self._load_tools(raw)
            if len(self._tools) >= CACHE_ENTRIES:
                self._tools.clear()
            self._tools[key] = found
        return found  # type: ignore[no-any-return]

    def _load_tools(self, raw: list[Any]) -> _Tools | None:
        try:
            loaded = self._tools_schema.load({"tools": raw})["tools"]
        except ValidationError:
            return None
        resolved = []
        for tool in loaded:
            path, problem = self._module(tool["module"])
            if problem or self._tool_fit(path, tool["export"], tool["table_index"]):
                return None
            resolved.append({**tool, "module": path})
        tools = spec_from_json({**_NO_SPEC, "tools": resolved}).tools  # type: ignore[union-attr]
        names = frozenset(t.name for t in tools)
        clash = TASK_STATUS in names and any(
            (t.get("policy") or {}).get("background_mode") == "async" for t in loaded
        )
        return _Tools(tools, names, clash)

    def _part(self, name: str, obj: dict[str, Any]) -> Any:
        """flags, limits or permissions: its value, built once per distinct content, or
        _INVALID (the schema refuses it)."""
        raw = obj.get(name, _MISSING)
        if raw is _MISSING:
            return self._defaults[name]
        if type(raw) is not dict:
            return _INVALID
        try:
            key = (name, json.dumps(raw))
        except ValueError:
            return _INVALID
        found = self._parts.get(key, _MISSING)
        if found is _MISSING:
            try:
                loaded = self._part_schemas[name].load(raw)
            except ValidationError:
                found = _INVALID
            else:
                found = getattr(spec_from_json({**_NO_SPEC, name: loaded}), name)
            if len(self._parts) >= CACHE_ENTRIES:
                self._parts.clear()
            self._parts[key] = found
        return found

    def _shared(self, text: str) -> str:
        """One str object for the many equal models and providers of a batch."""
        if len(self._strings) < CACHE_ENTRIES:
            return self._strings.setdefault(text, text)
        return self._strings.get(text, text)


def _message(raw: Any) -> dict[str, Any] | None:
    """A message as MessageSchema loads it (its fields in declaration order), or None."""
    if type(raw) is not dict or not raw.keys() <= MESSAGE_KEYS:
        return None
    role = raw.get("role")
    if type(role) is not str or role not in ROLES:
        return None
    out: dict[str, Any] = {"role": ROLES[role]}
    content = raw.get("content")
    if "content" in raw:
        if type(content) is list:
            for part in content:
                if type(part) is not dict or type(part.get("type")) is not str:
                    return None
        elif content is not None and type(content) is not str:
            return None
        out["content"] = content
    if content is None and role in ("user", "system"):
        return None
    if "name" in raw:
        if type(raw["name"]) is not str:
            return None
        out["name"] = raw["name"]
    if "tool_calls" in raw:
        calls = raw["tool_calls"]
        if role != "assistant" or type(calls) is not list:
            return None
        out_calls = []
        for call in calls:
            loaded = _tool_call(call)
            if loaded is None:
                return None
            out_calls.append(loaded)
        out["tool_calls"] = out_calls
    if "tool_call_id" in raw:
        call_id = raw["tool_call_id"]
        if role != "tool" or type(call_id) is not str or not call_id:
            return None
        out["tool_call_id"] = call_id
    elif role == "tool":
        return None
    return out


def _tool_call(raw: Any) -> dict[str, Any] | None:
    if type(raw) is not dict or not raw.keys() <= CALL_KEYS:
        return None
    call_id, function = raw.get("id"), raw.get("function")
    if type(call_id) is not str or not call_id or raw.get("type", "function") != "function":
        return None
    if type(function) is not dict or function.keys() != CALL_FUNCTION_KEYS:
        return None
    name, arguments = function["name"], function["arguments"]
    if type(name) is not str or not name or type(arguments) is not str:
        return None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

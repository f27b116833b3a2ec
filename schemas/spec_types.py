"""Typed specs: what the marshmallow schemas (`schemas/spec.py`, `schemas/program_spec.py`)
load into and what every layer passes around. The kind of a session is its type: a
`SessionSpec` (a chat with tools) or a `ProgramSpec` (a WASM agent program run).

`spec_to_json` / `spec_from_json` are the stored form (Redis), compact and already
validated: reading it back builds the same values without validating again (a worker reads a
spec once per process). tests/test_spec_types.py checks the round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, overload

from schemas.limits import Limits, RunLimits

# declared in their own module; named here too, as the typed specs they are part of
from schemas.tool_policy import RISK_LEVELS as RISK_LEVELS
from schemas.tool_policy import ToolPolicy as ToolPolicy

PROGRAM_KIND = "program"  # the stored form's discriminator; code asks isinstance(spec, ...)
# The name a model's tool call that could not be read is kept under: the loop answers it with
# a VALIDATION_ERROR. Reserved: no tool may be named so.
INVALID_CALL_NAME = "invalid_tool_call"


@dataclass(frozen=True)
class Flags:
    auto_tool_call: bool = True
    metrics: bool = True
    strict_unknown_tool: bool = False
    # the model reads tool results as {ok, data, error, metrics}; programs see the
    # raw output unless they ask
    tool_result_envelope: bool = True
    # a limit that ends the tool loop is followed by one model call with tool choice none
    final_answer_on_limit: bool = True


def default_parameters() -> dict[str, Any]:
    """A function's parameters when its spec gives none."""
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionSpec:
    """An OpenAI function: what the model sees of a tool."""

    name: str
    parameters: dict[str, Any] = field(default_factory=default_parameters)
    description: str | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FunctionSpec:
        return cls(
            name=raw["name"],
            parameters=raw.get("parameters") or default_parameters(),
            description=raw.get("description"),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return out


@dataclass(frozen=True)
class Permissions:
    """Which of its tools a session may call: the configuration's environment bounds it
    (its max_risk_level, allow/deny globs, the user's allowlist); these narrow it further."""

    environment: str | None = None  # None: the configuration's default environment
    user: str | None = None
    allow_tools: tuple[str, ...] = ()  # globs; empty: every tool the environment allows
    deny_tools: tuple[str, ...] = ()
    grant: tuple[str, ...] = ()  # high-risk tools this session may call

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> Permissions:
        raw = raw or {}
        return cls(
            environment=raw.get("environment"),
            user=raw.get("user"),
            allow_tools=tuple(raw.get("allow_tools") or ()),
            deny_tools=tuple(raw.get("deny_tools") or ()),
            grant=tuple(raw.get("grant") or ()),
        )

    def to_json(self) -> dict[str, Any]:
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in _plain(self).items()}
        return {k: v for k, v in out.items() if v}


MCP_MODULE = "mcp"  # the module of a tool an MCP server serves (schemas/mcp.py)


@dataclass(frozen=True)
class McpToolRef:
    """Which MCP server (an id of the configuration's `mcp_servers`) serves a tool, under
    which of its own names."""

    server: str
    tool: str
    # the tool message is the whole CallToolResult, as SPEAR sends it (a program's chat)
    whole_result: bool = False


@dataclass(frozen=True)
class ToolSpec:
    """A tool: its function, the WASM function (or MCP server) that runs it, and how its calls
    run."""

    function: FunctionSpec
    module: str  # the module file: a path at submit, its file name once stored
    export: str | None = None  # called by export name ...
    table_index: int | None = None  # ... or by index into the function table
    module_sha256: str = ""  # set when the module is uploaded
    fork_sha256: str | None = None  # a program's tool: runs in this snapshot of the program
    policy: ToolPolicy = field(default_factory=ToolPolicy)
    mcp: McpToolRef | None = None  # an MCP server's tool (module MCP_MODULE)

    @property
    def name(self) -> str:
        return self.function.name


@dataclass(frozen=True)
class SessionSpec:
    """A chat session: messages, model, tools, and how the tool loop runs."""

    id: str
    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[ToolSpec, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    flags: Flags = field(default_factory=Flags)
    limits: Limits = field(default_factory=Limits)
    provider: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    permissions: Permissions = field(default_factory=Permissions)
    # MCP servers whose tools are still to be offered: the first round lists them and stores
    # them with the session (with_mcp_tools), and the spec read back names none
    mcp_servers: tuple[str, ...] = ()

    def tool(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)


@dataclass(frozen=True)
class ProgramDef:
    module: str  # a path at submit, its file name once stored
    args: tuple[str, ...] = ()
    stdin: str = ""
    env: dict[str, str] = field(default_factory=dict)
    module_sha256: str = ""


@dataclass(frozen=True)
class ProgramSpec:
    """One WASM agent program run; `provider` and `model` default its chats' routing."""

    id: str
    program: ProgramDef
    provider: str | None = None
    model: str | None = None
    limits: RunLimits = field(default_factory=RunLimits)
    metadata: dict[str, Any] = field(default_factory=dict)
    permissions: Permissions = field(default_factory=Permissions)  # its chats' tools


Spec = SessionSpec | ProgramSpec


def spec_to_json(spec: Spec) -> dict[str, Any]:
    """The stored (and canonical) form: plain JSON, empty optional fields left out."""
    if isinstance(spec, ProgramSpec):
        program = _plain(spec.program)
        program["args"] = list(spec.program.args)
        return {
            "id": spec.id,
            "kind": PROGRAM_KIND,
            "program": program,
            "provider": spec.provider,
            "model": spec.model,
            "limits": spec.limits.as_dict(),
            "metadata": spec.metadata,
            "permissions": spec.permissions.to_json(),
        }
    out: dict[str, Any] = {
        "id": spec.id,
        "provider": spec.provider,
        "model": spec.model,
        "messages": list(spec.messages),
        "tools": [_tool_to_json(t) for t in spec.tools],
        "params": spec.params,
        "flags": _plain(spec.flags),
        "limits": spec.limits.as_dict(),
        "metadata": spec.metadata,
        "permissions": spec.permissions.to_json(),
    }
    if spec.mcp_servers:  # absent otherwise: the stored form of other specs is unchanged
        out["mcp_servers"] = list(spec.mcp_servers)
    return out


def spec_from_json(obj: dict[str, Any]) -> Spec:
    """A spec's value from its JSON form: the stored form (trusted: it was validated at
    submit), and the schemas' validated data, so both build specs the same way."""
    if obj.get("kind") == PROGRAM_KIND:
        raw = dict(obj["program"])
        raw["args"] = tuple(raw.get("args", ()))
        return ProgramSpec(
            id=obj["id"],
            program=ProgramDef(**_known(ProgramDef, raw)),
            provider=obj.get("provider"),
            model=obj.get("model"),
            limits=RunLimits.resolve(obj.get("limits")),
            metadata=dict(obj.get("metadata") or {}),
            permissions=Permissions.from_json(obj.get("permissions")),
        )
    return SessionSpec(
        id=obj["id"],
        model=obj["model"],
        messages=tuple(obj["messages"]),
        tools=tuple(tool_from_json(t) for t in obj.get("tools") or ()),
        params=dict(obj.get("params") or {}),
        flags=Flags(**_known(Flags, obj.get("flags") or {})),
        limits=Limits.resolve(obj.get("limits")),
        provider=obj.get("provider"),
        metadata=dict(obj.get("metadata") or {}),
        permissions=Permissions.from_json(obj.get("permissions")),
        mcp_servers=tuple(obj.get("mcp_servers") or ()),
    )


def with_mcp_tools(spec: SessionSpec, tools: tuple[ToolSpec, ...]) -> SessionSpec:
    """The spec with its MCP servers' tools as its first round listed them (after its own; a
    name one of its own tools has is left out)."""
    names = {t.name for t in spec.tools}
    offered = tuple(t for t in tools if t.name not in names)
    return replace(spec, tools=(*spec.tools, *offered), mcp_servers=())


TASK_STATUS = "task_status"  # the built-in tool of a session with async background tools
BUILTIN_MODULE = "builtin"  # the module of a tool the workers answer themselves


def task_status_tool() -> ToolSpec:
    return ToolSpec(
        function=FunctionSpec(
            name=TASK_STATUS,
            description=(
                "The status of a background task a tool call started (its result said "
                "status: submitted): running with its progress, completed with its result, "
                "or failed with its error."
            ),
            parameters={
                "type": "object",
                "properties": {"task_id": {"type": "string"}},
                "required": ["task_id"],
            },
        ),
        module=BUILTIN_MODULE,
        export=TASK_STATUS,
    )


def has_async_tools(spec: SessionSpec) -> bool:
    return any(t.policy.background and t.policy.background_mode == "async" for t in spec.tools)


def with_builtins(spec: Spec) -> Spec:
    """The spec as the workers run it: one with async background tools offers task_status."""
    if isinstance(spec, SessionSpec) and has_async_tools(spec) and spec.tool(TASK_STATUS) is None:
        return replace(spec, tools=(*spec.tools, task_status_tool()))
    return spec


@overload
def stored(spec: SessionSpec, shas: dict[str, str]) -> SessionSpec: ...
@overload
def stored(spec: ProgramSpec, shas: dict[str, str]) -> ProgramSpec: ...
@overload
def stored(spec: Spec, shas: dict[str, str]) -> Spec: ...


def stored(spec: Spec, shas: dict[str, str]) -> Spec:
    """The spec as workers see it: modules named by content hash and file name, not path. A
    spec read back from the store (its modules hashed already) is its own stored form."""
    if isinstance(spec, ProgramSpec):
        program = spec.program
        sha = program.module_sha256 or shas[program.module]
        return replace(
            spec, program=replace(program, module=_file_name(program.module), module_sha256=sha)
        )
    tools = tuple(
        replace(t, module=_file_name(t.module), module_sha256=t.module_sha256 or shas[t.module])
        for t in spec.tools
    )
    return replace(spec, tools=tools)


def _tool_to_json(tool: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "module": tool.module,
        "export": tool.export,
        "table_index": tool.table_index,
        "function": tool.function.to_json(),
    }
    if tool.module_sha256:
        out["module_sha256"] = tool.module_sha256
    if tool.fork_sha256 is not None:
        out["fork_sha256"] = tool.fork_sha256
    policy = tool.policy.to_json()
    if policy:
        out["policy"] = policy
    if tool.mcp is not None:
        ref: dict[str, Any] = {"server": tool.mcp.server, "tool": tool.mcp.tool}
        if tool.mcp.whole_result:
            ref["whole_result"] = True
        out["mcp"] = ref
    return out


def tool_to_json(tool: ToolSpec) -> dict[str, Any]:
    """A tool's stored form, as in a stored spec's `tools`."""
    return _tool_to_json(tool)


def tool_from_json(raw: dict[str, Any]) -> ToolSpec:
    return ToolSpec(
        function=FunctionSpec.from_json(raw["function"]),
        module=raw.get("module", ""),
        export=raw.get("export"),
        table_index=raw.get("table_index"),
        module_sha256=raw.get("module_sha256", ""),
        fork_sha256=raw.get("fork_sha256"),
        policy=ToolPolicy.from_json(raw.get("policy")),
        mcp=McpToolRef(**raw["mcp"]) if raw.get("mcp") else None,
    )


def _plain(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in fields(value)}


def _known(cls: Any, raw: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in names}


def _file_name(path: str) -> str:
    return path.rsplit("/", 1)[-1]

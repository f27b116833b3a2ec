"""MCP servers (Model Context Protocol) as the fleet's configuration names them, and how their
tools reach the model, as SPEAR does it: each tool a function named
`mcp__<server id>__<tool name>` (both base64url, unpadded), filtered by the server's globs and
then the session's allowlist and denylist (`mcp.tool_allowlist`, `mcp.tool_denylist`).

Pure: no I/O. The worker's edge (worker/edges/mcp_tools.py) lists and calls the tools.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from schemas.fleet import McpServerConfig
from schemas.spec_types import MCP_MODULE, FunctionSpec, McpToolRef, ToolPolicy, ToolSpec
from schemas.tool_schema import schema_problem

SERVER_ID = r"[A-Za-z0-9_.-]{1,32}\Z"
TOOL_PREFIX = "mcp__"  # SPEAR's prefix of an MCP tool's function name
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")  # what every provider accepts


@dataclass(frozen=True)
class McpToolInfo:
    """A tool as its server lists it."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = field(default_factory=dict)
    read_only: bool = False  # the server's hints: a call may then be retried
    idempotent: bool = False


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def tool_name(server_id: str, tool: str) -> str:
    """The function name the model sees for `tool` of `server_id` (SPEAR's)."""
    return f"{TOOL_PREFIX}{_b64(server_id)}__{_b64(tool)}"


def _matches(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatchcase(name, glob) for glob in globs)


def allowed(
    server: McpServerConfig, tool: str, allowlist: Iterable[str] = (), denylist: Iterable[str] = ()
) -> bool:
    """Whether `tool` of `server` is offered: the server's globs, then the session's lists
    (an empty allowlist allows all); deny wins at each level."""
    allowlist, denylist = tuple(allowlist), tuple(denylist)
    if not _matches(tool, server.allow_tools) or _matches(tool, server.deny_tools):
        return False
    if allowlist and not _matches(tool, allowlist):
        return False
    return not _matches(tool, denylist)


def offered_tools(
    server: McpServerConfig,
    listed: Iterable[McpToolInfo],
    allowlist: Iterable[str] = (),
    denylist: Iterable[str] = (),
) -> tuple[ToolSpec, ...]:
    """The tools of `server` a session offers the model, in the server's order. Left out too:
    a tool whose function name would be over 64 characters, or whose input schema cannot check
    arguments (the engine validates every call against it)."""
    allowlist, denylist = tuple(allowlist), tuple(denylist)
    out = []
    for info in listed:
        name = tool_name(server.id, info.name)
        if not allowed(server, info.name, allowlist, denylist) or not FUNCTION_NAME.match(name):
            continue
        parameters = info.input_schema or {"type": "object", "properties": {}}
        if schema_problem(parameters) is not None:
            continue
        policy = ToolPolicy(
            timeout_ms=server.timeout_ms,
            idempotent=info.read_only or info.idempotent,
            risk_level=server.risk_level,
        )
        function = FunctionSpec(name=name, parameters=parameters, description=info.description)
        ref = McpToolRef(server=server.id, tool=info.name)
        out.append(ToolSpec(function=function, module=MCP_MODULE, mcp=ref, policy=policy))
    return tuple(out)

"""SPEAR's `mcp.*` chat params: a program enables the MCP servers its configuration
allows, and its chats offer their tools. Consumed here, never sent upstream.

    mcp.enabled         true | false; true answers -EACCES when the run's environment allows
                        no MCP server
    mcp.server_ids      ["id", ...]; -EACCES when one is not allowed ("" entries are skipped)
    mcp.tool_allowlist  ["glob", ...] on the servers' own tool names (empty: all)
    mcp.tool_denylist   ["glob", ...]
    mcp.task_*          the host's (SPEAR's task-level lists): -EACCES

A value of the wrong shape is -EINVAL, as is any other `mcp.` key. At `cchat_send`, a session
with `mcp.enabled` true offers the tools of its `mcp.server_ids` (listed then, filtered by the
configuration's globs and then these lists) after its own; a server that cannot list them is
skipped with a warn line in the program's log, as SPEAR skips it. A call of one answers with
the whole CallToolResult, as SPEAR's does (`whole_result`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from schemas.fleet import ToolDefaults
from schemas.spec_types import ToolSpec
from worker.errors import McpError
from worker.guest import abi
from worker.session.mcp_offer import mcp_tools
from worker.session.ports import McpClient

PREFIX = "mcp."
TASK_PREFIX = "mcp.task_"
ENABLED = "mcp.enabled"
SERVER_IDS = "mcp.server_ids"
TOOL_ALLOWLIST = "mcp.tool_allowlist"
TOOL_DENYLIST = "mcp.tool_denylist"


@dataclass(frozen=True)
class McpAccess:
    """What a program run may do with MCP: the servers its environment allows, and the client
    that lists their tools (None: this worker reaches no MCP server)."""

    allowed: tuple[str, ...] = ()
    client: McpClient | None = None
    fleet: ToolDefaults = field(default_factory=ToolDefaults)


def is_mcp_param(key: str) -> bool:
    return key.startswith(PREFIX)


def set_mcp_param(params: dict[str, Any], key: str, value: Any, access: McpAccess) -> int:
    """SET_PARAM of an `mcp.` key into a session's params: 0, or -EACCES / -EINVAL."""
    if key.startswith(TASK_PREFIX):
        return -abi.EACCES
    if key == ENABLED:
        if not isinstance(value, bool):
            return -abi.EINVAL
        if value and not access.allowed:
            return -abi.EACCES
    elif key in (SERVER_IDS, TOOL_ALLOWLIST, TOOL_DENYLIST):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return -abi.EINVAL
        if key == SERVER_IDS and any(v and v not in access.allowed for v in value):
            return -abi.EACCES
    else:
        return -abi.EINVAL
    params[key] = value
    return 0


def chat_mcp_tools(
    consumed: dict[str, Any],
    access: McpAccess,
    budget_ms: Callable[[], int],
    warn: Callable[[str], None],
) -> tuple[ToolSpec, ...]:
    """The MCP tools a chat offers, from its consumed `mcp.` params, each listing within
    `budget_ms()` (what is left of the run); a server that cannot list is skipped and `warn`
    says so (the program's log)."""
    if consumed.get(ENABLED) is not True:
        return ()
    servers = [s for s in consumed.get(SERVER_IDS) or () if s]

    def skip(exc: McpError) -> None:
        warn(f"{exc.message}: its tools are not offered")

    offered = mcp_tools(
        access.client,
        access.fleet,
        dict.fromkeys(servers),  # each once, in order
        consumed.get(TOOL_ALLOWLIST) or (),
        consumed.get(TOOL_DENYLIST) or (),
        budget_ms,
        skip,
    )
    return tuple(
        replace(t, mcp=replace(t.mcp, whole_result=True)) if t.mcp is not None else t
        for t in offered
    )

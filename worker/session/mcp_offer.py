"""MCP servers' tools in a session, through the McpClient port.

Which tools a session offers: those its servers list, filtered as schemas/mcp.py says. A spec
session naming `mcp_servers` has them listed by its first round, which stores them with the
session (first writer wins), so every later step (and a redelivered one) sees the same tools; a
program's chat has them listed at its `cchat_send` (worker/guest/mcp_params.py). A call of one
is a tool call like any other (policy, envelope, events); `ToolRouter` sends it to its server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from schemas.fleet import ToolDefaults
from schemas.mcp import offered_tools
from schemas.spec_types import SessionSpec, ToolSpec
from worker.errors import McpError, ToolRuntimeError
from worker.session.ports import McpClient, ToolCall, ToolRuntime
from worker.session.state import Session
from worker.session.store_ports import StepData


class ToolRouter:
    """The ToolRuntime of a tool step: a call of an MCP tool goes to its server, any other to
    the WASM runtime (`wasm`, built on first use: a prefork child builds its own engine)."""

    def __init__(self, wasm: Callable[[], ToolRuntime], mcp: McpClient | None) -> None:
        self.wasm, self.mcp = wasm, mcp

    def run(self, call: ToolCall) -> str:
        if call.mcp is None:
            return self.wasm().run(call)
        if self.mcp is None:
            raise ToolRuntimeError("this worker calls no MCP server", ran=False)
        return self.mcp.run(call)


def mcp_tools(
    client: McpClient | None,
    fleet: ToolDefaults,
    servers: Iterable[str],
    allowlist: Iterable[str] = (),
    denylist: Iterable[str] = (),
    budget_ms: Callable[[], int] | None = None,
    skip: Callable[[McpError], None] | None = None,
) -> tuple[ToolSpec, ...]:
    """The tools `servers` offer, in their order (a name already offered is not offered twice).
    Raises McpError when a server is not configured or cannot list its tools, unless `skip`
    is given: then that server offers nothing and `skip` is told why (SPEAR's way). `budget_ms`:
    the time left for each listing (a program's run deadline)."""
    allowlist, denylist = tuple(allowlist), tuple(denylist)
    out: dict[str, ToolSpec] = {}
    for server_id in servers:
        try:
            server = fleet.mcp_servers.get(server_id)
            if server is None:
                raise McpError(f"MCP server {server_id!r} is not configured")
            if client is None:
                raise McpError("this worker calls no MCP server")
            listed = client.list_tools(server_id, None if budget_ms is None else budget_ms())
        except McpError as exc:
            if skip is None:
                raise
            skip(exc)
            continue
        for tool in offered_tools(server, listed, allowlist, denylist):
            out.setdefault(tool.name, tool)
    return tuple(out.values())


def offer_mcp_tools(
    store: StepData, client: McpClient | None, fleet: ToolDefaults, sk: str, session: Session
) -> tuple[Session, dict[str, Any] | None]:
    """The first round of a spec session naming `mcp_servers`: its servers' tools listed and
    stored with it, and the session with them; or, when a server is not allowed where the
    session runs, not configured, or cannot list its tools, the error body its round ends in."""
    spec = session.spec
    environment = spec.permissions.environment
    allowed = fleet.mcp_allowed(environment)
    try:
        for server in spec.mcp_servers:
            if server not in allowed:
                where = environment or fleet.default_environment
                raise McpError(f"MCP server {server!r} is not allowed in environment {where!r}")
        tools = mcp_tools(client, fleet, spec.mcp_servers)
    except McpError as exc:
        return session, exc.body()
    store.store_mcp_tools(sk, tools)
    stored = store.load_spec(sk)  # with the tools the first writer stored
    if not isinstance(stored, SessionSpec):
        raise McpError(f"session {sk} is not a chat")
    return replace(session, spec=stored), None

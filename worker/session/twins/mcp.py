"""The in-memory twin of the McpClient port: MCP servers as Python functions, so the steps
and the hostcalls offer and call MCP tools with no server process (tests/test_mcp_steps.py).
The edge (worker/edges/mcp_tools.py) is tested against a real server."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.mcp import McpToolInfo
from worker.errors import McpError, ToolRuntimeError
from worker.session.ports import ToolCall

Handler = Callable[[dict[str, Any]], str]


@dataclass
class MemoryMcp:
    """Servers by id: each tool's listing and its handler (arguments -> output text). Every
    listing and call is recorded (`listings`, `calls`); a server in `down` cannot be listed.
    A program's call (`whole_result`) answers as the edge does: a CallToolResult's JSON with the
    text as its one content block, isError when the tool failed."""

    servers: dict[str, dict[str, tuple[McpToolInfo, Handler]]] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    listings: list[str] = field(default_factory=list)
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    budgets: list[int | None] = field(default_factory=list)  # each listing's budget_ms

    def add(self, server: str, info: McpToolInfo, handler: Handler) -> None:
        self.servers.setdefault(server, {})[info.name] = (info, handler)

    def list_tools(self, server: str, budget_ms: int | None = None) -> tuple[McpToolInfo, ...]:
        self.listings.append(server)
        self.budgets.append(budget_ms)
        if server in self.down or server not in self.servers:
            raise McpError(f"MCP server {server} could not list its tools: ConnectionError")
        return tuple(info for info, _ in self.servers[server].values())

    def run(self, call: ToolCall) -> str:
        assert call.mcp is not None
        if not call.mcp.whole_result:
            return self._run(call)
        try:
            text, failed = self._run(call), False
        except ToolRuntimeError as exc:
            text, failed = exc.message, True
        content = [{"type": "text", "text": text}]
        return json.dumps({"content": content, "isError": failed}, separators=(",", ":"))

    def _run(self, call: ToolCall) -> str:
        assert call.mcp is not None
        tools = self.servers.get(call.mcp.server, {})
        if call.mcp.tool not in tools:
            raise ToolRuntimeError(f"Unknown tool: {call.mcp.tool}", ran=True)
        arguments = json.loads(call.arguments)
        self.calls.append((call.mcp.server, call.mcp.tool, arguments))
        return tools[call.mcp.tool][1](arguments)

"""The fleet's tool-call configuration as values: what it gives a session's tool calls where
the spec is silent, its environments and its MCP servers (the configuration's `tools` and
`mcp_servers`; parsed in schemas/config.py). Apart from the session limits (schemas/limits.py),
which the spec types build on; the MCP servers' tools (schemas/mcp.py) build on both."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.limits import Limits


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server of the configuration's `mcp_servers`: a command the worker spawns (stdio:
    one process per worker process, kept for its listings and calls) or the URL of a
    streamable-HTTP server (one session per worker process)."""

    id: str
    command: tuple[str, ...] = ()  # stdio: the program and its arguments
    env: Mapping[str, str] = field(default_factory=dict)  # stdio: added to PATH, HOME, ...
    cwd: str | None = None  # stdio: the working directory
    url: str | None = None  # HTTP: the endpoint
    api_key_env: str | None = None  # HTTP: the variable of a bearer token, read at call time
    allow_tools: tuple[str, ...] = ("*",)  # globs on the server's own tool names
    deny_tools: tuple[str, ...] = ()
    timeout_ms: int | None = None  # a call's (and a listing's); None: tools.timeout_ms
    risk_level: str = "low"  # of each of its tools, as a tool policy's (permissions)
    list_ttl_s: float = 60.0  # how long a worker process keeps its listing; 0: not kept

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"

    def api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """An HTTP server's bearer token, read at call time (never stored)."""
        if not self.api_key_env:
            return None
        return (environ if environ is not None else os.environ).get(self.api_key_env)


@dataclass(frozen=True)
class Environment:
    """A named place sessions run in (the configuration's `tools.environments`): the riskiest
    tool it allows, tool allow/deny globs, and per-user allowlists."""

    max_risk_level: str = "high"
    allow_tools: tuple[str, ...] = ()  # globs; empty: any tool
    deny_tools: tuple[str, ...] = ()
    users: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # user -> allow globs
    mcp_servers: tuple[str, ...] = ()  # the MCP servers its sessions may enable (ids)


@dataclass(frozen=True)
class ToolDefaults:
    """What the fleet gives a session's tool calls where its spec and tools are silent (the
    worker configuration's `tools` object); `auto_tool_call` off runs no tools at all."""

    timeout_ms: int = 10_000
    max_retries: int = 0
    retry_backoff_ms: int = 200
    max_parallel: int = 16
    auto_tool_call: bool = True
    environments: Mapping[str, Environment] = field(default_factory=dict)
    default_environment: str | None = None
    # the configuration's `mcp_servers`, by id; a session may use those its environment lists
    mcp_servers: Mapping[str, McpServerConfig] = field(default_factory=dict)

    def mcp_allowed(self, environment: str | None) -> tuple[str, ...]:
        """The MCP servers a session of `environment` (None: the default one) may enable:
        none without an environment."""
        env = self.environments.get(environment or self.default_environment or "")
        return () if env is None else env.mcp_servers


def max_parallel(limits: Limits, fleet: ToolDefaults) -> int:
    """How many tool tasks of one session may be in flight at once."""
    return limits.max_parallel or fleet.max_parallel

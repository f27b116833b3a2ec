"""The fleet's tool-call configuration as values: what it gives a session's tool calls where
the spec is silent, its environments and its MCP servers (the configuration's `tools` and
`mcp_servers`; parsed in schemas/config.py). Apart from the session limits (schemas/limits.py)
because it names the MCP servers, whose module builds on the spec types that build on those
limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas.limits import Limits
from schemas.mcp import McpServerConfig


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

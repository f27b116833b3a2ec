"""Whether a session may call one of its tools (the README's "Permissions": a tool-level ACL by
session, user and environment). Pure: the engine asks before a call runs, and a denied call is
answered PERMISSION_DENIED without running.

The rules, in order: a `high` tool needs the spec's grant; the environment bounds the risk
level and filters by its allow/deny globs and the user's allowlist; the spec narrows further
with its own globs. Deny wins over allow at each level.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from schemas.fleet import ToolDefaults
from schemas.spec_types import RISK_LEVELS, Permissions, ToolSpec


def permission_problem(tool: ToolSpec, granted: Permissions, fleet: ToolDefaults) -> str | None:
    """Why the session may not call `tool`, or None when it may."""
    name, risk = tool.name, tool.policy.risk_level
    if risk == "high" and name not in granted.grant:
        return f"{name} is a high-risk tool: the spec must grant it (permissions.grant)"
    env_name = granted.environment or fleet.default_environment
    if env_name is not None:
        env = fleet.environments.get(env_name)
        if env is None:
            return f"unknown environment {env_name!r}: no tool may run"
        if RISK_LEVELS.index(risk) > RISK_LEVELS.index(env.max_risk_level):
            return f"{name} is {risk} risk, above environment {env_name}'s {env.max_risk_level}"
        if _matches(name, env.deny_tools):
            return f"environment {env_name} denies {name}"
        if env.allow_tools and not _matches(name, env.allow_tools):
            return f"environment {env_name} does not allow {name}"
        user_globs = env.users.get(granted.user) if granted.user is not None else None
        if user_globs is not None and not _matches(name, user_globs):
            return f"user {granted.user} may not call {name} in environment {env_name}"
    if _matches(name, granted.deny_tools):
        return f"the spec denies {name} (permissions.deny_tools)"
    if granted.allow_tools and not _matches(name, granted.allow_tools):
        return f"the spec does not allow {name} (permissions.allow_tools)"
    return None


def _matches(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatchcase(name, glob) for glob in globs)

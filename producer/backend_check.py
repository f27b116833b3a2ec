"""Checking a spec's backends at submit against the configuration the producer shares with the
workers (schemas/config.py): a backend no worker would know, or one whose API key variable is
unset, is refused with the spec's line and field instead of failing every session later (at
`model` when a model alias of the configuration routes it). So is an MCP server
(`mcp_servers`) that is not configured, or not allowed in the spec's environment.

The key check reads this process's environment: the producer is expected to run with the
fleet's configuration and keys. A producer that holds no keys (only the workers do) turns it
off (`cchatq submit --no-key-check`, `Client.submit(check_keys=False)`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from producer.specfile import SpecCheck
from schemas.fleet_config import FleetConfig
from schemas.model_routes import route_model
from schemas.spec_types import SessionSpec, Spec


def backend_check(
    config: FleetConfig, environ: Mapping[str, str] | None = None, check_keys: bool = True
) -> SpecCheck:
    env = os.environ if environ is None else environ
    # a file names few backends: each judged once (per model alias that names it)
    verdicts: dict[tuple[str | None, str | None], str | None] = {}

    def problem(name: str | None, alias: str | None) -> str | None:
        key = name or config.default_backend
        backend = config.backends.get(key)
        if backend is None:
            return (
                f"unknown backend {key!r}; the configuration ({config.source}) has"
                f" {', '.join(sorted(config.backends))}"
            )
        if check_keys and backend.api_key_env and not env.get(backend.api_key_env):
            whose = f" (the default backend, {key!r})" if name is None else ""
            if alias is not None:
                whose = f" (model alias {alias!r}, models.{alias}.backend)"
            return (
                f"backend {key!r}{whose} reads its API key from ${backend.api_key_env},"
                " which is not set (--no-key-check when only the workers hold it)"
            )
        return None

    def check(spec: Spec) -> list[tuple[str, str]]:
        found = []
        for field, name, alias in _named_backends(config, spec):
            if (name, alias) not in verdicts:
                verdicts[name, alias] = problem(name, alias)
            if verdicts[name, alias] is not None:
                found.append((field, str(verdicts[name, alias])))
        if isinstance(spec, SessionSpec):
            found.extend(mcp_problems(config, spec))
        return found

    return check


def _named_backends(config: FleetConfig, spec: Spec) -> list[tuple[str, str | None, str | None]]:
    """The backends a spec's model calls go to, as (field, backend, alias): its provider's, or
    the backend its model alias routes it to (None: the fleet's default), and its summaries'."""
    route = route_model(config.models, spec.provider, spec.model or "")
    named: list[tuple[str, str | None, str | None]] = [("provider", spec.provider, None)]
    if route.alias is not None:
        named = [("model", route.backend, route.alias)]
    if isinstance(spec, SessionSpec) and spec.limits.compress_backend:
        named.append(("limits.compress_backend", spec.limits.compress_backend, None))
    elif isinstance(spec, SessionSpec) and spec.limits.compress_model:
        summary = route_model(config.models, spec.provider, spec.limits.compress_model)
        if summary.alias is not None:
            named.append(("limits.compress_model", summary.backend, summary.alias))
    return named


def mcp_problems(config: FleetConfig, spec: SessionSpec) -> list[tuple[str, str]]:
    """The spec's MCP servers that are not configured, or that its environment does not list."""
    fleet = config.tool_defaults
    environment = spec.permissions.environment or fleet.default_environment
    allowed = fleet.mcp_allowed(environment)
    found = []
    for n, server in enumerate(spec.mcp_servers):
        if server not in fleet.mcp_servers:
            known = ", ".join(sorted(fleet.mcp_servers)) or "none"
            problem = (
                f"unknown MCP server {server!r}; the configuration ({config.source}) has {known}"
            )
        elif environment is None:
            problem = (
                f"MCP server {server!r} needs an environment that lists it: the spec names none"
                " and the configuration has no tools.default_environment"
            )
        elif server not in allowed:
            problem = (
                f"environment {environment!r} does not allow MCP server {server!r}"
                f" (tools.environments.{environment}.mcp_servers)"
            )
        else:
            continue
        found.append((f"mcp_servers.{n}", problem))
    return found

"""Reading and validating the fleet's configuration, shared by the producer and the workers: its
backends (named LLM endpoints) and the defaults of tool calls. One JSON document, from the file
`CCHATQ_CONFIG` or inline in `CCHATQ_BACKENDS` (which wins):

    {"backends": {NAME: {"protocol": P, "base_url": URL, "api_key_env": VAR, ...}},
     "default_backend": NAME,
     "models": {NAME: {"backend": NAME, "model": UPSTREAM, "params": {...}}},
     "namespace": NAME,      (where spec ids are unique unless `--namespace` says; "default")
     "tools": {"timeout_ms": N, "max_retries": N, "retry_backoff_ms": N, "max_parallel": N,
               "auto_tool_call": BOOL, "default_environment": NAME,
               "environments": {NAME: {"max_risk_level": L, "allow_tools": [GLOB],
                                       "deny_tools": [GLOB], "users": {USER: [GLOB]},
                                       "mcp_servers": [ID]}}},
     "mcp_servers": {ID: {"command": [PROGRAM, ARG, ...], "env": {VAR: VALUE}, "cwd": DIR}
                         | {"url": URL, "api_key_env": VAR},
                     with either: "allow_tools"/"deny_tools": [GLOB], "timeout_ms": N,
                     "risk_level": L, "list_ttl_s": S}}

An MCP server is usable only by sessions whose environment lists it (`mcp_servers`).
A model alias (`models`) sends a spec asking for NAME, with no provider, to its backend under
its upstream model, its params under the spec's own (schemas/model_routes.py). A map, not
LiteLLM's `model_list` of entries: a name routes to one backend (no load balancing), so a map
states each name once and its problems are named by it (`models.NAME.backend`); the endpoint
and key stay in `backends`, shared by every alias on them.

The built-in backends (`openai`, `anthropic`, `gemini`, `replay`) and the values this reads
into are declared in schemas/fleet_config.py. A configured backend of one of these names changes
only the fields it gives; any other must give its `base_url` (a typo in a name must not quietly
reach some default endpoint).

Validated with marshmallow, strictly: `"stream": "yes"` or `"max_attempts": "four"` are
refused, as are unknown keys, each problem named by its dotted path.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from marshmallow import (
    RAISE,
    Schema,
    ValidationError,
    fields,
    validate,
    validates,
    validates_schema,
)

from schemas.fleet import Environment, McpServerConfig, ToolDefaults
from schemas.fleet_config import DEFAULT_REPLAY_URL, BackendConfig, FleetConfig, builtin_backends
from schemas.keys import DEFAULT_NAMESPACE, NAMESPACE_PATTERN, NAMESPACE_RULE
from schemas.limits import TOOL_TIMEOUT_CAP_MS
from schemas.mcp import SERVER_ID
from schemas.model_routes import TOOL_CHOICE_PARAMS, ModelAlias
from schemas.protocols import NAMES as PROTOCOL_NAMES
from schemas.spec import RESERVED_PARAMS
from schemas.spec_types import RISK_LEVELS
from schemas.strict import ConfigBool, ConfigInt, Seconds, positive

LIST_TTL_CAP_S = 86_400  # an MCP server's listing kept at most a day
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class ConfigError(ValueError):
    """The configuration is wrong: every problem, each with its dotted path."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source, self.problems = source, problems
        lines = [f"  {path}: {message}" if path else f"  {message}" for path, message in problems]
        super().__init__("\n".join([f"configuration ({source}):", *lines]))


class _TtlSeconds(fields.Field[float]):
    """A cache's time to live: 0 (no cache) up to a day."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValidationError("must be a number of seconds")
        if not math.isfinite(value) or not 0 <= value <= LIST_TTL_CAP_S:
            raise ValidationError(f"must be between 0 and {LIST_TTL_CAP_S} seconds")
        return float(value)


class _BackendSchema(Schema):
    class Meta:
        unknown = RAISE

    protocol = fields.String(validate=validate.OneOf(PROTOCOL_NAMES))
    base_url = fields.Url(require_tld=False, schemes={"http", "https"})
    api_key_env = fields.String(
        allow_none=True, validate=validate.Regexp(ENV_NAME, error="must be a variable name")
    )
    connect_timeout_s = Seconds()
    read_timeout_s = Seconds()
    total_timeout_s = Seconds()
    stream_idle_timeout_s = Seconds()
    max_attempts = ConfigInt(validate=positive())
    backoff_base_s = Seconds()
    backoff_max_s = Seconds()
    max_retry_after_s = Seconds()
    stream = ConfigBool()
    thinking_budget_tokens = ConfigInt(allow_none=True, validate=positive())
    adaptive = ConfigBool()
    requests_per_minute = ConfigInt(allow_none=True, validate=positive())
    tokens_per_minute = ConfigInt(allow_none=True, validate=positive())
    rate_window_s = Seconds()


class _GlobList(fields.List[str]):
    def __init__(self) -> None:
        super().__init__(fields.String(validate=validate.Length(min=1)))


class _EnvironmentSchema(Schema):
    class Meta:
        unknown = RAISE

    max_risk_level = fields.String(validate=validate.OneOf(RISK_LEVELS))
    allow_tools = _GlobList()
    deny_tools = _GlobList()
    users = fields.Dict(keys=fields.String(), values=_GlobList())
    mcp_servers = fields.List(fields.String())


class _McpServerSchema(Schema):
    class Meta:
        unknown = RAISE

    command = fields.List(fields.String(validate=validate.Length(min=1)))
    env = fields.Dict(
        keys=fields.String(validate=validate.Regexp(ENV_NAME, error="must be a variable name")),
        values=fields.String(),
    )
    cwd = fields.String(validate=validate.Length(min=1))
    url = fields.Url(require_tld=False, schemes={"http", "https"})
    api_key_env = fields.String(validate=validate.Regexp(ENV_NAME, error="must be a variable name"))
    allow_tools = _GlobList()
    deny_tools = _GlobList()
    timeout_ms = ConfigInt(
        validate=validate.Range(
            min=1, max=TOOL_TIMEOUT_CAP_MS, error=f"must be between 1 and {TOOL_TIMEOUT_CAP_MS}"
        )
    )
    risk_level = fields.String(validate=validate.OneOf(RISK_LEVELS))
    list_ttl_s = _TtlSeconds()

    @validates_schema
    def _one_transport(self, data: dict[str, Any], **kwargs: Any) -> None:
        if ("command" in data) == ("url" in data):
            raise ValidationError("give either command (stdio) or url (HTTP)")
        if "command" in data and not data["command"]:
            raise ValidationError("must name the program to run", "command")
        other, keys = ("command", ("env", "cwd")) if "url" in data else ("url", ("api_key_env",))
        wrong = {key: [f"only with {other}"] for key in keys if key in data}
        if wrong:
            raise ValidationError(wrong)


class _ToolsSchema(Schema):
    class Meta:
        unknown = RAISE

    timeout_ms = ConfigInt(validate=positive())
    max_retries = ConfigInt(validate=validate.Range(min=0, error="must be 0 or more"))
    retry_backoff_ms = ConfigInt(validate=validate.Range(min=0, error="must be 0 or more"))
    max_parallel = ConfigInt(validate=positive())
    auto_tool_call = ConfigBool()
    environments = fields.Dict(keys=fields.String(), values=fields.Nested(_EnvironmentSchema))
    default_environment = fields.String()

    @validates_schema
    def _default_is_known(self, data: dict[str, Any], **kwargs: Any) -> None:
        name = data.get("default_environment")
        if name is not None and name not in (data.get("environments") or {}):
            raise ValidationError("is not an environment", "default_environment")


class _ModelSchema(Schema):
    class Meta:
        unknown = RAISE

    backend = fields.String(required=True, validate=validate.Length(min=1))
    model = fields.String(required=True, validate=validate.Length(min=1))
    params = fields.Dict(keys=fields.String())

    @validates("params")
    def _not_reserved(self, value: dict[str, Any], **kwargs: Any) -> None:
        reserved = {
            key: ["set by the spec or the worker, not params"]
            for key in (*RESERVED_PARAMS, *TOOL_CHOICE_PARAMS)
            if key in value
        }
        if reserved:
            raise ValidationError(reserved)


class _ConfigSchema(Schema):
    class Meta:
        unknown = RAISE

    backends = fields.Dict(keys=fields.String(validate=validate.Length(min=1)), values=fields.Raw())
    default_backend = fields.String()
    models = fields.Dict(
        keys=fields.String(validate=validate.Length(min=1)), values=fields.Nested(_ModelSchema)
    )
    namespace = fields.String(validate=validate.Regexp(NAMESPACE_PATTERN, error=NAMESPACE_RULE))
    tools = fields.Nested(_ToolsSchema)
    mcp_servers = fields.Dict(
        keys=fields.String(
            validate=validate.Regexp(SERVER_ID, error="must be 1-32 of A-Z a-z 0-9 _ . -")
        ),
        values=fields.Nested(_McpServerSchema),
    )


def parse_config(
    raw: Any, replay_url: str = DEFAULT_REPLAY_URL, source: str = "configuration"
) -> FleetConfig:
    """The configuration document, checked whole: raises ConfigError listing every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(source, [("", "must be a JSON object")])
    problems: list[tuple[str, str]] = []
    try:
        top = _ConfigSchema().load(raw)
    except ValidationError as exc:
        problems.extend(_flatten(exc.messages))
        top = exc.valid_data if isinstance(exc.valid_data, dict) else {}
    backends = builtin_backends(replay_url)
    for name, given in (top.get("backends") or {}).items():
        where = f"backends.{name}"
        if not isinstance(given, dict):
            problems.append((where, "must be an object"))
            continue
        try:
            loaded = _BackendSchema().load(given)
        except ValidationError as exc:
            problems.extend(_flatten(exc.messages, where))
            loaded = {"base_url": ""} if "base_url" in given else {}
        if name not in backends and "base_url" not in loaded:
            problems.append((f"{where}.base_url", "required (only a built-in backend has one)"))
        elif problems:
            continue  # nothing more is built from a configuration already refused
        elif name in backends:
            backends[name] = replace(backends[name], **loaded)
        else:
            backends[name] = BackendConfig(name=name, **loaded)
    default_backend = top.get("default_backend", "replay")
    if default_backend not in backends and default_backend not in (top.get("backends") or {}):
        problems.append(("default_backend", f"{default_backend!r} is not a backend"))
    models = {  # an entry refused in part is left out: its problems are listed already
        name: ModelAlias(name, alias["backend"], alias["model"], dict(alias.get("params") or {}))
        for name, alias in (top.get("models") or {}).items()
        if isinstance(alias, dict) and {"backend", "model"} <= alias.keys()
    }
    for name, alias in models.items():
        if alias.backend not in backends and alias.backend not in (top.get("backends") or {}):
            problems.append((f"models.{name}.backend", f"{alias.backend!r} is not a backend"))
    tools = top.get("tools") or {}
    servers = _mcp_servers(top.get("mcp_servers") or {})
    named = raw["mcp_servers"] if isinstance(raw.get("mcp_servers"), dict) else {}
    for name, env in (tools.get("environments") or {}).items():
        for n, server in enumerate(env.get("mcp_servers") or ()):
            if server not in named:
                where = f"tools.environments.{name}.mcp_servers.{n}"
                problems.append((where, f"{server!r} is not one of mcp_servers"))
    if problems:
        raise ConfigError(source, problems)
    environments = {
        name: Environment(
            max_risk_level=env.get("max_risk_level", "high"),
            allow_tools=tuple(env.get("allow_tools") or ()),
            deny_tools=tuple(env.get("deny_tools") or ()),
            users={user: tuple(globs) for user, globs in (env.get("users") or {}).items()},
            mcp_servers=tuple(env.get("mcp_servers") or ()),
        )
        for name, env in (tools.get("environments") or {}).items()
    }
    return FleetConfig(
        backends=backends,
        default_backend=default_backend,
        models=models,
        namespace=top.get("namespace", DEFAULT_NAMESPACE),
        tool_defaults=ToolDefaults(
            **{**tools, "environments": environments, "mcp_servers": servers}
        ),
        source=source,
    )


def _mcp_servers(loaded: dict[str, Any]) -> dict[str, McpServerConfig]:
    """The configuration's MCP servers, as they loaded."""
    out = {}
    for server_id, server in loaded.items():
        out[server_id] = McpServerConfig(
            id=server_id,
            command=tuple(server.get("command") or ()),
            env=dict(server.get("env") or {}),
            cwd=server.get("cwd"),
            url=server.get("url"),
            api_key_env=server.get("api_key_env"),
            allow_tools=tuple(server.get("allow_tools", ("*",))),
            deny_tools=tuple(server.get("deny_tools") or ()),
            timeout_ms=server.get("timeout_ms"),
            risk_level=server.get("risk_level", "low"),
            list_ttl_s=float(server.get("list_ttl_s", McpServerConfig.list_ttl_s)),
        )
    return out


def read_config(environ: Mapping[str, str] | None = None) -> FleetConfig:
    """The configuration this process shares with the fleet: `CCHATQ_BACKENDS` (inline JSON),
    else the file `CCHATQ_CONFIG`, else the built-in backends alone."""
    env = os.environ if environ is None else environ
    replay_url = env.get("CCHATQ_REPLAY_URL") or DEFAULT_REPLAY_URL
    if env.get("CCHATQ_BACKENDS"):
        source, text = "CCHATQ_BACKENDS", env["CCHATQ_BACKENDS"]
    elif env.get("CCHATQ_CONFIG"):
        source = env["CCHATQ_CONFIG"]
        try:
            text = Path(source).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(source, [("", f"cannot read: {exc}")]) from None
    else:
        return FleetConfig(backends=builtin_backends(replay_url))
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            source, [("", f"invalid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})")]
        ) from None
    return parse_config(raw, replay_url, source)


def _flatten(messages: Any, prefix: str = "") -> list[tuple[str, str]]:
    """marshmallow's nested messages -> (dotted path, message) pairs."""
    if isinstance(messages, Mapping):
        out: list[tuple[str, str]] = []
        for key, value in messages.items():
            # `_schema`: about the object as a whole; `key`, `value`: fields.Dict's, about an
            # entry's key or value
            whole = key == "_schema" or (key in ("key", "value") and prefix)
            path = prefix if whole else f"{prefix}.{key}" if prefix else str(key)
            out.extend(_flatten(value, path))
        return out
    if isinstance(messages, list | tuple):
        return [pair for m in messages for pair in _flatten(m, prefix)]
    text = str(messages)
    if text == "Unknown field.":
        text = "unknown key"
    return [(prefix, text)]

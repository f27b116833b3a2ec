"""Worker settings: the only module that reads the environment.

Environment variables:
    REDIS_URL                 broker and state store (default redis://127.0.0.1:6379/0)
    CCHATQ_CONFIG             path of a JSON file:
                              {"backends": {NAME: {...}}, "default_backend": NAME,
                               "tools": {"timeout_ms": N, "max_retries": N,
                                         "retry_backoff_ms": N, "max_parallel": N,
                                         "auto_tool_call": BOOL,
                                         "environments": {NAME: {"max_risk_level": L,
                                             "allow_tools": [GLOB], "deny_tools": [GLOB],
                                             "users": {USER: [GLOB]}}},
                                         "default_environment": NAME}}
    CCHATQ_BACKENDS           the same JSON inline (wins over the file)
    CCHATQ_REPLAY_URL         base URL of the built-in `replay` backend (default http://127.0.0.1:8011/v1)
    CCHATQ_VISIBILITY_TIMEOUT_S   Redis transport visibility timeout (default 300)
    CCHATQ_RESULT_TTL_S       TTL of every session key (default 86400)
    CCHATQ_MODULE_CACHE_DIR   serialized compiled modules (default ~/.cache/cchatq/modules)
    CCHATQ_MAX_STEP_ATTEMPTS  deliveries of one step before it is dead-lettered (default 5)
    CCHATQ_TRACE              `off`: no trace events (default on)
    CCHATQ_RECONCILE_EVERY_S  how often a control worker looks for stalled sessions (10)
    CCHATQ_STALL_AFTER_S      a session with no progress this long is nudged (30)
    CCHATQ_SESSION_DEADLINE_S a session with no progress this long after its submit ends with
                              deadline_exceeded (default: half CCHATQ_RESULT_TTL_S, 43200)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from schemas.limits import Environment, ToolDefaults
from schemas.spec_types import RISK_LEVELS

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_REPLAY_URL = "http://127.0.0.1:8011/v1"
PROTOCOLS = ("openai", "anthropic", "gemini", "openai-text-tags")


@dataclass(frozen=True)
class BackendConfig:
    """One named LLM endpoint. The API key is read from `api_key_env` at call time, never stored."""

    name: str
    protocol: str = "openai"
    base_url: str = DEFAULT_REPLAY_URL
    api_key_env: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    total_timeout_s: float = 120.0
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    max_retry_after_s: float = 60.0
    stream: bool = False  # SSE replies; partial text shows in `cchatq status` while a round runs
    thinking_budget_tokens: int | None = None  # None: thinking off
    # a limit shared by every worker of the fleet (in Redis); None: no limit
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    rate_window_s: float = 60.0  # the window the two limits count over

    @classmethod
    def from_mapping(cls, name: str, raw: Mapping[str, Any]) -> BackendConfig:
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"backend {name!r}: unknown keys {unknown}")
        backend = cls(name=name, **dict(raw))
        if backend.protocol not in PROTOCOLS:
            raise ValueError(
                f"backend {name!r}: protocol {backend.protocol!r} is not one of {PROTOCOLS}"
            )
        return backend

    def api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        if not self.api_key_env:
            return None
        return (environ if environ is not None else os.environ).get(self.api_key_env)


@dataclass(frozen=True)
class Settings:
    redis_url: str = DEFAULT_REDIS_URL
    backends: dict[str, BackendConfig] = field(default_factory=dict)
    default_backend: str = "replay"
    visibility_timeout_s: int = 300  # the task time limit's backstop (wiring)
    # a worker that stops beating this long has its taken messages handed out again
    consumer_dead_after_s: int = 15
    result_ttl_s: int = 86_400
    module_cache_dir: Path = Path.home() / ".cache" / "cchatq" / "modules"
    max_step_attempts: int = 5
    tool_defaults: ToolDefaults = field(default_factory=ToolDefaults)
    trace: bool = True  # trace events (issue 9): the session's stream, the fleet's, log lines
    reconcile_every_s: float = 10.0  # how often the fleet's reconciler looks (issue 10)
    stall_after_ms: int = 30_000  # a session with no progress this long is nudged
    # a stalled session this old ends deadline_exceeded: before its keys expire, so every
    # session ends with a body
    session_deadline_ms: int = 43_200_000

    def backend(self, name: str | None) -> BackendConfig:
        key = name or self.default_backend
        try:
            return self.backends[key]
        except KeyError:
            raise KeyError(
                f"unknown backend {key!r}; configured: {sorted(self.backends)}"
            ) from None


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    replay = BackendConfig(name="replay", base_url=env.get("CCHATQ_REPLAY_URL", DEFAULT_REPLAY_URL))
    backends: dict[str, BackendConfig] = {"replay": replay}
    default_backend = "replay"
    raw: dict[str, Any] = {}
    if env.get("CCHATQ_CONFIG"):
        raw = json.loads(Path(env["CCHATQ_CONFIG"]).read_text())
    if env.get("CCHATQ_BACKENDS"):
        raw = json.loads(env["CCHATQ_BACKENDS"])
    for name, spec in (raw.get("backends") or {}).items():
        backends[name] = BackendConfig.from_mapping(name, spec)
    default_backend = raw.get("default_backend", default_backend)
    # `openai` is what specs usually name; without a configuration it means the replay server.
    backends.setdefault("openai", BackendConfig(name="openai", base_url=replay.base_url))
    return Settings(
        tool_defaults=tool_defaults(raw.get("tools")),
        redis_url=env.get("REDIS_URL", DEFAULT_REDIS_URL),
        backends=backends,
        default_backend=default_backend,
        visibility_timeout_s=int(env.get("CCHATQ_VISIBILITY_TIMEOUT_S", "300")),
        consumer_dead_after_s=int(env.get("CCHATQ_CONSUMER_DEAD_AFTER_S", "15")),
        result_ttl_s=int(env.get("CCHATQ_RESULT_TTL_S", "86400")),
        module_cache_dir=Path(
            env.get("CCHATQ_MODULE_CACHE_DIR", str(Path.home() / ".cache" / "cchatq" / "modules"))
        ),
        max_step_attempts=int(env.get("CCHATQ_MAX_STEP_ATTEMPTS", "5")),
        trace=env.get("CCHATQ_TRACE", "on") != "off",
        reconcile_every_s=float(env.get("CCHATQ_RECONCILE_EVERY_S", "10")),
        stall_after_ms=int(float(env.get("CCHATQ_STALL_AFTER_S", "30")) * 1000),
        session_deadline_ms=int(
            float(
                env.get(
                    "CCHATQ_SESSION_DEADLINE_S",
                    int(env.get("CCHATQ_RESULT_TTL_S", "86400")) / 2,
                )
            )
            * 1000
        ),
    )


def tool_defaults(raw: Any) -> ToolDefaults:
    """The configuration's `tools` object: the fleet's defaults for tool calls and its
    environments, checked here so that a typo fails the worker at start, not a session later."""
    if raw is None:
        return ToolDefaults()
    if not isinstance(raw, dict):
        raise ValueError("configuration: tools must be an object")
    unknown = sorted(set(raw) - {f.name for f in fields(ToolDefaults)})
    if unknown:
        raise ValueError(f"configuration: tools: unknown keys {unknown}")
    values = dict(raw)
    for key, value in raw.items():
        if key == "auto_tool_call":
            _check(isinstance(value, bool), f"tools.{key} must be true or false, got {value!r}")
        elif key == "environments":
            values[key] = _environments(value)
        elif key == "default_environment":
            names = set(values.get("environments") or raw.get("environments") or {})
            _check(value in names, f"tools.default_environment {value!r} is not an environment")
        else:
            least = 0 if key in ("max_retries", "retry_backoff_ms") else 1
            _check(
                isinstance(value, int) and not isinstance(value, bool),
                f"tools.{key} must be an integer, got {value!r}",
            )
            _check(value >= least, f"tools.{key} is out of range: {value}")
    return ToolDefaults(**values)


def _environments(raw: Any) -> dict[str, Environment]:
    _check(isinstance(raw, dict), "tools.environments must be an object")
    out: dict[str, Environment] = {}
    for name, env in raw.items():
        where = f"tools.environments.{name}"
        _check(isinstance(env, dict), f"{where} must be an object")
        unknown = sorted(set(env) - {f.name for f in fields(Environment)})
        _check(not unknown, f"{where}: unknown keys {unknown}")
        risk = env.get("max_risk_level", "high")
        _check(risk in RISK_LEVELS, f"{where}.max_risk_level must be one of {RISK_LEVELS}")
        users = env.get("users") or {}
        _check(isinstance(users, dict), f"{where}.users must be an object")
        out[name] = Environment(
            max_risk_level=risk,
            allow_tools=_glob_list(env.get("allow_tools"), f"{where}.allow_tools"),
            deny_tools=_glob_list(env.get("deny_tools"), f"{where}.deny_tools"),
            users={u: _glob_list(g, f"{where}.users.{u}") for u, g in users.items()},
        )
    return out


def _glob_list(raw: Any, where: str) -> tuple[str, ...]:
    raw = [] if raw is None else raw
    _check(
        isinstance(raw, list) and all(isinstance(g, str) and g for g in raw),
        f"{where} must be a list of glob strings",
    )
    return tuple(raw)


def _check(ok: bool, problem: str) -> None:
    if not ok:
        raise ValueError(f"configuration: {problem}")

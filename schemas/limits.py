"""Session and program-run limits: each default and cap written once, here (docs/guest-abi.md
section 3). The schemas validate against the caps; the values resolve defaults from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

TOOL_TIMEOUT_CAP_MS = 120_000
COMPRESS_MODES = ("excerpt", "summarize")
BACKGROUND_TIMEOUT_CAP_MS = 6 * 3_600_000  # a background tool's call: up to 6 hours
MAX_TOOL_RETRIES_CAP = 10
RETRY_BACKOFF_CAP_MS = 60_000

# name -> (default, cap); a None default is the fleet's (schemas.fleet.ToolDefaults, from the
# worker's configuration) when the spec is silent
LIMIT_BOUNDS: dict[str, tuple[int | None, int]] = {
    "max_iterations": (8, 128),
    "max_total_tool_calls": (32, 10_000),
    "max_tool_output_bytes": (65_536, 1 << 20),
    # capped below the default visibility timeout (300 s), so no tool step outlives it
    "default_tool_timeout_ms": (None, TOOL_TIMEOUT_CAP_MS),
    "tool_memory_bytes": (256 << 20, 4 << 30),
    "max_tool_retries": (None, MAX_TOOL_RETRIES_CAP),
    "max_parallel": (None, 1_000),  # tool tasks of one session in flight at once
    # a longer tool output reaches the model as an excerpt (the store keeps it whole)
    "compress_over_bytes": (16_384, 1 << 20),
    # the bound on each model request (SPEAR's `timeout_ms`); None: the backend's own
    # total_timeout_s, which also caps it. Below the default visibility timeout (300 s).
    "request_timeout_ms": (None, 280_000),
}
LIMIT_ALIASES = {
    "max_tool_calls": "max_total_tool_calls",
    "tool_timeout_ms": "default_tool_timeout_ms",
}


# a program run's limits: name -> (default, cap); the run's deadline stays below the default
# visibility timeout (300 s)
RUN_LIMIT_BOUNDS: dict[str, tuple[int, int]] = {
    "run_timeout_ms": (60_000, 280_000),
    "memory_bytes": (256 << 20, 4 << 30),
    "max_output_bytes": (1 << 20, 16 << 20),
}

# a program run's `logs` (its own `log` lines, its refused cchat_write_fn's and its chats' tool
# lines): at most these many lines and bytes of text a run; later lines are only counted, and
# one last line says how many
RUN_LOG_MAX_LINES = 1_000
RUN_LOG_MAX_BYTES = 256 << 10


def _as_dict(values: Any) -> dict[str, Any]:
    return {f.name: getattr(values, f.name) for f in fields(values)}


def _default(name: str) -> int:
    default = LIMIT_BOUNDS[name][0]
    assert default is not None
    return default


def _run_default(name: str) -> int:
    return RUN_LIMIT_BOUNDS[name][0]


@dataclass(frozen=True)
class Limits:
    max_iterations: int = _default("max_iterations")
    max_total_tool_calls: int = _default("max_total_tool_calls")
    max_tool_output_bytes: int = _default("max_tool_output_bytes")
    default_tool_timeout_ms: int | None = None
    tool_memory_bytes: int = _default("tool_memory_bytes")
    max_tool_retries: int | None = None
    max_parallel: int | None = None
    compress_over_bytes: int = _default("compress_over_bytes")
    request_timeout_ms: int | None = None
    # how a longer output reaches the model: an excerpt, or a summary a model writes (on
    # compress_backend, else the session's own)
    compress: str = "excerpt"
    compress_backend: str | None = None
    compress_model: str | None = None  # else the session's model

    @classmethod
    def resolve(cls, raw: Mapping[str, Any] | None) -> Limits:
        """Apply defaults, aliases and caps; values below 1 fall back to the default (0 is
        a value for max_tool_retries)."""
        values: dict[str, Any] = {}
        for key in ("compress", "compress_backend", "compress_model"):  # no numbers
            if isinstance((raw or {}).get(key), str):
                values[key] = (raw or {})[key]
        for key, value in (raw or {}).items():
            name = LIMIT_ALIASES.get(key, key)
            if name not in LIMIT_BOUNDS or isinstance(value, bool) or value is None:
                continue
            try:
                number = int(value)
            except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON 1e400
                continue
            default, cap = LIMIT_BOUNDS[name]
            least = 0 if name == "max_tool_retries" else 1
            values[name] = min(number, cap) if number >= least else default
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The limits that are set (a fleet default stays the fleet's)."""
        return {k: v for k, v in _as_dict(self).items() if v is not None}


@dataclass(frozen=True)
class RunLimits:
    run_timeout_ms: int = _run_default("run_timeout_ms")
    memory_bytes: int = _run_default("memory_bytes")
    max_output_bytes: int = _run_default("max_output_bytes")

    @classmethod
    def resolve(cls, raw: Mapping[str, Any] | None) -> RunLimits:
        """Stored values as they are (validated at submit); missing ones get the default."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in (raw or {}).items() if k in names})

    def as_dict(self) -> dict[str, int]:
        return _as_dict(self)

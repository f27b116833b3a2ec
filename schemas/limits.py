"""Session and program-run limits: each default and cap written once, here (guest-abi.md
section 3). The schemas validate against the caps; the values resolve defaults from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# name -> (default, cap)
LIMIT_BOUNDS: dict[str, tuple[int, int]] = {
    "max_iterations": (8, 128),
    "max_total_tool_calls": (32, 10_000),
    "max_tool_output_bytes": (65_536, 1 << 20),
    # capped below the default visibility timeout (300 s), so no tool step outlives it
    "tool_timeout_ms": (10_000, 120_000),
    "tool_memory_bytes": (256 << 20, 4 << 30),
}
LIMIT_ALIASES = {"max_tool_calls": "max_total_tool_calls"}

# a program run's limits: name -> (default, cap); the run's deadline stays below the default
# visibility timeout (300 s)
RUN_LIMIT_BOUNDS: dict[str, tuple[int, int]] = {
    "run_timeout_ms": (60_000, 280_000),
    "memory_bytes": (256 << 20, 4 << 30),
    "max_output_bytes": (1 << 20, 16 << 20),
}


def _as_dict(values: Any) -> dict[str, int]:
    return {f.name: getattr(values, f.name) for f in fields(values)}


def _default(name: str) -> int:
    return LIMIT_BOUNDS[name][0]


def _run_default(name: str) -> int:
    return RUN_LIMIT_BOUNDS[name][0]


@dataclass(frozen=True)
class Limits:
    max_iterations: int = _default("max_iterations")
    max_total_tool_calls: int = _default("max_total_tool_calls")
    max_tool_output_bytes: int = _default("max_tool_output_bytes")
    tool_timeout_ms: int = _default("tool_timeout_ms")
    tool_memory_bytes: int = _default("tool_memory_bytes")

    @classmethod
    def resolve(cls, raw: Mapping[str, Any] | None) -> Limits:
        """Apply defaults, aliases and caps; values below 1 fall back to the default."""
        values: dict[str, int] = {}
        for key, value in (raw or {}).items():
            name = LIMIT_ALIASES.get(key, key)
            if name not in LIMIT_BOUNDS or isinstance(value, bool):
                continue
            try:
                number = int(value)
            except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON 1e400
                continue
            default, cap = LIMIT_BOUNDS[name]
            values[name] = min(number, cap) if number >= 1 else default
        return cls(**values)

    def as_dict(self) -> dict[str, int]:
        return _as_dict(self)


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

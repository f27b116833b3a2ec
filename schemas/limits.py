"""Session limits: defaults and caps in one value object (guest-abi.md section 3)."""

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


@dataclass(frozen=True)
class Limits:
    max_iterations: int = 8
    max_total_tool_calls: int = 32
    max_tool_output_bytes: int = 65_536
    tool_timeout_ms: int = 10_000
    tool_memory_bytes: int = 256 << 20

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
        return {f.name: getattr(self, f.name) for f in fields(self)}

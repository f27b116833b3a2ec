"""Retry maths for model calls: which statuses are retried, Retry-After delays, backoff with
jitter. Pure: the caller supplies clock and dice."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from worker.config import BackendConfig

# 529 is Anthropic's overloaded_error; it is covered by the 5xx rule.
_RETRY_STATUSES = frozenset({408, 409, 429})
_MAX_EXPONENT = 32  # keeps 2**n a float; the cap is reached long before


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    max_retry_after_s: float = 60.0
    jitter_s: float = 0.25

    @classmethod
    def from_backend(cls, backend: BackendConfig) -> RetryPolicy:
        return cls(
            max_attempts=max(1, backend.max_attempts),
            backoff_base_s=backend.backoff_base_s,
            backoff_max_s=backend.backoff_max_s,
            max_retry_after_s=backend.max_retry_after_s,
        )


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _finite_float(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_retry_after_s(headers: Mapping[str, str], now: float) -> float | None:
    """Seconds the server asked us to wait, or None. `now` is the wall clock (time.time())."""
    h = _lower(headers)
    if "retry-after-ms" in h:
        ms = _finite_float(h["retry-after-ms"])
        if ms is not None:
            return max(ms / 1000.0, 0.0)
    value = h.get("retry-after")
    if value is None:
        return None
    seconds = _finite_float(value)
    if seconds is not None:
        return max(seconds, 0.0)
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; a naive parse means "-0000"
        return None
    return max(when.timestamp() - now, 0.0)


def should_retry_status(status: int, headers: Mapping[str, str]) -> bool:
    """408, 409, 429 and every 5xx (Anthropic's 529 too) are retried, other 4xx never; the
    server's `x-should-retry` wins over the status code."""
    override = _lower(headers).get("x-should-retry", "").strip().lower()
    if override == "true":
        return True
    if override == "false":
        return False
    return status in _RETRY_STATUSES or status >= 500


def backoff_s(attempt: int, policy: RetryPolicy, retry_after_s: float | None, rand: float) -> float:
    """Delay after failed attempt number `attempt` (1-based); `rand` in [0, 1) drives the jitter."""
    if retry_after_s is not None:
        return min(max(retry_after_s, 0.0), policy.max_retry_after_s)
    exponent = min(max(attempt, 1) - 1, _MAX_EXPONENT)
    return min(policy.backoff_base_s * 2.0**exponent, policy.backoff_max_s) + rand * policy.jitter_s

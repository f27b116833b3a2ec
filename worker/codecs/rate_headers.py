"""What LLM providers say about their rate limits, as typed values, for the adaptive rate
controller: the budgets in OpenAI's `x-ratelimit-*` and Anthropic's `anthropic-ratelimit-*`
headers (Gemini sends none), and the wait a 429 asks for, as precisely as the response says
it (Retry-After is whole seconds; a 27 ms wait rounded up to 1 s wastes the budget).

Pure: the caller supplies the headers, the decoded body and the wall clock. Nothing here
raises on a malformed value; it reads as not said (None)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime

from worker.codecs.gemini_reply import error_object, retry_delay
from worker.codecs.retry import parse_retry_after_s

__all__ = ["RateSignal", "parse_go_duration", "precise_retry_s", "read_rate_signal"]

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_UNIT = r"(?:ms|us|µs|μs|ns|h|m|s)"  # "ms" before "m", or "27ms" reads as 27 minutes + "s"
_GO_DURATION = re.compile(rf"(?:{_NUMBER}{_UNIT})+")
_GO_PART = re.compile(rf"({_NUMBER})({_UNIT})")
_BARE_SECONDS = re.compile(_NUMBER)
_UNIT_S = {
    "h": 3600.0,
    "m": 60.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ns": 1e-9,
}
# OpenAI's 429 message: "... Please try again in 1.5s. Visit ..." (the dot ends the sentence)
_TRY_AGAIN = re.compile(rf"try again in\s*((?:(?:\d+(?:\.\d+)?|\.\d+){_UNIT})+)", re.IGNORECASE)

_OPENAI = "x-ratelimit-{part}-{budget}"  # part: limit, remaining, reset; reset is a duration
_ANTHROPIC = "anthropic-ratelimit-{budget}-{part}"  # reset is an RFC 3339 time
# Every Anthropic budget a 429 may have exhausted; "tokens" is the most restrictive in effect.
_ANTHROPIC_BUDGETS = ("requests", "tokens", "input-tokens", "output-tokens")


@dataclass(frozen=True)
class RateSignal:
    """What one response said about its account's limits (None: not said)."""

    requests_per_min: float | None = None  # the request limit, per minute
    requests_left: float | None = None  # requests that may be sent now
    requests_reset_s: float | None = None  # seconds until the request budget is whole again
    tokens_per_min: float | None = None
    tokens_left: float | None = None
    tokens_reset_s: float | None = None

    @property
    def empty(self) -> bool:
        """Nothing said: a provider without rate headers (Gemini), or none that parsed."""
        return all(getattr(self, f.name) is None for f in fields(self))


@dataclass(frozen=True)
class _Budget:
    limit: float | None
    left: float | None
    reset_s: float | None

    @property
    def said(self) -> bool:
        return self.limit is not None or self.left is not None or self.reset_s is not None


def parse_go_duration(text: str) -> float | None:
    """Seconds in a Go `time.Duration` string as OpenAI writes its resets ("27ms", "1.5s",
    "1m0s", "2m30.5s", "1h2m3s"), or a bare number of seconds; None when it is neither or
    negative (a reset never lies in the past)."""
    text = text.strip()
    if _BARE_SECONDS.fullmatch(text):
        return _non_negative(float(text))
    if not _GO_DURATION.fullmatch(text):
        return None
    return _non_negative(sum(float(n) * _UNIT_S[u] for n, u in _GO_PART.findall(text)))


def read_rate_signal(headers: Mapping[str, str], now: float) -> RateSignal:
    """The request and token budgets a response states, from OpenAI's or Anthropic's headers
    (names case-insensitive). Anthropic's tokens are its combined `tokens-*` budget when sent,
    else `input-tokens-*`. `now` is the wall clock (time.time()), for Anthropic's reset times."""
    h = {k.lower(): v for k, v in headers.items()}
    requests = _first(_openai(h, "requests"), _anthropic(h, "requests", now))
    tokens = _first(
        _openai(h, "tokens"), _anthropic(h, "tokens", now), _anthropic(h, "input-tokens", now)
    )
    return RateSignal(
        requests_per_min=requests.limit,
        requests_left=requests.left,
        requests_reset_s=requests.reset_s,
        tokens_per_min=tokens.limit,
        tokens_left=tokens.left,
        tokens_reset_s=tokens.reset_s,
    )


def precise_retry_s(
    headers: Mapping[str, str], body: object, now: float, retry_after_s: float | None
) -> float | None:
    """The wait a 429 asks for, as precisely as the response says it. `retry-after-ms` is
    taken as is. A whole-seconds Retry-After is a rounded-up figure: the first precise figure
    consistent with it (in (retry_after - 1, retry_after]) replaces it, one that is not is
    ignored. The precise figures, in order: OpenAI's "Please try again in 27ms." in the body,
    the reset of an exhausted budget in the headers (the latest when several are), Gemini's
    RetryInfo. Without a Retry-After the first of them that is present.

    `retry_after_s` is parse_retry_after_s of these headers (parsed once, by the caller);
    `body` the decoded JSON error body; `now` the wall clock (time.time())."""
    h = {k.lower(): v for k, v in headers.items()}
    if retry_after_s is not None and _from_ms(h, now):
        return max(retry_after_s, 0.0)
    figures = (
        f
        for f in (_openai_message_s(body), _exhausted_reset_s(h, now), _gemini_delay_s(body))
        if f is not None
    )
    if retry_after_s is None:
        return next(figures, None)
    consistent = (f for f in figures if retry_after_s - 1.0 < f <= retry_after_s)
    return next(consistent, max(retry_after_s, 0.0))


# ---------------------------------------------------------------------------------------------
# Headers


def _openai(h: Mapping[str, str], budget: str) -> _Budget:
    def get(part: str) -> str | None:
        return h.get(_OPENAI.format(part=part, budget=budget))

    reset = get("reset")
    return _Budget(
        _count(get("limit")),
        _count(get("remaining")),
        parse_go_duration(reset) if reset is not None else None,
    )


def _anthropic(h: Mapping[str, str], budget: str, now: float) -> _Budget:
    def get(part: str) -> str | None:
        return h.get(_ANTHROPIC.format(budget=budget, part=part))

    return _Budget(_count(get("limit")), _count(get("remaining")), _until(get("reset"), now))


def _first(*budgets: _Budget) -> _Budget:
    """The first budget a header was sent for, whole: fields of two families are not mixed."""
    return next((b for b in budgets if b.said), _Budget(None, None, None))


def _count(text: str | None) -> float | None:
    """A limit or a remaining count; negative ones (Azure's -1: not limited) are not said."""
    if text is None:
        return None
    try:
        return _non_negative(float(text.strip()))
    except ValueError:
        return None


def _until(text: str | None, now: float) -> float | None:
    """Seconds from `now` to an RFC 3339 time, never negative; None without a zone."""
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return max(when.timestamp() - now, 0.0)


def _non_negative(value: float) -> float | None:
    return value if math.isfinite(value) and value >= 0.0 else None


def _from_ms(h: Mapping[str, str], now: float) -> bool:
    """Whether parse_retry_after_s read `retry-after-ms` (it wins when it parses)."""
    ms = h.get("retry-after-ms")
    return ms is not None and parse_retry_after_s({"retry-after-ms": ms}, now) is not None


def _exhausted_reset_s(h: Mapping[str, str], now: float) -> float | None:
    """When the budgets at 0 are whole again: the latest of their resets (all must refill)."""
    budgets = [_openai(h, "requests"), _openai(h, "tokens")]
    budgets += [_anthropic(h, b, now) for b in _ANTHROPIC_BUDGETS]
    resets = [b.reset_s for b in budgets if b.left == 0 and b.reset_s is not None]
    return max(resets, default=None)


# ---------------------------------------------------------------------------------------------
# Bodies


def _openai_message_s(body: object) -> float | None:
    error = error_object(body)
    message = error.get("message") if error else None
    match = _TRY_AGAIN.search(message) if isinstance(message, str) else None
    return parse_go_duration(match.group(1)) if match else None


def _gemini_delay_s(body: object) -> float | None:
    delay = retry_delay(error_object(body))
    return _non_negative(delay) if delay is not None else None

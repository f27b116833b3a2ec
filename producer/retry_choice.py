"""Which failed sessions `cchatq batch retry B` runs again: the failed ones, or those that
ended with the codes named (`--codes`), less those that would fail again the same way (a
request the backend refused with a 4xx, a spec or module that cannot run) unless asked.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from producer.batches import FailedSession
from producer.cli_common import plural
from schemas.bodies import SESSION_ERROR_CODES

# Codes whose session fails the same way when run again with the same spec: skipped unless
# --include-4xx, or the code is named in --codes (README: Batches).
DETERMINISTIC: dict[str, str] = {
    "provider_error": "the backend refused the request (HTTP 4xx other than 408/409/429) "
    "or it could not be made",
    "invalid_request": "a program's chat cannot be routed (no model, a non-string backend)",
    "guest_error": "the module cannot compile, link or start",
}
# HTTP statuses trying again can help with: timeout, conflict, rate limit, and every 5xx
RETRYABLE_STATUSES = frozenset({408, 409, 429})
_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")


class UnknownCodes(ValueError):
    """`--codes` named codes no session can end with: one line listing the valid ones."""


@dataclass(frozen=True)
class RetryChoice:
    chosen: list[FailedSession] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # code -> sessions left out

    def skipped_line(self, batch: str) -> str:
        """What was left out and why, in one line (empty when nothing was)."""
        if not self.skipped:
            return ""
        total = sum(self.skipped.values())
        parts = "; ".join(
            f"{n} {code}: {DETERMINISTIC.get(code, 'would fail the same way')}"
            for code, n in sorted(self.skipped.items())
        )
        return (
            f"batch {batch}: {plural(total, 'failed session')} skipped, they would fail again"
            f" the same way ({parts}); --include-4xx or --codes CODE runs them too"
        )


def parse_codes(text: str) -> frozenset[str]:
    """`--codes provider_timeout,tool_call_limit`: the codes named, each one a session can
    end with; an UnknownCodes naming the rest and the valid ones."""
    named = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in named if c not in SESSION_ERROR_CODES]
    if unknown or not named:
        valid = ", ".join(sorted(SESSION_ERROR_CODES))
        raise UnknownCodes(f"unknown code {','.join(unknown) or text!r}; valid codes: {valid}")
    return frozenset(named)


def fails_again(session: FailedSession) -> bool:
    """Whether running it again with the same spec ends the same way."""
    if session.code not in DETERMINISTIC:
        return False
    found = _HTTP_STATUS.search(session.message)
    if session.code == "provider_error" and found is not None:
        status = int(found.group(1))
        return 400 <= status < 500 and status not in RETRYABLE_STATUSES
    return True


def choose(
    failed: Sequence[FailedSession], codes: frozenset[str] | None, include_4xx: bool
) -> RetryChoice:
    """The sessions to run again: every failed one (`codes` None) or those with one of
    `codes`; those that fail again the same way are skipped (counted by code) unless
    `include_4xx` or their code is named in `codes`."""
    chosen: list[FailedSession] = []
    skipped: Counter[str] = Counter()
    for session in failed:
        if codes is not None:  # a code named is asked for, deterministic or not
            if session.code in codes:
                chosen.append(session)
        elif not include_4xx and fails_again(session):
            skipped[session.code] += 1
        else:
            chosen.append(session)
    return RetryChoice(chosen, dict(skipped))

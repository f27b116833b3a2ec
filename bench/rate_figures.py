"""The figures of `python -m bench.rate` (bench/rate.py), computed from the replay server's
per-second timeline (`GET /limits`: `[epoch_second, accepted, refused]` rows) and the times the
run's events happened. Pure functions, so that the definitions are unit-tested on synthetic
timelines rather than trusted to a 4-minute fleet run.

A timeline row `[s, a, r]` counts the requests of the wall-clock second [s, s+1). A window
[start, end) of fractional epoch times takes each second's counts in proportion to its overlap
with the window (a second half inside counts half).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

Timeline = Sequence[Sequence[int]]

# the scenario at scale 1, in seconds from t0 (the submit)
MARGIN_S = 10.0  # each phase's first seconds are left out: the controller settles
HALVE_AT_S = 60.0
RESTORE_AT_S = 120.0
JOIN_AT_S = 150.0
JOIN_WINDOW_S = 20.0
RPS = 20.0
HALVED_RPS = 10.0
BACKLOG_FACTOR = 2.0  # the backlog has ended once fewer than this many seconds' worth remain
RECOVERY_SHARE = 0.8
RECOVERY_AVERAGE_S = 3

# goals
UTIL_GOAL = 0.90
SHARE_429_GOAL = 0.02
RECOVERY_GOAL_S = 60.0


@dataclass(frozen=True)
class Events:
    """When the run's events happened (epoch seconds) and the limits in force between them."""

    t0: float
    halved_at: float
    restored_at: float
    joined_at: float
    margin_s: float = MARGIN_S
    join_window_s: float = JOIN_WINDOW_S
    rps: float = RPS
    halved_rps: float = HALVED_RPS

    def limit_at(self, second: float) -> float:
        return self.halved_rps if self.halved_at <= second < self.restored_at else self.rps


def window(timeline: Timeline, start: float, end: float) -> tuple[float, float]:
    """(accepted, refused) in [start, end), each second weighed by its overlap."""
    accepted = refused = 0.0
    for second, acc, ref in timeline:
        overlap = min(end, second + 1) - max(start, second)
        if overlap > 0:
            accepted += acc * overlap
            refused += ref * overlap
    return accepted, refused


def utilisation(timeline: Timeline, start: float, end: float, rps: float) -> float | None:
    """Accepted requests over what the limit allowed in [start, end) (None if empty)."""
    if end <= start:
        return None
    accepted, _ = window(timeline, start, end)
    return accepted / (rps * (end - start))


def share_429(timeline: Timeline, start: float = -math.inf, end: float = math.inf) -> float | None:
    """Refused over all requests in [start, end) (None when there were none)."""
    accepted, refused = window(timeline, start, end)
    total = accepted + refused
    return None if total == 0 else refused / total


def backlog_end(
    timeline: Timeline, events: Events, sessions: int, failed_at: Iterable[float] = ()
) -> float | None:
    """t_end: the end of the first whole second s (from t0's) after which fewer than
    BACKLOG_FACTOR x the limit's rps sessions were left unadmitted, i.e. neither accepted by
    the server nor ended failed (`failed_at`: when sessions that never got through ended).
    None while the backlog never got that small (sessions left unfinished)."""
    accepted = {int(row[0]): int(row[1]) for row in timeline}
    failures = sorted(math.floor(t) for t in failed_at)
    first = math.floor(events.t0)
    last = max([*accepted, *failures, first])
    left = sessions
    f = 0
    for second in range(first, last + 1):
        left -= accepted.get(second, 0)
        while f < len(failures) and failures[f] <= second:
            left -= 1
            f += 1
        if left < BACKLOG_FACTOR * events.limit_at(second):
            return float(second + 1)
    return None


def recovery_s(timeline: Timeline, events: Events, until: float | None) -> float | None:
    """Seconds from the restore until a RECOVERY_AVERAGE_S-second moving average of accepted
    requests first reaches RECOVERY_SHARE of the restored rps: the end of the first such
    window of whole seconds, all after the restore, and before `until` (t_end)."""
    accepted = {int(row[0]): int(row[1]) for row in timeline}
    if not accepted:
        return None
    first = math.ceil(events.restored_at)
    stop = math.floor(until) if until is not None else max(accepted) + 1
    goal = RECOVERY_SHARE * events.rps
    for end in range(first + RECOVERY_AVERAGE_S, stop + 1):
        seconds = range(end - RECOVERY_AVERAGE_S, end)
        if sum(accepted.get(s, 0) for s in seconds) / RECOVERY_AVERAGE_S >= goal:
            return end - events.restored_at
    return None


@dataclass
class Figures:
    """One run's figures (fractions, seconds from the restore; None: not measurable)."""

    protocol: str
    mode: str  # "adaptive" or "before" (adaptive off)
    util: list[float | None]
    share_429: float | None
    share_429_join: float | None
    recovery_s: float | None
    t_end_s: float | None  # from t0
    sessions: int
    ok: int
    failed: dict[str, int] = field(default_factory=dict)
    unfinished: int = 0
    accepted: int = 0
    refused: int = 0
    wall_s: float = 0.0
    rate_control: dict[str, int] = field(default_factory=dict)  # log lines per reason

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def figures(
    protocol: str,
    mode: str,
    limits: Mapping[str, Any],
    events: Events,
    outcomes: Mapping[str, int],
    failed_at: Sequence[float],
    sessions: int,
) -> Figures:
    """Every figure of a run from GET /limits' answer, its events and its sessions' outcomes
    (`outcomes`: "ok", each error code, "unfinished" -> how many)."""
    timeline: Timeline = limits.get("timeline") or []
    t_end = backlog_end(timeline, events, sessions, failed_at)
    end3 = t_end if t_end is not None else max([events.t0, *(r[0] + 1 for r in timeline)])
    m = events.margin_s
    util = [
        utilisation(timeline, events.t0 + m, events.halved_at, events.rps),
        utilisation(timeline, events.halved_at + m, events.restored_at, events.halved_rps),
        utilisation(timeline, events.restored_at + m, end3, events.rps),
    ]
    join_end = events.joined_at + events.join_window_s
    failed = {code: n for code, n in outcomes.items() if code not in ("ok", "unfinished") and n}
    return Figures(
        protocol=protocol,
        mode=mode,
        util=util,
        share_429=share_429(timeline),
        share_429_join=share_429(timeline, events.joined_at, min(join_end, end3)),
        recovery_s=recovery_s(timeline, events, t_end),
        t_end_s=None if t_end is None else t_end - events.t0,
        sessions=sessions,
        ok=outcomes.get("ok", 0),
        failed=dict(sorted(failed.items())),
        unfinished=outcomes.get("unfinished", 0),
        accepted=int(limits.get("accepted", 0)),
        refused=int(limits.get("refused", 0)),
    )


# --- the table ------------------------------------------------------------------------------

HEADER = ("protocol", "mode", "util 1", "util 2", "util 3", "429", "429 join", "recovery",
          "failed", "unfinished", "t_end", "wall")  # fmt: skip
GOALS = ("goal", "", f">={UTIL_GOAL:.0%}", f">={UTIL_GOAL:.0%}", f">={UTIL_GOAL:.0%}",
         f"<={SHARE_429_GOAL:.0%}", f"<={SHARE_429_GOAL:.0%}", f"<={RECOVERY_GOAL_S:.0f} s",
         "0", "0", "", "")  # fmt: skip


def _mark(text: str, met: bool) -> str:
    return f"{text} met" if met else f"{text} NOT MET"


def _pct(value: float | None, met: bool) -> str:
    return _mark("-" if value is None else f"{value:.1%}", met)


def verdicts(f: Figures) -> list[bool]:
    """Whether each goal is met: util 1-3, 429 share, after the join, recovery, failed,
    unfinished (a figure that could not be measured is not met)."""
    return [
        *(u is not None and u >= UTIL_GOAL for u in f.util),
        f.share_429 is not None and f.share_429 <= SHARE_429_GOAL,
        f.share_429_join is not None and f.share_429_join <= SHARE_429_GOAL,
        f.recovery_s is not None and f.recovery_s <= RECOVERY_GOAL_S,
        not f.failed,
        f.unfinished == 0,
    ]


def cells(f: Figures) -> tuple[str, ...]:
    met = verdicts(f)
    failed = sum(f.failed.values())
    recovery = "never" if f.recovery_s is None else f"{f.recovery_s:.0f} s"
    return (
        f.protocol,
        f.mode,
        *(_pct(u, ok) for u, ok in zip(f.util, met[:3], strict=True)),
        _pct(f.share_429, met[3]),
        _pct(f.share_429_join, met[4]),
        _mark(recovery, met[5]),
        _mark(str(failed), met[6]),
        _mark(str(f.unfinished), met[7]),
        "-" if f.t_end_s is None else f"{f.t_end_s:.0f} s",
        f"{f.wall_s:.0f} s",
    )


def table(rows: Sequence[Figures]) -> list[str]:
    """The table's lines: a header, the goals line, a row per run."""
    lines = [HEADER, GOALS, *(cells(f) for f in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines]  # fmt: skip

"""A rate controller's state as Redis keeps it (a hash, cq:rc:{id}): the field names the
worker's scripts write and `cchatq status` and the metrics exporter read, and what a reader
makes of them. The control law itself is the worker's (worker/edges/rate_control_lua.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# w window, ss slow start (1/0), hrps/htps the pace the provider's headers gave (per second),
# lp a pace learned from 429s, pmax the pace 429s came at (0: none, or left behind), crps/ctps
# the configured ceilings, tat/ttat the next request's and token's due time (ms), lat smoothed
# latency (ms), cut/l429/grow the last cut, 429 and growth (ms),
# tail the waiting room's last ticket (ms), racc/rt the smoothed count of granted calls and
# when it was last added to, n/n429/nden calls granted, 429s, and asks refused room,
# why/when the last change and its time (ms)
FIELDS = (
    "w", "ss", "hrps", "htps", "lp", "pmax", "crps", "ctps", "tat", "ttat", "lat", "cut", "l429",
    "grow", "tail", "racc", "rt", "n", "n429", "nden", "why", "when",
)  # fmt: skip
RATE_TAU_MS = 5_000  # the granted rate is smoothed over about this long


def effective_pace(hrps: float, lp: float, ceiling: float) -> float:
    """The pace calls are held to: the provider's, a learned one below it, the ceiling; 0 none."""
    paces = [p for p in (hrps, lp, ceiling) if p > 0]
    return min(paces) if paces else 0.0


@dataclass(frozen=True)
class ControllerStatus:
    id: str  # backend/account digest/model
    window: float
    slow_start: bool
    pace_rps: float  # 0: no pace
    pace_tokens_per_s: float
    in_flight: int
    granted_per_s: float  # smoothed
    utilisation: float  # of the pace when there is one, else of the window
    calls: int
    rate_limited: int  # 429s
    refused_room: int  # asks that had to wait
    last_change: str
    last_change_ago_s: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def controller_status(
    cid: str, raw: Mapping[str, str], in_flight: int, now_ms: float
) -> ControllerStatus:
    def num(name: str) -> float:
        try:
            value = float(raw.get(name, "0") or 0)
        except ValueError:
            return 0.0
        return value if math.isfinite(value) else 0.0

    pace = effective_pace(num("hrps"), num("lp"), num("crps"))
    tokens = effective_pace(num("htps"), 0.0, num("ctps"))
    rt = num("rt")
    granted = num("racc") * math.exp(-(now_ms - rt) / RATE_TAU_MS) * 1000 / RATE_TAU_MS if rt else 0
    window = num("w")
    used = granted / pace if pace > 0 else in_flight / max(math.floor(window), 1)
    when = num("when")
    return ControllerStatus(
        id=cid,
        window=round(window, 2),
        slow_start=num("ss") == 1,
        pace_rps=round(pace, 3),
        pace_tokens_per_s=round(tokens, 1),
        in_flight=in_flight,
        granted_per_s=round(granted, 2),
        utilisation=round(used, 3),
        calls=int(num("n")),
        rate_limited=int(num("n429")),
        refused_room=int(num("nden")),
        last_change=raw.get("why", "") or "",
        last_change_ago_s=round((now_ms - when) / 1000, 1) if when else None,
    )

"""A run's progress (a batch's, or a program run's chats'): counts by state and outcome, the
rate in sessions per second and the time left, from each member's status and finish time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from producer.viewer.model import ERROR, GONE, OK, QUEUED, RUNNING, RunRow

if TYPE_CHECKING:
    from producer.batches import BatchSummary

RECENT_S = 30.0  # the rate while a run goes on: sessions finished in this last window


@dataclass(frozen=True)
class Member:
    """One session of a run as its progress counts it."""

    status: str  # queued | running | ok | error | gone
    code: str | None = None
    finished_ms: int | None = None
    latency_ms: int | None = None


def run_row(
    kind: str,
    key: str,
    batch: str,
    submitted_ms: int,
    members: Sequence[Member],
    now_ms: int | None,
    finished: bool | None = None,
    source: str = "",
) -> RunRow:
    """`now_ms` None: an offline run (a results file), timed by its sessions' latencies."""
    counts: Counter[str] = Counter(m.status for m in members)
    failures: Counter[str] = Counter(m.code or ERROR for m in members if m.status == ERROR)
    done = counts[OK] + counts[ERROR]
    pending = counts[QUEUED] + counts[RUNNING]
    ends = [m.finished_ms for m in members if m.finished_ms is not None]
    if now_ms is None:
        latencies = [m.latency_ms for m in members if m.latency_ms is not None]
        elapsed_s = max(latencies, default=0) / 1000
    elif pending or not ends:
        elapsed_s = max(0, now_ms - submitted_ms) / 1000
    else:
        elapsed_s = max(0, max(ends) - submitted_ms) / 1000
    rate: float | None = done / elapsed_s if elapsed_s > 0 and done else None
    if now_ms is not None and pending and ends:
        recent = sum(1 for end in ends if now_ms - end <= RECENT_S * 1000)
        window = min(RECENT_S, elapsed_s)
        rate = recent / window if window > 0 and recent else rate
    finished = (pending == 0) if finished is None else finished
    eta_s: float | None = 0.0 if finished else None
    if pending and rate:
        eta_s = pending / rate
    return RunRow(
        kind=kind,
        key=key,
        batch=batch,
        submitted_ms=submitted_ms,
        sessions=len(members),
        queued=counts[QUEUED],
        running=counts[RUNNING],
        done=done,
        gone=counts[GONE],
        ok=counts[OK],
        failures=dict(sorted(failures.items())),
        rate=None if rate is None else round(rate, 3),
        eta_s=None if eta_s is None else round(eta_s, 1),
        elapsed_s=round(elapsed_s, 3),
        finished=finished,
        source=source,
    )


def summary_row(summary: BatchSummary, recent: int, now_ms: int) -> RunRow:
    """A batch's row from its counts (`Batches.summary`, a big batch's from its ended index) rather
    than from each session: `recent`, the sessions that ended in the last RECENT_S."""
    states = summary.states
    done = states.get("done", 0)
    pending = summary.unfinished
    ok = summary.outcomes.get(OK, 0)
    last = summary.last_finished_ms
    if pending or last is None:
        elapsed_s = max(0, now_ms - summary.submitted_ms) / 1000
    else:
        elapsed_s = max(0, last - summary.submitted_ms) / 1000
    rate: float | None = done / elapsed_s if elapsed_s > 0 and done else None
    if pending and recent:
        window = min(RECENT_S, elapsed_s)
        rate = recent / window if window > 0 else rate
    eta_s: float | None = 0.0 if not pending else pending / rate if rate else None
    return RunRow(
        kind="batch",
        key=summary.batch,
        batch=summary.batch,
        submitted_ms=summary.submitted_ms,
        sessions=summary.sessions,
        queued=states.get(QUEUED, 0),
        running=states.get(RUNNING, 0),
        done=done,
        gone=states.get(GONE, 0),
        ok=ok,
        failures={c: n for c, n in sorted(summary.outcomes.items()) if c != OK},
        rate=None if rate is None else round(rate, 3),
        eta_s=None if eta_s is None else round(eta_s, 1),
        elapsed_s=round(elapsed_s, 3),
        finished=not pending,
    )

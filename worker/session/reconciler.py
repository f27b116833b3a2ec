"""The fleet's reconciler: recovery that needs no producer. One worker at a time
(a Redis lock) looks for sessions that show no progress for a while and nudges each: its next
step is published again from stored state, unless a step of it is leased (running) or already
published. It covers `--no-wait` batches, producers that died, and messages a broker lost.
A stalled session older than the fleet's deadline is not nudged but ended, deadline_exceeded
(its finish step writes the body), so none outlives its keys without one. Both ages are on
the store's clock (Redis's), the one every mark and submit is stamped on: a worker or a
producer whose host clock is off never makes a live session look stalled or overdue.

Each pass it runs is one reconciler.pass trace event (the fleet's stream only: one XADD a pass,
fleet-wide) with the sessions it nudged and forgot, for the metrics; its write keeps the fleet's
stream's TTL and trims its old events.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.errors import StoreError
from worker.session.store_ports import STEP_LEASE_MS, Reconciling
from worker.session.trace import event

if TYPE_CHECKING:
    from worker.session.steps import StepRunner

log = logging.getLogger(__name__)

# A session is looked at once it showed no progress (a round starting, its submit) for this
# long: twice a step's lease, so a step whose worker died is free again by then.
QUIET_MS = 2 * STEP_LEASE_MS
MOST_PER_TURN = 500


@dataclass
class Reconciler:
    runner: StepRunner
    store: Reconciling
    every_s: float = 10.0
    quiet_ms: int = QUIET_MS
    deadline_ms: int = 43_200_000
    results_keep: int = 0  # > 0: finished sessions' results kept by count (CCHATQ_RESULTS_KEEP)

    def turn(self) -> int:
        """One round of reconciling, if it is this process's turn: how many were nudged."""
        if not self.store.take_reconciler_turn(int(self.every_s * 1000 * 0.9)):
            return 0
        nudged = forgotten = overdue = 0
        stalled = self.store.stalled(self.quiet_ms, MOST_PER_TURN)
        now_ms = self.store.now_ms()
        submitted = self.store.submitted_ms(stalled) if stalled else []
        for sk, since_ms in zip(stalled, submitted, strict=True):
            try:
                if since_ms is not None and now_ms - since_ms > self.deadline_ms:
                    self.runner.end_overdue(sk, self.deadline_ms)
                    overdue += 1
                    continue
                if self.runner.nudge(sk):
                    nudged += 1
                    continue
            except StoreError:  # Redis itself failing: the next turn tries again
                continue
            self.store.forget_session(sk)  # expired: nothing is left to recover
            forgotten += 1
        if nudged or overdue:
            log.info("reconciler: nudged %d sessions with no progress, ended %d", nudged, overdue)
        if self.results_keep:
            with contextlib.suppress(StoreError):  # the next turn trims what this one could not
                self.store.trim_results(self.results_keep)
        if self.runner.settings.trace:  # counted for the metrics, never in the way
            counts = {"nudged": nudged, "forgotten": forgotten, "overdue": overdue}
            passed = event("reconciler.pass", "", **counts)
            with contextlib.suppress(StoreError):  # it tends the fleet's stream: its TTL
                self.runner.guard.trace_now("", passed, expire=True)  # and its age
        return nudged

"""The fleet's reconciler (issue 10): recovery that needs no producer. One worker at a time
(a Redis lock) looks for sessions that show no progress for a while and nudges each: its next
step is published again from stored state, unless a step of it is leased (running) or already
published. It covers `--no-wait` batches, producers that died, and messages a broker lost.

Each pass it runs is one reconciler.pass trace event (the fleet's stream only: one XADD a pass,
fleet-wide) with the sessions it nudged and forgot, for the metrics.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from worker.errors import SpecMissingError, StoreError
from worker.session.ports import STEP_LEASE_MS
from worker.session.trace import event

if TYPE_CHECKING:
    from worker.session.steps import StepRunner

log = logging.getLogger(__name__)

# A session is looked at once it showed no progress (a round starting, its submit) for this
# long: twice a step's lease, so a step whose worker died is free again by then.
QUIET_MS = 2 * STEP_LEASE_MS
MOST_PER_TURN = 500


class ReconcileStore(Protocol):
    def take_reconciler_turn(self, hold_ms: int) -> bool: ...
    def stalled(self, quiet_ms: int, most: int) -> list[str]: ...
    def forget_session(self, sk: str) -> None: ...


@dataclass
class Reconciler:
    runner: StepRunner
    store: ReconcileStore
    every_s: float = 10.0
    quiet_ms: int = QUIET_MS

    def turn(self) -> int:
        """One round of reconciling, if it is this process's turn: how many were nudged."""
        if not self.store.take_reconciler_turn(int(self.every_s * 1000 * 0.9)):
            return 0
        nudged = forgotten = 0
        for sk in self.store.stalled(self.quiet_ms, MOST_PER_TURN):
            try:
                self.runner.nudge(sk)
                nudged += 1
            except SpecMissingError:  # expired: nothing is left to recover
                self.store.forget_session(sk)
                forgotten += 1
            # another StoreError is Redis itself failing: the next turn tries again
        if nudged:
            log.info("reconciler: nudged %d sessions with no progress", nudged)
        if self.runner.settings.trace:  # counted for the metrics, never in the way
            passed = event("reconciler.pass", "", nudged=nudged, forgotten=forgotten)
            with contextlib.suppress(StoreError):
                self.runner.guard.trace_now("", passed)
        return nudged

"""Saying that Redis refuses writes, once: one warning line when it starts, one when it takes
writes again, per process and topic (not a line per step, per beat or per retry). Used by the
step guard and by the Redis edges (worker/edges/redis_errors.py translates the refusals)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from worker.errors import StoreUnavailableError, StoreUnreachableError

T = TypeVar("T")

log = logging.getLogger("worker.session.guard")


class RefusalNotice:
    """One warning line when Redis starts refusing writes, and one when it takes them again,
    per process and topic (not a line per step, per beat or per retry)."""

    def __init__(self, topic: str, logger: logging.Logger = log) -> None:
        self.topic = topic
        self.log = logger
        self._since: float | None = None
        self._lock = threading.Lock()

    def refused(self, reason: str, detail: str = "") -> None:
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        shown = f": {detail}" if detail else ""
        self.log.warning(
            "%s: Redis refuses writes (%s%s): waiting, and trying again", self.topic, reason, shown
        )

    def accepted(self) -> None:
        if self._since is None:  # the usual case: no lock, no line
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            self.log.warning(
                "%s: Redis takes writes again after %.0f s", self.topic, time.monotonic() - since
            )

    @property
    def refusing(self) -> bool:
        return self._since is not None


# the steps' notice: one line for all the steps of a process, however many wait
STEPS = RefusalNotice("steps")
# set when the worker is stopping: a step waiting for Redis stops waiting and is handed back
# (its message stays held in Redis if even that is refused), so a warm shutdown is not held
# up by a refusal for the whole wait
STOPPING = threading.Event()
FIRST_PAUSE_S = 0.5
LONGEST_PAUSE_S = 4.0  # progress resumes within this of Redis taking writes again


class Patience:
    """How long one delivery of a step waits in its worker for a Redis that refuses writes:
    pauses from FIRST_PAUSE_S doubling to LONGEST_PAUSE_S, `budget_s` in all. It also keeps
    the delivery's try count once its lease is taken, so a step that runs again after a
    refusal is the same try (guard.py)."""

    def __init__(self, budget_s: float, sleep: Callable[[float], None]) -> None:
        self.left_s = budget_s
        self.sleep = sleep
        self._pause_s = FIRST_PAUSE_S
        self.counted: tuple[int, bool] | None = None  # (tries, stored) once a lease was taken

    def wait(self, exc: StoreUnavailableError | StoreUnreachableError) -> bool:
        """Pause before trying again (True), or False once the budget is spent."""
        if isinstance(exc, StoreUnavailableError):  # no answer is logged by who met it
            STEPS.refused(exc.reason)
        if self.left_s <= 0 or STOPPING.is_set():
            return False
        pause_s = min(self._pause_s, self.left_s)
        self.sleep(pause_s)
        self.left_s -= pause_s
        self._pause_s = min(self._pause_s * 2, LONGEST_PAUSE_S)
        return True


def keep_writing(write: Callable[[], T], budget_s: float, sleep: Callable[[float], None]) -> T:
    """A write of what cost a call (a model's reply), tried again in place while Redis refuses
    writes or does not answer, for `budget_s` at most: thrown away, the reply would be bought
    again by the step's next run. What the write does must be idempotent (first writer wins)."""
    patience = Patience(budget_s, sleep)
    while True:
        try:
            return write()
        except (StoreUnavailableError, StoreUnreachableError) as exc:
            if not patience.wait(exc):
                raise

"""The Dispatcher port in memory: published steps wait in a queue until `drain` runs them on a
StepRunner, each kind on its step method, as the Celery tasks (worker/tasks.py) do."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.errors import RetryLater, StepDeadLettered
from worker.session.ports import StepPublisher
from worker.session.store_ports import Commit, NextStep

Published = tuple[Any, ...]  # ("round", sk, r) | ("tool", sk, r, i) | ("finish", sk) | ...


class StepTarget(Protocol):
    """What runs the published steps: a StepRunner's step methods."""

    def start(self, batch: str, chunk_no: int) -> str | None: ...
    def round(self, sk: str, round_no: int) -> str | None: ...
    def tool(self, sk: str, round_no: int, index: int, background: bool = False) -> str | None: ...
    def finish(self, sk: str) -> str | None: ...


def run_step(
    target: StepTarget, step: Published, program: Callable[[str], object] | None = None
) -> None:
    """One delivery of a published step, on the method its kind names (a program run's on
    `program`, which the guest package provides)."""
    kind, *args = step
    if kind == "round":
        target.round(args[0], args[1])
    elif kind == "tool":
        target.tool(args[0], args[1], args[2])
    elif kind == "background":
        target.tool(args[0], args[1], args[2], background=True)
    elif kind == "finish":
        target.finish(args[0])
    elif kind == "start":
        target.start(args[0], args[1])
    elif kind == "program" and program is not None:
        program(args[0])
    else:
        raise AssertionError(f"no step method runs {step}")


@dataclass
class StepQueue(StepPublisher):
    """The Dispatcher port: published steps wait here until `drain` runs them. A step that asks
    to be retried goes to the back of the queue, or to `park` (which holds it until it is due,
    as Celery's `retry(countdown=...)` does) when one is given."""

    pending: deque[Published] = field(default_factory=deque)
    sent: list[Published] = field(default_factory=list)
    retries: int = 0
    failed: list[Published] = field(default_factory=list)  # tasks that ended as FAILURE
    crashed: list[tuple[Published, Exception]] = field(default_factory=list)  # raised otherwise
    park: Callable[[Published, RetryLater], None] | None = None
    runs_program: Callable[[str], object] | None = None  # a program step's runner (the guest's)

    def start(self, batch: str, chunk_no: int) -> None:
        self._put(("start", batch, chunk_no))

    def publish(self, steps: Sequence[NextStep], commit: Commit | None = None) -> None:
        for step in steps:
            self._put((step.kind, *step.args))

    def _put(self, step: Published) -> None:
        self.sent.append(step)
        self.pending.append(step)

    def drain(self, target: StepTarget, max_steps: int = 10_000) -> int:
        """Run published steps on `target` until none is left. Returns how many ran."""
        ran = 0
        while self.pending:
            if ran >= max_steps:
                raise RuntimeError(f"more than {max_steps} steps: a loop?")
            self.run_next(target)
            ran += 1
        return ran

    def run_next(self, target: StepTarget) -> Published:
        """Run the oldest published step once (a retry requeues it, or parks it)."""
        step = self.pending.popleft()
        try:
            run_step(target, step, self.runs_program)
        except RetryLater as exc:
            self.retries += 1
            if self.park is None:
                self.pending.append(step)
            else:
                self.park(step, exc)
        except StepDeadLettered:  # a Celery FAILURE: the task is done, its sessions ended
            self.failed.append(step)
        except Exception as exc:
            self.crashed.append((step, exc))
            raise
        return step

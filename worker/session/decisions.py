"""One decision per step: what a step must do, as a value of one of these kinds, carrying the
plan's own values (its runs, the calls it answered without running, its finish body) to the
applier (worker.session.apply), which carries each kind out the same way whichever step made
it."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.fleet import max_parallel
from worker.session.ending import Ending
from worker.session.engine import CallModel, Finish, RunTools, Step
from worker.session.outcomes import ToolOutcome
from worker.session.state import Session


@dataclass(frozen=True)
class CallNext:
    """Publish the round step of round `round_no`: the model is called again."""

    round_no: int


@dataclass(frozen=True)
class StartTools:
    """Store the calls the plan answered without running and publish the tool steps of
    `publish` (its first runs, at most `window`); the next round once every call is answered.
    When more calls wait than may run (`queued`), the published ones hold places."""

    plan: RunTools
    publish: tuple[int, ...]
    window: int  # max_parallel

    @property
    def queued(self) -> bool:
        return len(self.plan.runs) > self.window


@dataclass(frozen=True)
class ToolAnswered:
    """A tool step's outcome: stored, and the next round published once every call of the
    round is answered; until then, with more calls than `window`, the next waiting call."""

    round_no: int
    index: int
    outcome: ToolOutcome
    call_count: int
    window: int


@dataclass(frozen=True)
class EndSession:
    """The session ends here, under the ending rules (worker.session.ending), from its state
    and the plan's value for it (a Finish, or what the rules override; None: planned by the
    ending rules, which end the session even when its state cannot be planned on)."""

    session: Session
    step: Step | None


@dataclass(frozen=True)
class FinishLater:
    """The session ends in a finish step of its own (it runs the ending rules there)."""


@dataclass(frozen=True)
class WriteEnding:
    """Write this ending (a program run's, or one decided without the session's rounds)."""

    ending: Ending


Decision = CallNext | StartTools | ToolAnswered | EndSession | FinishLater | WriteEnding


def decide(session: Session, step: Step) -> Decision:
    """The decision of a step that planned `step` for `session` (a round step, or a finish)."""
    if isinstance(step, CallModel):
        return CallNext(step.round_no)
    if isinstance(step, RunTools):
        window = max_parallel(session.limits, session.fleet)
        first = tuple(run.index for run in step.runs[:window])  # the rest start as these end
        return StartTools(step, first, window)
    assert isinstance(step, Finish)
    return EndSession(session, step)

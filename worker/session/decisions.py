"""One decision per step: what the engine says a step must do, as a value. The steps apply it
(`StepRunner.apply`), the same way for the round, tool, nudge, finish and program steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.fleet import max_parallel
from worker.session.engine import CallModel, Finish, Session, plan
from worker.session.outcomes import ToolOutcome


@dataclass(frozen=True)
class Ending:
    """How a session ends: its response body and its result record."""

    body: dict[str, Any]
    record: dict[str, Any]


@dataclass(frozen=True)
class Decision:
    """Everything one step must do, as the engine decided it; `steps.StepRunner.apply` carries
    it out, the same way for the round, tool, nudge and finish steps."""

    round_no: int = 0
    store: dict[int, ToolOutcome] = field(default_factory=dict)  # tool messages of round_no
    tools: tuple[int, ...] = ()  # tool steps of round_no to publish
    fan_in: int | None = None  # publish round_no + 1 once this many calls are answered
    # until then, keep this many tool steps of the round in flight (limits.max_parallel)
    refill: int | None = None
    next_round: int | None = None  # publish this round step
    finish: bool = False  # the session ends: in place from a round step, else a finish step
    ending: Ending | None = None  # write this result


def decide(session: Session) -> Decision:
    """What follows the stored state: the plan as a decision (round and nudge steps)."""
    step = plan(session)
    if isinstance(step, Finish):
        return Decision(finish=True)
    if isinstance(step, CallModel):
        return Decision(next_round=step.round_no)
    window = max_parallel(session.limits, session.fleet)
    runs = tuple(run.index for run in step.runs)
    return Decision(
        round_no=step.round_no,
        store=step.presets,
        tools=runs[:window],  # the rest start as these finish
        fan_in=step.call_count,
        refill=window if len(runs) > window else None,
    )


def after_tool(
    round_no: int, index: int, outcome: ToolOutcome, call_count: int, window: int
) -> Decision:
    """A tool step's outcome: stored, and the next round once every call is answered; until
    then, with more calls than `window` (max_parallel), the next waiting call starts."""
    refill = window if call_count > window else None
    return Decision(round_no=round_no, store={index: outcome}, fan_in=call_count, refill=refill)

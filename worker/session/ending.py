"""How a chat session ends, in one place: the ending rules (a dead-lettered step's failure wins,
then a cancel, then the plan's finish), the answers its last round's unanswered calls get in its
transcript, and its result record with its metrics. Pure, like the engine: the applier writes
the Ending it returns."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from schemas import keys
from schemas.bodies import is_error_body
from schemas.spec_types import ProgramSpec
from worker.errors import CancelledError, InternalError, ToolNotRunError
from worker.session.engine import CANCELLED, Finish, RunTools, Step, plan
from worker.session.outcomes import ToolOutcome
from worker.session.state import Session
from worker.session.tool_logs import record_entries
from worker.session.transcript import transcript

log = logging.getLogger(__name__)
FAILED = ToolOutcome.error(ToolNotRunError("session failed before this call ran"))


@dataclass(frozen=True)
class Ending:
    """How a session ends: its response body and its result record."""

    body: dict[str, Any]
    record: dict[str, Any]


def ending(
    session: Session,
    step: Step | None,
    failure: dict[str, Any] | None,
    cancelled: bool,
    latency_ms: int,
) -> Ending:
    """The ending of a session whose plan for its stored state is `step` (None: planned here).
    Never raises: an engine that fails on this session (a bug, a state it cannot read) still
    ends it, with the dead-lettered body or internal_error, and a bare record."""
    missing: ToolOutcome | None = None
    try:
        if step is None:
            step = plan(session)
        if failure is not None:
            result, missing = failure, FAILED
        elif cancelled:
            result, missing = CancelledError("session cancelled").body(), CANCELLED
        elif isinstance(step, Finish):
            result = step.body
        else:
            result = InternalError("finish before the session ended").body()
            missing = CANCELLED
        record = {
            "id": session.spec.id,
            "status": "error" if is_error_body(result) else "ok",
            "body": result,
            "transcript": transcript(session, closing_fill(session, step, missing)),
            "metrics": metrics(session, latency_ms) if session.flags.metrics else {},
        }
        if session.spec.metadata:  # the spec's own, given back with its result
            record["metadata"] = session.spec.metadata
        logs = tool_logs(session)
        if logs:  # only then: a session whose tools wrote nothing keeps its record's shape
            record["tool_logs"] = logs
        return Ending(result, record)
    except Exception as exc:
        log.exception("session %s: ending rules failed", session.spec.id)
        error = InternalError(f"the session could not be ended normally: {type(exc).__name__}")
        body = failure or error.body()
        return Ending(body, bare_record(session.spec.id, body))


def closing_fill(
    session: Session, step: Step, missing: ToolOutcome | None
) -> dict[int, ToolOutcome]:
    """What the last round's calls without an outcome answer in the transcript: what the plan
    answered them with (calls not run, a limit, an unknown tool), and `missing` for the rest."""
    if isinstance(step, Finish):
        fill = dict(step.fill)
    elif isinstance(step, RunTools):
        fill = dict(step.presets)
    else:
        fill = {}
    if missing is not None and session.rounds and session.auto_tool_call:
        for i in range(len(session.rounds[-1].reply.calls)):
            fill.setdefault(i, missing)
    return fill


def running_steps(sk: str, session: Session) -> list[str]:
    """The steps of a chat session that may still be running when it is to end: the round
    after its stored ones (its model call in flight), its last stored round (its commit not
    written yet) and that round's tool steps. An end waits for them, so that it counts what
    they did (a completed call's tokens) and is the session's last event."""
    rounds = len(session.rounds)
    steps = [keys.round_step(sk, rounds)]
    if rounds:
        last = rounds - 1
        steps.append(keys.round_step(sk, last))
        calls = session.rounds[last].reply.call_count
        steps.extend(keys.tool_step(sk, last, i) for i in range(calls))
    return steps


def bare_record(spec_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The record of a session whose transcript could not be built."""
    return {"id": spec_id, "status": "error", "body": body, "transcript": [], "metrics": {}}


def failed_program_record(spec: ProgramSpec, body: dict[str, Any]) -> dict[str, Any]:
    """A program run that ended without running to its end (dead-lettered or cancelled)."""
    return {
        "id": spec.id, "kind": "program", "status": "error", "body": body, "exit_code": None,
        "stdout": "", "stderr": "", "logs": [], "responses": [], "metrics": {},
    }  # fmt: skip


def tool_logs(session: Session) -> list[dict[str, Any]]:
    """What the session's tool calls wrote (their `log` lines, stdout and stderr), call after
    call in transcript order, each line marked with its call."""
    out: list[dict[str, Any]] = []
    for round_no, rnd in enumerate(session.rounds):
        for index, call in enumerate(rnd.reply.calls):
            outcome = rnd.outcomes.get(index)
            if outcome is None or not (outcome.logs or outcome.dropped_logs):
                continue
            mark = {"call_id": call.id, "round": round_no, "tool": call.name}
            out.extend(record_entries(mark, outcome.logs, outcome.dropped_logs))
    return out


def metrics(session: Session, latency_ms: int) -> dict[str, Any]:
    usage: dict[str, int] = {}
    tool_calls = tool_failures = output_bytes = 0
    for rnd in session.rounds:
        for key, value in rnd.reply.usage.items():
            if isinstance(value, int) and not isinstance(value, bool):
                usage[key] = usage.get(key, 0) + value
        for outcome in rnd.outcomes.values():
            tool_calls += 1
            tool_failures += 0 if outcome.ok else 1
            output_bytes += outcome.output_bytes
    return {
        "iterations": sum(1 for r in session.rounds if not r.reply.is_error),
        "latency_ms": latency_ms,
        "tool_calls": tool_calls,
        "tool_failures": tool_failures,
        "tool_output_bytes": output_bytes,
        "usage": usage,
    }

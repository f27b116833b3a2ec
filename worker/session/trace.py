"""Trace events (the README's "Trace events"): what happened in a session, as ids, codes, counts
and times, never prompts, arguments or outputs. The steps make them; the store keeps them in the
session's stream and the fleet's (`cchatq trace ID`), and each is one structured log line.

Events: session.started, model.call.started / finished / failed, tool.call.started /
finished / failed / retried, tool.logs (how many lines a call wrote: their text is the tool's,
kept in the record only), session.finished; for a background tool's call, task.submitted /
progress / completed / failed too; rate_limit.waited when a step is put off for its backend's
rate limit. A redelivered step may repeat one (at least once, like the steps themselves).

A step's kind and how long its body ran ride the last event it made (`kind`, `step_ms`: no
write of their own). For the fleet's metrics only, with no session (the fleet's stream only):
step.finished, for a step that made no event (a start or program step), and reconciler.pass.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, fields, replace
from typing import Any

from schemas import keys
from worker.codecs.reply import Reply
from worker.errors import RateLimited
from worker.session.outcomes import ToolOutcome

log = logging.getLogger("cchatq.trace")


@dataclass(frozen=True)
class TraceEvent:
    event: str
    session: str  # the spec's id; "" for a fleet event (the fleet's stream only)
    ts_ms: int
    round: int | None = None
    call_id: str | None = None
    tool: str | None = None
    attempt: int | None = None
    latency_ms: int | None = None
    error: str | None = None  # the error class or body code, never its message
    output_bytes: int | None = None
    request_id: str | None = None  # the provider's id of the reply
    backend: str | None = None  # model.call.*: the backend it went to
    tokens_in: int | None = None  # model.call.finished: the reply's usage
    tokens_out: int | None = None
    percent: int | None = None  # task.progress: how far a background call is
    message: str | None = None  # task.progress: the tool's own words (cut at 200 bytes)
    kind: str | None = None  # the step's kind (keys.step_kind), with step_ms or wait_ms
    step_ms: int | None = None  # how long the step's body ran, on its last event
    wait_ms: int | None = None  # rate_limit.waited: how long the step is put off
    reason: str | None = None  # rate_limit.waited: "429", or what had no room (window, pace...)
    nudged: int | None = None  # reconciler.pass: sessions nudged
    forgotten: int | None = None  # reconciler.pass: sessions forgotten (spec expired)
    overdue: int | None = None  # reconciler.pass: sessions ended past the fleet's deadline
    lines: int | None = None  # tool.logs: lines a call wrote and kept
    log_bytes: int | None = None  # tool.logs: their text's size
    dropped: int | None = None  # tool.logs: lines past the call's bound

    def to_json(self) -> dict[str, Any]:
        """The fields that are set (a stream entry, a log line, a `cchatq trace` line)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def event(name: str, session: str, **values: Any) -> TraceEvent:
    """An event stamped now, logged as one line as it is made."""
    made = TraceEvent(event=name, session=session, ts_ms=now_ms(), **values)
    if log.isEnabledFor(logging.INFO):
        log.info("%s", json.dumps(made.to_json(), separators=(",", ":")))
    return made


def step_timed(events: list[TraceEvent], step: str, started: float) -> None:
    """The step's kind and how long its body ran since `started` (time.monotonic), on the
    last of its `events` (they ride the write that ends it), or as a step.finished event of no
    session when it made none: one XADD (the fleet's stream) for a start or program step."""
    kind, step_ms = keys.step_kind(step), round((time.monotonic() - started) * 1000)
    if events:
        events[-1] = replace(events[-1], kind=kind, step_ms=step_ms)
    else:
        events.append(event("step.finished", "", kind=kind, step_ms=step_ms))


def rate_limit_waited(session: str, step: str, waited: RateLimited) -> TraceEvent:
    """rate_limit.waited: the step is put off (its task retried) for its backend's limit."""
    return event(
        "rate_limit.waited",
        session,
        kind=keys.step_kind(step),
        backend=waited.backend or None,
        wait_ms=round(waited.wait_s * 1000),
        reason=waited.reason or None,
    )


def model_call_ended(
    session: str, round_no: int, reply: Reply, latency_ms: int, backend: str
) -> TraceEvent:
    """model.call.finished (with its token counts), or .failed with the error body's code."""
    error = reply.error
    if error is not None:
        return event(
            "model.call.failed",
            session,
            round=round_no,
            latency_ms=latency_ms,
            error=str(error.get("code")),
            backend=backend,
        )
    request_id = reply.completion.get("id")
    return event(
        "model.call.finished",
        session,
        round=round_no,
        latency_ms=latency_ms,
        request_id=request_id if isinstance(request_id, str) else None,
        backend=backend,
        tokens_in=reply.tokens("prompt_tokens"),
        tokens_out=reply.tokens("completion_tokens"),
    )


def tool_call_ended(
    session: str, round_no: int, call_id: str, tool: str, outcome: ToolOutcome
) -> TraceEvent:
    """tool.call.finished, or .failed with its error class."""
    return event(
        "tool.call.finished" if outcome.ok else "tool.call.failed",
        session,
        round=round_no,
        call_id=call_id,
        tool=outcome.fallback or tool,
        attempt=outcome.retries,
        latency_ms=outcome.latency_ms,
        error=outcome.code,
        output_bytes=outcome.output_bytes if outcome.ok else None,
    )


def tool_logs_kept(
    session: str, round_no: int, call_id: str, tool: str, outcome: ToolOutcome
) -> TraceEvent:
    """tool.logs: how much a call wrote (the lines are in the session's record)."""
    return event(
        "tool.logs",
        session,
        round=round_no,
        call_id=call_id,
        tool=tool,
        lines=len(outcome.logs),
        log_bytes=sum(len(line.message.encode()) for line in outcome.logs),
        dropped=outcome.dropped_logs,
    )


def unrun_calls(
    session: str, round_no: int, reply: Reply, outcomes: dict[int, ToolOutcome]
) -> list[TraceEvent]:
    """tool.call.failed for the calls answered without running (unknown, invalid, denied,
    repeated, not run): they never started."""
    calls = reply.calls
    return [
        event(
            "tool.call.failed",
            session,
            round=round_no,
            call_id=calls[i].id,
            tool=calls[i].name,
            error=outcome.code,
        )
        for i, outcome in sorted(outcomes.items())
        if i < len(calls)
    ]

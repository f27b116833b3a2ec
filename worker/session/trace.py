"""Trace events (the README's "Trace events"): what happened in a session, as ids, codes, counts
and times, never prompts, arguments or outputs. The steps make them; the store keeps them in the
session's stream and the fleet's (`cchatq trace ID`), and each is one structured log line.

Events: session.started, model.call.started / finished / failed, tool.call.started /
finished / failed / retried, tool.logs (how many lines a call wrote: their text is the tool's,
kept in the record only), session.finished; for a background tool's call, task.submitted /
progress / completed / failed too; rate_limit.waited when a step is put off for its backend's
rate limit. A redelivered step may repeat one (at least once, like the steps themselves), but
session.finished: the step that wrote the session's ending makes it, once.
Spans (worker.session.spans) are made of them; what they may show of content rides an event
outside its JSON (`content`), only while spans ask for it.

A step's kind, how long its body ran, where and how it ran (the worker, the delivery, how
long its message waited for it) ride the last event it made (`kind`, `step_ms`, `worker`,
`delivery`, `queue_ms`: no write of their own). For the fleet's metrics only, with no session
(the fleet's stream only): step.finished, for a step that made no event (a start step, say),
and reconciler.pass.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from schemas.step_kinds import step_kind
from worker.codecs.reply import Reply
from worker.errors import RateLimited
from worker.session.engine import CallModel
from worker.session.outcomes import ToolOutcome

log = logging.getLogger("cchatq.trace")
CONTENT = "content"  # the field to_json leaves out


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
    kind: str | None = None  # the step's kind (schemas.step_kinds), with step_ms or wait_ms
    step_ms: int | None = None  # how long the step's body ran, on its last event
    wait_ms: int | None = None  # rate_limit.waited: how long the step is put off
    reason: str | None = None  # rate_limit.waited: "429", or what had no room (window, pace...)
    nudged: int | None = None  # reconciler.pass: sessions nudged
    forgotten: int | None = None  # reconciler.pass: sessions forgotten (spec expired)
    overdue: int | None = None  # reconciler.pass: sessions ended past the fleet's deadline
    lines: int | None = None  # tool.logs: lines a call wrote and kept
    log_bytes: int | None = None  # tool.logs: their text's size
    dropped: int | None = None  # tool.logs: lines past the call's bound
    model: str | None = None  # model.call.*: the model asked for
    response_model: str | None = None  # model.call.finished: the model that answered
    finish_reason: str | None = None  # model.call.finished: why the reply ended
    worker: str | None = None  # the worker's node name, on the step's last event
    delivery: int | None = None  # the step's delivery (its try: 1, 2 after a redelivery...)
    queue_ms: int | None = None  # how long the step's message waited before its body began
    # What spans may show of a call when their content is asked for (messages, arguments,
    # results): never written to a stream or a log line (to_json leaves it out), and filled
    # only while spans capture content
    content: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The fields that are set (a stream entry, a log line, a `cchatq trace` line), never
        the content."""
        return {
            f.name: v
            for f in fields(self)
            if f.name != CONTENT and (v := getattr(self, f.name)) is not None
        }


@dataclass(frozen=True)
class Arrival:
    """How a step's delivery reached its worker, as the task says: the worker's node name
    and how long the message waited on its queue (None: its sender did not stamp it)."""

    worker: str = ""
    queue_ms: int | None = None


def now_ms() -> int:
    """An event's time (`ts_ms`): this host's wall clock. Shown only (the viewer's timeline,
    the metrics' durations within a step): nothing is decided on it, so it needs no round trip
    to Redis's clock; events from hosts whose clocks disagree may show out of order."""
    return time.time_ns() // 1_000_000


def event(name: str, session: str, **values: Any) -> TraceEvent:
    """An event stamped now, logged as one line as it is made."""
    made = TraceEvent(event=name, session=session, ts_ms=now_ms(), **values)
    if log.isEnabledFor(logging.INFO):
        log.info("%s", json.dumps(made.to_json(), separators=(",", ":")))
    return made


def step_timed(
    events: list[TraceEvent],
    step: str,
    started: float,
    delivery: int | None = None,
    arrival: Arrival | None = None,
) -> None:
    """The step's kind and how long its body ran since `started` (time.monotonic), with where
    and how it ran (its delivery, its worker, its message's wait), on the last of its `events`
    (they ride the write that ends it), or as a step.finished event of no session when it
    made none: one XADD (the fleet's stream) for a start step."""
    kind, step_ms = step_kind(step), round((time.monotonic() - started) * 1000)
    ran = ran_as(delivery, arrival)
    if events:
        events[-1] = replace(events[-1], kind=kind, step_ms=step_ms, **ran)
    else:
        events.append(event("step.finished", "", kind=kind, step_ms=step_ms, **ran))


def ran_as(delivery: int | None, arrival: Arrival | None) -> dict[str, Any]:
    """A step's own fields: its delivery, its worker and its message's wait."""
    if arrival is None:
        return {"delivery": delivery}
    return {"delivery": delivery, "worker": arrival.worker or None, "queue_ms": arrival.queue_ms}


def rate_limit_waited(
    session: str,
    step: str,
    waited: RateLimited,
    delivery: int | None = None,
    arrival: Arrival | None = None,
) -> TraceEvent:
    """rate_limit.waited: the step is put off (its task retried) for its backend's limit."""
    return event(
        "rate_limit.waited",
        session,
        kind=step_kind(step),
        backend=waited.backend or None,
        wait_ms=round(waited.wait_s * 1000),
        reason=waited.reason or None,
        **ran_as(delivery, arrival),
    )


def model_call_ended(
    session: str,
    round_no: int,
    reply: Reply,
    latency_ms: int,
    backend: str,
    call: CallModel | None = None,
    content: bool = False,
) -> TraceEvent:
    """model.call.finished (with its token counts, the model that answered and why it
    stopped), or .failed with the error body's code; `call`: the request, whose messages and
    reply ride along, outside the event's JSON, when `content` is asked for."""
    model = call.model if call is not None else None
    carried = None
    if content and call is not None:
        carried = {"input": call.messages, "output": reply.message or None}
    error = reply.error
    if error is not None:
        return event(
            "model.call.failed",
            session,
            round=round_no,
            latency_ms=latency_ms,
            error=str(error.get("code")),
            backend=backend,
            model=model,
            content=carried,
        )
    request_id = reply.completion.get("id")
    answered = reply.completion.get("model")
    return event(
        "model.call.finished",
        session,
        round=round_no,
        latency_ms=latency_ms,
        request_id=request_id if isinstance(request_id, str) else None,
        backend=backend,
        tokens_in=reply.tokens("prompt_tokens"),
        tokens_out=reply.tokens("completion_tokens"),
        model=model,
        response_model=answered if isinstance(answered, str) else None,
        finish_reason=reply.finish_reason,
        content=carried,
    )


def tool_call_ended(
    session: str,
    round_no: int,
    call_id: str,
    tool: str,
    outcome: ToolOutcome,
    arguments: str | None = None,
) -> TraceEvent:
    """tool.call.finished, or .failed with its error class; with `arguments` (only while spans
    capture content) the call's arguments and result ride along, outside the event's JSON."""
    carried = None
    if arguments is not None:
        carried = {"arguments": arguments, "result": tool_result(outcome)}
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
        content=carried,
    )


def tool_result(outcome: ToolOutcome) -> str | None:
    """What a call answered, for a span's content: its output, or its failure's message."""
    if outcome.ok:
        return outcome.output
    return None if outcome.failure is None else outcome.failure.message


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
    session: str,
    round_no: int,
    reply: Reply,
    outcomes: dict[int, ToolOutcome],
    content: bool = False,
) -> list[TraceEvent]:
    """tool.call.failed for the calls answered without running (unknown, invalid, denied,
    repeated, not run): they never started. `content`: their arguments and answers ride
    along, outside the events' JSON."""
    calls = reply.calls
    return [
        event(
            "tool.call.failed",
            session,
            round=round_no,
            call_id=calls[i].id,
            tool=calls[i].name,
            error=outcome.code,
            content={"arguments": calls[i].arguments_text, "result": tool_result(outcome)}
            if content
            else None,
        )
        for i, outcome in sorted(outcomes.items())
        if i < len(calls)
    ]

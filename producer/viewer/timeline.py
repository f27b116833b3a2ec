"""A session's timeline from its trace events (worker/session/trace.py's fields): each model
round, tool call and finish, each rate-limit wait, and the queue waits between them.

A queue wait is the event's `queue_ms` when a worker wrote one; otherwise it is computed from
consecutive events: a round waited from when it became ready (its session's submit for round 0,
its previous round's last tool call ending after that, less any rate-limit wait it was given)
until its model call started; a tool call from its round's model call ending until it started.
`worker`, `delivery` and `model` are shown when the events carry them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from producer.viewer.model import TimelineStep

Event = Mapping[str, Any]
MODEL_ENDED = ("model.call.finished", "model.call.failed")
TOOL_ENDED = ("tool.call.finished", "tool.call.failed")
BACKGROUND = ("task.submitted", "task.progress", "task.completed", "task.failed")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ts(event: Event) -> int:
    return _int(event.get("ts_ms")) or 0


class _Builder:
    def __init__(self, submitted_ms: int | None) -> None:
        self.steps: list[TimelineStep] = []
        self.ready: int | None = submitted_ms  # when the next round could start
        self.round_ready: dict[int | None, int] = {}  # round -> its model call's end
        self.rounds: dict[int | None, Event] = {}  # model.call.started, by round
        self.tools: dict[tuple[int | None, str], Event] = {}  # tool.call.started, by call
        self.retries: dict[tuple[int | None, str], int] = {}
        self.lines: dict[tuple[int | None, str], int] = {}
        self.background: dict[tuple[int | None, str], list[str]] = {}

    def add(self, event: Event) -> None:
        name = str(event.get("event", ""))
        round_no = _int(event.get("round"))
        call = (round_no, str(event.get("call_id", "")))
        ts = _ts(event)
        if name == "model.call.started":
            self._queue_wait(event, self.ready, f"queued: round {round_no}", round_no)
            self.rounds[round_no] = event
        elif name in MODEL_ENDED:
            self._round_ended(event, round_no)
            self.round_ready[round_no] = ts
            self.ready = ts
        elif name == "tool.call.started":
            ready = self.round_ready.get(round_no)
            label = f"queued: {event.get('tool', 'tool')} {call[1]}"
            self._queue_wait(event, ready, label, round_no, call[1], event.get("tool"))
            self.tools[call] = event
        elif name == "tool.call.retried":
            self.retries[call] = _int(event.get("attempt")) or self.retries.get(call, 0) + 1
        elif name == "tool.logs":
            self.lines[call] = _int(event.get("lines")) or 0
        elif name in BACKGROUND:
            self.background.setdefault(call, []).append(name.removeprefix("task."))
        elif name in TOOL_ENDED:
            self._tool_ended(event, call)
            self.ready = ts if self.ready is None else max(self.ready, ts)
        elif name == "rate_limit.waited":
            kind = event.get("kind") or "step"
            self._queue_wait(event, self.ready, f"queued: {kind}", round_no)
            wait = _int(event.get("wait_ms")) or 0
            reason = event.get("reason") or "rate limit"
            self.steps.append(
                TimelineStep(
                    kind="rate_wait",
                    label=f"rate-limit wait ({kind})",
                    at_ms=ts,
                    ms=wait,
                    worker=event.get("worker"),
                    detail=f"{event.get('backend') or ''} {reason}".strip(),
                )
            )
            self.ready = ts + wait  # the wait is its own step, not the queue's
        elif name == "session.finished":
            self._step_time(event)
            self.steps.append(
                TimelineStep(
                    kind="finish",
                    label="finished" if not event.get("error") else f"ended: {event['error']}",
                    at_ms=ts,
                    ms=None,  # a moment; the step it ended in has its own time
                    worker=event.get("worker"),
                    error=event.get("error"),
                    detail=f"session latency {event.get('latency_ms')} ms"
                    if event.get("latency_ms") is not None
                    else "",
                )
            )

    def _step_time(self, event: Event) -> None:
        """What a step's last event carries (`kind`, `step_ms`, `worker`, `delivery`), told
        on that step's row: session.finished rides the round that ended the session."""
        kind, step_ms = event.get("kind"), _int(event.get("step_ms"))
        if step_ms is None:
            return
        for n in range(len(self.steps) - 1, -1, -1):
            step = self.steps[n]
            if step.kind == kind and "step " not in step.detail:
                detail = ", ".join(d for d in (step.detail, f"step {step_ms} ms") if d)
                self.steps[n] = replace(
                    step,
                    detail=detail,
                    worker=step.worker or event.get("worker"),
                    attempt=step.attempt or _int(event.get("delivery")),
                )
                return

    def unfinished(self) -> None:
        """A model call or tool call that started and has no end yet: running (or its end
        was never written), shown from its start with no length."""
        for round_no, started in self.rounds.items():
            self.steps.append(
                TimelineStep(
                    kind="round",
                    label=f"round {round_no}: model call (no end yet)",
                    at_ms=_ts(started),
                    ms=None,
                    round=round_no,
                    worker=started.get("worker"),
                )
            )
        for (round_no, call_id), started in self.tools.items():
            tool = str(started.get("tool") or "tool")
            self.steps.append(
                TimelineStep(
                    kind="tool",
                    label=f"tool {tool} {call_id} (no end yet)",
                    at_ms=_ts(started),
                    ms=None,
                    round=round_no,
                    call_id=call_id,
                    tool=tool,
                    worker=started.get("worker"),
                )
            )

    def _queue_wait(
        self,
        event: Event,
        ready: int | None,
        label: str,
        round_no: int | None,
        call_id: str | None = None,
        tool: Any = None,
    ) -> None:
        ts = _ts(event)
        wait = _int(event.get("queue_ms"))
        if wait is None and ready is not None:
            wait = ts - ready
        if wait is None or wait <= 0:
            return
        self.steps.append(
            TimelineStep(
                kind="queue_wait",
                label=label,
                at_ms=ts - wait,
                ms=wait,
                round=round_no,
                call_id=call_id,
                tool=None if tool is None else str(tool),
                worker=event.get("worker"),
            )
        )

    def _round_ended(self, event: Event, round_no: int | None) -> None:
        started = self.rounds.pop(round_no, None)
        ms = _int(event.get("latency_ms"))
        at = _ts(started) if started is not None else _ts(event) - (ms or 0)
        details = []
        if event.get("tokens_in") is not None or event.get("tokens_out") is not None:
            tokens_in, tokens_out = event.get("tokens_in", "?"), event.get("tokens_out", "?")
            details.append(f"tokens {tokens_in} in / {tokens_out} out")
        for key in ("backend", "model"):
            value = event.get(key) or (started or {}).get(key)
            if value:
                details.append(str(value))
        if event.get("step_ms") is not None:
            details.append(f"step {event['step_ms']} ms")
        failed = event.get("event") == "model.call.failed"
        self.steps.append(
            TimelineStep(
                kind="round",
                label=f"round {round_no}: model call" + (" failed" if failed else ""),
                at_ms=at,
                ms=ms,
                round=round_no,
                worker=event.get("worker") or (started or {}).get("worker"),
                attempt=_int(event.get("delivery")) or _int((started or {}).get("delivery")),
                error=event.get("error"),
                detail=", ".join(details),
            )
        )

    def _tool_ended(self, event: Event, call: tuple[int | None, str]) -> None:
        started = self.tools.pop(call, None)
        ms = _int(event.get("latency_ms"))
        at = _ts(started) if started is not None else _ts(event) - (ms or 0)
        retries = _int(event.get("attempt"))
        if retries is None:
            retries = self.retries.get(call)
        details = []
        if retries:
            details.append(f"{retries} retr{'y' if retries == 1 else 'ies'}")
        if event.get("output_bytes") is not None:
            details.append(f"{event['output_bytes']} bytes out")
        if self.lines.get(call):
            details.append(f"{self.lines[call]} log lines")
        if self.background.get(call):
            details.append("background: " + ", ".join(self.background[call]))
        if started is None:
            details.append("not run")
        tool = str(event.get("tool") or "tool")
        self.steps.append(
            TimelineStep(
                kind="tool",
                label=f"tool {tool} {call[1]}",
                at_ms=at,
                ms=ms if started is not None else None,
                round=call[0],
                call_id=call[1],
                tool=tool,
                worker=event.get("worker") or (started or {}).get("worker"),
                attempt=None if started is None else (retries or 0) + 1,
                error=event.get("error"),
                detail=", ".join(details),
            )
        )


def timeline(events: Sequence[Event], submitted_ms: int | None = None) -> tuple[TimelineStep, ...]:
    """The steps and waits of a session's events, in time order, each with where its bar
    starts and how wide it is in % of the session's span; times from the first of them."""
    builder = _Builder(submitted_ms)
    for event in sorted(events, key=_ts):  # stable: a step's events keep their order
        builder.add(event)
    builder.unfinished()
    steps = sorted(builder.steps, key=lambda s: s.at_ms)
    if not steps:
        return ()
    start = min(s.at_ms for s in steps)
    end = max(s.at_ms + (s.ms or 0) for s in steps)
    span = max(end - start, 1)
    return tuple(
        replace(
            s,
            at_ms=s.at_ms - start,
            offset_pct=round(100 * (s.at_ms - start) / span, 2),
            width_pct=round(100 * (s.ms or 0) / span, 2),
        )
        for s in steps
    )

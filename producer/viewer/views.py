"""A session's page from what a source found of it (SessionFacts): its summary, thread and
timeline, or a program run's chats, forks, logs, user-stream frames and output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from producer.viewer.model import (
    ERROR,
    GONE,
    OK,
    QUEUED,
    RUNNING,
    ChatLink,
    Fork,
    ProgramLog,
    ProgramParts,
    SessionView,
    TimelineStep,
)
from producer.viewer.rows import answer_text, as_int, error_of, preview, record_row
from producer.viewer.source import ChatFacts, SessionFacts
from producer.viewer.thread import answer_fields, thread
from producer.viewer.timeline import timeline

NO_TRACE_FILE = "No timeline: a results file keeps no trace events (a live fleet's do)."
NO_EVENTS = (
    "No trace events: none written yet, or the fleet runs without them (CCHATQ_TRACE), "
    "or they expired."
)
NO_PROGRAM_EVENTS = "A program run writes no trace events of its own: its chats' pages have theirs."
NO_FRAMES_FILE = "A results file keeps no user-stream frames."


def pending_status(state: str) -> str:
    return {"queued": QUEUED, "gone": GONE}.get(state, RUNNING)


def session_view(facts: SessionFacts) -> SessionView:
    record = facts.record
    spec = facts.spec or {}
    if record is not None:
        row = record_row(facts.spec_id, record, facts.attempt)
        status, code = row.status, row.code
    else:
        status, code = pending_status(facts.state), None
    error = error_of(record) if record is not None else None
    found = (record or {}).get("body")
    body: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    marks = body.get("_spear")
    spear: Mapping[str, Any] = marks if isinstance(marks, Mapping) else {}
    metrics = (record or {}).get("metrics") or {}
    usage = metrics.get("usage") or {}
    if facts.program:
        usage = program_usage((record or {}).get("responses") or [])
    steps: tuple[TimelineStep, ...] = ()
    if facts.events is None:
        note = NO_TRACE_FILE
    else:
        steps = timeline(facts.events, facts.submitted_ms)
        note = "" if steps else NO_PROGRAM_EVENTS if facts.program else NO_EVENTS
    if record is not None and not facts.program:
        messages = thread(record.get("transcript") or [], record.get("tool_logs") or [])
    else:
        messages = thread(spec.get("messages") or [])
    return SessionView(
        spec_id=facts.spec_id,
        kind="program" if facts.program else "session",
        status=status,
        state=facts.state_text or status,
        batch=facts.batch,
        attempt=facts.attempt,
        code=code,
        error_message=None if error is None else str(error.get("message", "")),
        latency_ms=as_int(metrics.get("latency_ms")),
        tokens_in=as_int(usage.get("prompt_tokens")),
        tokens_out=as_int(usage.get("completion_tokens")),
        rounds=as_int(metrics.get("chats" if facts.program else "iterations")),
        tool_calls=as_int(metrics.get("tool_calls")),
        tool_failures=as_int(metrics.get("tool_failures")),
        backend=str(spear.get("backend") or spec.get("provider") or "") or None,
        model=str(spear.get("model") or spec.get("model") or "") or None,
        submitted_ms=facts.submitted_ms,
        finished_ms=facts.finished_ms,
        messages=messages,
        timeline=steps,
        timeline_note=note,
        partial_text=facts.partial_text if record is None else None,
        partial_thinking=facts.partial_thinking if record is None else None,
        partial_tool_calls=facts.partial_tool_calls if record is None else (),
        flower_search=facts.flower[0] if facts.flower else None,
        flower_url=facts.flower[1] if facts.flower else None,
        has_trace=facts.events is not None,
        program=program_parts(facts) if facts.program else None,
        source=facts.source,
    )


def program_usage(responses: Sequence[Any]) -> dict[str, int]:
    """A program run's tokens: its chats' usage summed."""
    total: dict[str, int] = {}
    for body in responses:
        for key, value in ((body or {}).get("usage") or {}).items():
            if as_int(value) is not None:
                total[key] = total.get(key, 0) + value
    return total


def log_origin(line: Mapping[str, Any]) -> str:
    """Where a program's log line comes from: "" for its own, the call for a forked tool's."""
    if line.get("source") != "tool":
        return ""
    stream = line.get("stream", "log")
    return f"{line.get('tool')} {line.get('call_id')}" + ("" if stream == "log" else f" {stream}")


def program_parts(facts: SessionFacts) -> ProgramParts:
    record = facts.record or {}
    logs = tuple(
        ProgramLog(
            level=str(line.get("level", "info")),
            origin=log_origin(line),
            message=str(line.get("message", "")),
        )
        for line in record.get("logs") or []
        if isinstance(line, Mapping)
    )
    chats = tuple(chat_link(chat) for chat in facts.chats)
    forks = chat_forks(facts.chats)
    if not forks:
        forks = log_forks(record.get("logs") or [])
    exit_code = record.get("exit_code")
    return ProgramParts(
        exit_code=exit_code if isinstance(exit_code, int) else None,
        stdout=str(record.get("stdout") or ""),
        stderr=str(record.get("stderr") or ""),
        logs=logs,
        chats=chats,
        forks=forks,
        frames=facts.frames or (),
        frames_note=NO_FRAMES_FILE if facts.frames is None else "",
    )


def chat_link(chat: ChatFacts) -> ChatLink:
    found = chat.record if chat.record is not None else None
    if found is None and chat.body is not None:
        found = {"status": "error" if "error" in chat.body else OK, "body": chat.body}
    if found is None:
        return ChatLink(chat.spec_id, pending_status(chat.state))
    row = record_row(chat.spec_id, found)
    body = found.get("body") if isinstance(found.get("body"), Mapping) else None
    return ChatLink(
        chat.spec_id,
        row.status,
        row.code,
        row.preview or preview(answer_text(body) or ""),
    )


def chat_forks(chats: Sequence[ChatFacts]) -> tuple[Fork, ...]:
    """The tool calls of a program's chats (each ran in a fork of the program), from the
    chats' records: their answers and how many lines each wrote."""
    out: list[Fork] = []
    for chat in chats:
        record = chat.record or {}
        lines: dict[str, int] = {}
        for line in record.get("tool_logs") or []:
            call_id = str(line.get("call_id", ""))
            lines[call_id] = lines.get(call_id, 0) + 1
        answers = {
            str(m.get("tool_call_id")): str(m.get("content") or "")
            for m in record.get("transcript") or []
            if m.get("role") == "tool"
        }
        for message in record.get("transcript") or []:
            for call in message.get("tool_calls") or []:
                call_id = str(call.get("id", ""))
                answer = answers.get(call_id)
                fields = answer_fields(answer) if answer is not None else {}
                ok = fields.get("ok")
                out.append(
                    Fork(
                        chat=chat.spec_id,
                        call_id=call_id,
                        tool=str((call.get("function") or {}).get("name", "?")),
                        status=RUNNING if answer is None else ERROR if ok is False else OK,
                        code=fields.get("error_code"),
                        log_lines=lines.get(call_id, 0),
                    )
                )
    return tuple(out)


def log_forks(logs: Sequence[Any]) -> tuple[Fork, ...]:
    """The forked tool calls a program's log names (when its chats' records are not at hand)."""
    seen: dict[str, Fork] = {}
    for line in logs:
        if not isinstance(line, Mapping) or line.get("source") != "tool":
            continue
        call_id = str(line.get("call_id", ""))
        before = seen.get(call_id)
        seen[call_id] = Fork(
            chat="",
            call_id=call_id,
            tool=str(line.get("tool", "?")),
            status="ran",
            log_lines=(before.log_lines if before else 0) + 1,
        )
    return tuple(seen.values())

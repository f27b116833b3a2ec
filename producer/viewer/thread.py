"""A session's thread from its transcript: each message in order, an assistant's thinking, and
each tool call with its arguments and the answer its tool message gave (result or error class,
retries, fallback), plus the lines the call's tool wrote (the record's `tool_logs`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from producer.viewer.model import MessageView, ToolCallView, ToolLog

# where a transcript keeps an answer's thinking
THINKING_FIELDS = ("reasoning_content", "reasoning")


def pretty(text: str) -> str:
    """JSON text indented (keys as they came), other text as it is."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, TypeError):
        return text


def content_text(content: Any) -> str:
    """A message's content as text: a string as it is, text parts joined, other parts (an
    image, a provider's block) as indented JSON, None as nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            else:
                pieces.append(json.dumps(part, indent=2, ensure_ascii=False))
        return "\n".join(pieces)
    return json.dumps(content, indent=2, ensure_ascii=False)


def thinking_text(message: Mapping[str, Any]) -> str | None:
    for key in THINKING_FIELDS:
        value = message.get(key)
        if value:
            return value if isinstance(value, str) else json.dumps(value, indent=2)
    return None


def tool_logs_by_call(
    tool_logs: Sequence[Mapping[str, Any]],
) -> dict[tuple[int | None, str], list[ToolLog]]:
    """A record's tool log lines by (round, call id)."""
    out: dict[tuple[int | None, str], list[ToolLog]] = {}
    for line in tool_logs:
        round_no = line.get("round")
        key = (round_no if isinstance(round_no, int) else None, str(line.get("call_id", "")))
        out.setdefault(key, []).append(
            ToolLog(
                level=str(line.get("level", "info")),
                stream=str(line.get("stream", "log")),
                message=str(line.get("message", "")),
            )
        )
    return out


def answer_fields(content: str) -> dict[str, Any]:
    """What a tool message says of its call: the result envelope's fields
    (`{ok, data, error, metrics}`), a bare error body's, or the raw output."""
    try:
        parsed = json.loads(content)
    except ValueError:
        return {"ok": None, "result": content}
    if isinstance(parsed, dict) and "ok" in parsed and "metrics" in parsed:
        error = parsed.get("error") or {}
        metrics = parsed.get("metrics") or {}
        data = parsed.get("data")
        note = ""
        if parsed.get("summarized"):
            note = f"the model read a summary of {parsed.get('bytes')} bytes of output"
        elif parsed.get("truncated"):
            note = f"the model read an excerpt of {parsed.get('bytes')} bytes of output"
        return {
            "ok": bool(parsed["ok"]),
            "result": None
            if data is None
            else data
            if isinstance(data, str)
            else json.dumps(data, indent=2, ensure_ascii=False),
            "error_code": error.get("code"),
            "error_message": error.get("message"),
            "retries": metrics.get("retries"),
            "fallback": metrics.get("fallback"),
            "latency_ms": metrics.get("latency_ms"),
            "note": note,
        }
    if isinstance(parsed, dict) and set(parsed) == {"error"} and isinstance(parsed["error"], dict):
        return {
            "ok": False,
            "error_code": parsed["error"].get("code"),
            "error_message": parsed["error"].get("message"),
        }
    return {"ok": None, "result": json.dumps(parsed, indent=2, ensure_ascii=False)}


def thread(
    transcript: Sequence[Mapping[str, Any]], tool_logs: Sequence[Mapping[str, Any]] = ()
) -> tuple[MessageView, ...]:
    """The transcript's messages as the thread shows them: each assistant turn's tool calls
    hold their answers (found by call id among the tool messages) and their tools' lines."""
    answers = {
        str(m.get("tool_call_id")): content_text(m.get("content"))
        for m in transcript
        if m.get("role") == "tool"
    }
    names: dict[str, str] = {}
    logs = tool_logs_by_call(tool_logs)
    out: list[MessageView] = []
    round_no = 0
    for message in transcript:
        role = str(message.get("role", "?"))
        calls: list[ToolCallView] = []
        if role == "assistant":
            for raw_call in message.get("tool_calls") or []:
                call = tool_call(raw_call, answers, logs, round_no)
                names[call.call_id] = call.name
                calls.append(call)
            round_no += 1
        call_id = message.get("tool_call_id")
        out.append(
            MessageView(
                role=role,
                content=content_text(message.get("content")),
                thinking=thinking_text(message) if role == "assistant" else None,
                tool_calls=tuple(calls),
                tool_call_id=None if call_id is None else str(call_id),
                tool_name=names.get(str(call_id)) if call_id is not None else None,
            )
        )
    return tuple(out)


def tool_call(
    raw: Mapping[str, Any],
    answers: Mapping[str, str],
    logs: Mapping[tuple[int | None, str], list[ToolLog]],
    round_no: int,
) -> ToolCallView:
    function = raw.get("function") or {}
    call_id = str(raw.get("id", ""))
    arguments = function.get("arguments")
    args_text = (
        pretty(arguments)
        if isinstance(arguments, str)
        else json.dumps(arguments, indent=2, ensure_ascii=False)
    )
    answer = answers.get(call_id)
    fields = answer_fields(answer) if answer is not None else {}
    lines = logs.get((round_no, call_id)) or logs.get((None, call_id)) or []
    return ToolCallView(
        call_id=call_id,
        name=str(function.get("name", "?")),
        arguments=args_text,
        answered=answer is not None,
        logs=tuple(lines),
        **fields,
    )

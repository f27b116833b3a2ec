"""Records, results lines and trace events for the viewer's tests, shaped as the workers write
them (worker/session/ending.py, worker/guest/step.py, worker/session/trace.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HOSTILE = "<script>alert(1)</script>"


def envelope(data: Any = None, error: dict[str, str] | None = None, **metrics: Any) -> str:
    body = {
        "ok": error is None,
        "data": data,
        "error": error,
        "metrics": {"latency_ms": 5, "retries": 0, **metrics},
    }
    return json.dumps(body, separators=(",", ":"))


def call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def session_line(
    spec_id: str,
    batch: str = "b1",
    prompt: str = "Add 1 and 3",
    status: str = "ok",
    latency_ms: int = 500,
    tokens: int = 100,
    tools: bool = True,
    code: str | None = None,
) -> dict[str, Any]:
    """A results line of a two-round session (one tool call), or a failed one with `code`."""
    transcript: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": prompt},
    ]
    if tools:
        transcript += [
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "I should call the calculator.",
                "tool_calls": [call("call_0_0", "calculate", {"a": 1, "b": 3, "op": "add"})],
            },
            {"role": "tool", "tool_call_id": "call_0_0", "content": envelope({"result": 4})},
        ]
    error = None if code is None else {"code": code, "message": f"{code} happened"}
    if error is None:
        transcript.append({"role": "assistant", "content": "Result: 4"})
        response: dict[str, Any] = {
            "choices": [{"message": {"role": "assistant", "content": "Result: 4"}}],
            "_spear": {"backend": "replay", "model": "replay/two_rounds"},
        }
    else:
        response = {"error": error}
    return {
        "id": spec_id,
        "status": status if code is None else "error",
        "response": response,
        "transcript": transcript,
        "metrics": {
            "iterations": 2 if tools else 1,
            "latency_ms": latency_ms,
            "tool_calls": 1 if tools else 0,
            "tool_failures": 0,
            "tool_output_bytes": 12,
            "usage": {
                "prompt_tokens": tokens - 10,
                "completion_tokens": 10,
                "total_tokens": tokens,
            },
        },
        "error": error,
        "batch": batch,
        "attempt": 1,
    }


def program_line(run_id: str, batch: str = "b1") -> dict[str, Any]:
    return {
        "id": run_id,
        "kind": "program",
        "status": "ok",
        "exit_code": 0,
        "stdout": "ANSWER: Echo: hi\n",
        "stderr": "",
        "logs": [
            {"level": "info", "message": "chat done"},
            {
                "level": "info",
                "message": "summing",
                "source": "tool",
                "call_id": "call_0_0",
                "tool": "sum",
                "stream": "log",
                "round": 0,
            },
        ],
        "responses": [
            {
                "choices": [{"message": {"role": "assistant", "content": "Echo: hi"}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
            }
        ],
        "metrics": {"latency_ms": 900, "chats": 1},
        "error": None,
        "batch": batch,
        "attempt": 1,
    }


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def two_round_events(session: str = "s1", t0: int = 1_000_000) -> list[dict[str, Any]]:
    """The trace of a session of two rounds with one tool call, as a fleet writes it."""
    return [
        {"event": "session.started", "session": session, "ts_ms": t0 + 100},
        {"event": "model.call.started", "session": session, "ts_ms": t0 + 100, "round": 0},
        {
            "event": "model.call.finished",
            "session": session,
            "ts_ms": t0 + 130,
            "round": 0,
            "latency_ms": 30,
            "backend": "replay",
            "tokens_in": 10,
            "tokens_out": 5,
            "kind": "round",
            "step_ms": 31,
            "worker": "llm@host",
            "delivery": 1,
        },
        {
            "event": "tool.call.started",
            "session": session,
            "ts_ms": t0 + 150,
            "round": 0,
            "call_id": "call_0_0",
            "tool": "calculate",
        },
        {
            "event": "tool.call.retried",
            "session": session,
            "ts_ms": t0 + 160,
            "round": 0,
            "call_id": "call_0_0",
            "tool": "calculate",
            "attempt": 1,
            "error": "RUNTIME_ERROR",
        },
        {
            "event": "tool.call.finished",
            "session": session,
            "ts_ms": t0 + 190,
            "round": 0,
            "call_id": "call_0_0",
            "tool": "calculate",
            "attempt": 1,
            "latency_ms": 40,
            "output_bytes": 12,
            "worker": "tools@host",
        },
        {
            "event": "rate_limit.waited",
            "session": session,
            "ts_ms": t0 + 200,
            "kind": "round",
            "backend": "replay",
            "wait_ms": 300,
            "reason": "429",
        },
        {
            "event": "model.call.started",
            "session": session,
            "ts_ms": t0 + 520,
            "round": 1,
            "queue_ms": 7,
        },
        {
            "event": "model.call.finished",
            "session": session,
            "ts_ms": t0 + 540,
            "round": 1,
            "latency_ms": 20,
            "backend": "replay",
            "model": "replay/two_rounds",
        },
        {"event": "session.finished", "session": session, "ts_ms": t0 + 541, "latency_ms": 541},
    ]

"""Response, error and metrics bodies: compact JSON with sorted keys (docs/guest-abi.md
section 5)."""

from __future__ import annotations

from typing import Any

from schemas import json_codec


def dump_body(obj: Any) -> bytes:
    """Compact, sorted, UTF-8: guests search these bytes with strstr."""
    return json_codec.dumps(obj, sort_keys=True)


def dump_text(obj: Any) -> str:
    return dump_body(obj).decode()


def error_obj(code: str | None, message: str) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message}
    if code is not None:
        err["code"] = code
    return {"error": err}


def is_error_body(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


OK = "ok"  # the outcome of a session that ended with an answer
CANCELLED = "cancelled"  # the code of a session a cancel ended
# Every code a session's error body can carry (worker/errors.py defines each; the README's
# error table says when; tests/test_errors.py keeps this list in step with the tree).
SESSION_ERROR_CODES = frozenset(
    {
        "cancelled", "deadline_exceeded", "guest_error", "guest_trap", "internal_error",
        "invalid_request", "mcp_error", "provider_error", "provider_protocol_error",
        "provider_timeout", "provider_unavailable", "step_failed", "tool_call_limit",
        "unknown_tool",
    }
)  # fmt: skip


def outcome_code(body: Any) -> str:
    """What a session ended with, as a code: "ok", or its error body's code (the worker's
    bodies always carry one; a body without is internal_error, worker.errors.InternalError)."""
    if is_error_body(body):
        return str(body["error"].get("code") or "internal_error")
    return OK

"""What a provider's error answer says, read from its body: the JSON, if it is JSON, and the
provider's own error text, as OpenAI, Anthropic, Gemini, vLLM and FastAPI shape it, capped.
Pure: no I/O."""

from __future__ import annotations

import json
from typing import Any

MAX_ERROR_CHARS = 300


def json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None


def upstream_message(data: bytes, reason: str | None) -> str:
    """The error text of a body (JSON or not), on one line; the HTTP reason when it has none."""
    text = ""
    try:
        payload = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        text = data.decode("utf-8", errors="replace")
    else:
        text = _message_in(payload)
    text = " ".join(text.split()) or (reason or "no error message")
    return text[:MAX_ERROR_CHARS]


def _message_in(payload: Any) -> str:
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict):
        for key in ("error", "message", "detail", "msg"):
            if key in payload:
                found = _message_in(payload[key])
                if found:
                    return found
    if isinstance(payload, list) and payload:
        return _message_in(payload[0])  # FastAPI 422 detail lists, Gemini error arrays
    return json.dumps(payload)[:MAX_ERROR_CHARS] if payload not in (None, "", {}, []) else ""

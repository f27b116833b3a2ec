"""Gemini replies -> the canonical `chat.completion`: the generateContent JSON decoder (also
the end of a stream, see `gemini_stream`) and the error bodies (ProviderError, RetryInfo).

Pure: no I/O. The decisions (call ids, replay parts, finish reasons, usage) are listed in
`gemini`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from typing import Any

from schemas.protocols import GEMINI
from schemas.spec_types import INVALID_CALL_NAME
from worker.codecs.openai_chat import _as_int
from worker.codecs.protocol import ChatRequest, kept_for_replay
from worker.errors import (
    ProviderError,
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
)

PROTOCOL = GEMINI.name
SYNTHETIC_ID_PREFIX = "gcall_"

_FILTERED = frozenset(
    {
        "SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "LANGUAGE",
        "IMAGE_SAFETY", "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION", "IMAGE_OTHER",
        "MODEL_ARMOR",
    }
)  # fmt: skip
_LENGTH = frozenset({"MAX_TOKENS", "CONTINUATION"})
_FAILED_ROUND = frozenset({"MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL", "MALFORMED_RESPONSE"})
_RETRYABLE_STATUS = frozenset(
    {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "ABORTED"}
)
_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|ms)?\s*$")
_MAX_ERROR_CHARS = 300


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def decode_completion(raw: Any, request: ChatRequest) -> dict[str, Any]:
    """A generateContent reply (or a stream's merged chunks) -> the canonical completion."""
    if not isinstance(raw, dict):
        raise ProviderProtocolError("Gemini reply is not a JSON object")
    if "error" in raw:
        raise provider_error(raw)
    candidates = raw.get("candidates")
    if not candidates:
        feedback = raw.get("promptFeedback")
        reason = feedback.get("blockReason") if isinstance(feedback, dict) else None
        if reason:
            raise ProviderRequestError(f"Gemini blocked the prompt: {str(reason)[:60]}")
        raise ProviderProtocolError("Gemini reply has no candidates")
    if not isinstance(candidates, list) or not isinstance(candidates[0], dict):
        raise ProviderProtocolError("Gemini candidates are not a list of objects")
    candidate = candidates[0]
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    parts = parts or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise ProviderProtocolError("Gemini content parts are not a list of objects")

    anchor = raw.get("responseId") or f"{request.model}#{len(request.messages)}"
    index = candidate.get("index") if isinstance(candidate.get("index"), int) else 0
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    keep = False
    for i, part in enumerate(parts):
        keep = keep or "thoughtSignature" in part
        if isinstance(part.get("functionCall"), dict):
            calls.append(_call(part["functionCall"], f"{anchor}\x00{index}\x00{i}"))
        elif isinstance(part.get("text"), str):
            (thoughts if part.get("thought") is True else texts).append(part["text"])
        elif not (part.keys() <= {"thought", "thoughtSignature"}):
            keep = True  # a part with no canonical form (code execution, inline data...)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if "".join(thoughts):
        message["reasoning_content"] = "".join(thoughts)
    if keep or calls:
        message["_provider"] = kept_for_replay(GEMINI, copy.deepcopy(parts))

    out: dict[str, Any] = {}
    if isinstance(raw.get("responseId"), str):
        out["id"] = raw["responseId"]
    out["object"] = "chat.completion"
    out["model"] = raw.get("modelVersion") or request.model
    reason = _finish_reason(candidate.get("finishReason"), bool(calls))
    out["choices"] = [{"index": 0, "message": message, "finish_reason": reason}]
    out["usage"] = _usage(raw.get("usageMetadata"))
    return out


def _call(function_call: dict[str, Any], seed: str) -> dict[str, Any]:
    name = function_call.get("name")
    if not isinstance(name, str) or not name:
        name = INVALID_CALL_NAME  # answered as a VALIDATION_ERROR, not the end of the session
    # args that are no object are kept as they came: the loop answers a VALIDATION_ERROR
    args = function_call.get("args")
    call_id = function_call.get("id")
    if not isinstance(call_id, str) or not call_id:
        digest = hashlib.sha256(f"{seed}\x00{name}".encode()).hexdigest()[:24]
        # older models send no id; never the name alone, or two calls to one tool collide
        call_id = SYNTHETIC_ID_PREFIX + digest
    return {
        "id": call_id,
        "type": "function",
        # a function without arguments may have no `args`
        "function": {"name": name, "arguments": _compact({} if args is None else args)},
    }


def _finish_reason(raw: Any, has_calls: bool) -> str:
    if raw in _FAILED_ROUND:
        raise ProviderRetryableError(f"Gemini round failed: finishReason {raw}")
    if raw == "MISSING_THOUGHT_SIGNATURE":
        raise ProviderRequestError("Gemini: a replayed function call lacks its thought signature")
    if raw in _LENGTH:
        return "length"
    if has_calls:
        return "tool_calls"  # Gemini says STOP even with calls
    if raw in _FILTERED:
        return "content_filter"
    return "stop"


def _usage(raw: Any) -> dict[str, Any]:
    meta = raw if isinstance(raw, dict) else {}
    prompt = _as_int(meta.get("promptTokenCount")) + _as_int(meta.get("toolUsePromptTokenCount"))
    candidates = _as_int(meta.get("candidatesTokenCount"))
    thoughts = _as_int(meta.get("thoughtsTokenCount"))
    total = _as_int(meta["totalTokenCount"]) if "totalTokenCount" in meta else None
    # Thoughts are usually outside candidatesTokenCount; when prompt + candidates already make
    # the total, the candidates count includes them.
    included = total is not None and prompt + candidates == total
    completion = candidates if included else candidates + thoughts
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": total if total is not None else prompt + completion,
    }
    if "cachedContentTokenCount" in meta:
        usage["prompt_tokens_details"] = {"cached_tokens": _as_int(meta["cachedContentTokenCount"])}
    if "thoughtsTokenCount" in meta:
        usage["completion_tokens_details"] = {"reasoning_tokens": thoughts}
    if meta:
        usage["gemini_details"] = copy.deepcopy(meta)
    return usage


# ---------------------------------------------------------------------------------------------
# Errors


def error_object(body: Any) -> dict[str, Any] | None:
    """The `error` object of a Gemini error body (an object, or a one-item list on streams)."""
    if isinstance(body, bytes | bytearray):
        body = bytes(body).decode("utf-8", errors="replace")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if isinstance(body, list) and body:
        body = body[0]
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


def retry_delay(error: dict[str, Any] | None) -> float | None:
    details = error.get("details") if error else None
    for detail in details if isinstance(details, list) else []:
        if isinstance(detail, dict) and detail.get("@type") == _RETRY_INFO:
            return _duration_s(detail.get("retryDelay"))
    return None


def _duration_s(value: Any) -> float | None:
    if isinstance(value, dict):
        seconds = _as_int(value.get("seconds")) + _as_int(value.get("nanos")) / 1e9
        return seconds if math.isfinite(seconds) else None
    if not isinstance(value, str):
        return None
    match = _DURATION.match(value)
    if not match:
        return None
    seconds = float(match.group(1)) / (1000.0 if match.group(2) == "ms" else 1.0)
    return seconds if math.isfinite(seconds) else None


def provider_error(body: Any) -> ProviderError:
    error = error_object(body) or {}
    code = error.get("code") if isinstance(error.get("code"), int) else None
    status = error.get("status") if isinstance(error.get("status"), str) else ""
    text = str(error.get("message") or "")[:_MAX_ERROR_CHARS]
    message = f"Gemini error {code or '-'} {status}: {text}".strip()
    if code == 429 or (code is not None and code >= 500) or status in _RETRYABLE_STATUS:
        return ProviderRetryableError(message, code, retry_delay(error))
    return ProviderRequestError(message, code)

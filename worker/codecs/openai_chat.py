"""OpenAI chat-completions codec: request bodies out, canonical `chat.completion` dicts in.

Pure: no I/O. The canonical shape is what the guest ABI returns, so every other provider codec
translates to it. The cases it handles are listed in docs/provider-conformance.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from schemas.protocols import CHAT_REASONING_FIELDS
from schemas.spec_types import INVALID_CALL_NAME
from worker.errors import ProviderProtocolError, ToolValidationError

log = logging.getLogger(__name__)

# Fields the codec owns; a spec's params may not override them.
_RESERVED_PARAMS = frozenset({"model", "messages", "tools", "stream", "stream_options"})
# Strict servers reject these with 400 when no tools are sent.
_TOOL_ONLY_PARAMS = frozenset({"tool_choice", "parallel_tool_calls"})
_TOP_LEVEL_KEPT = ("id", "object", "created", "model", "system_fingerprint")
_USAGE_INTS = ("prompt_tokens", "completion_tokens", "total_tokens")
_JSON_TYPE_NAMES = {str: "string", int: "number", float: "number", bool: "boolean", list: "array"}
NO_OUTPUT = "(no output)"


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# Message content


def content_text(content: Any) -> str:
    """The text of a message's content: a string as it is; OpenAI-style content parts
    (`[{"type": "text", "text": "..."}, {"type": "image_url", ...}]`) as the text of their
    text parts, joined; anything else (None) as "". A part that is no object, or a text part
    whose `text` is no string, is not a content part and adds nothing."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"]
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def tool_result_text(content: Any) -> str:
    """A tool message's content as text: content parts by `content_text`, any other output by
    `tool_message_content`; never empty, as some servers reject empty tool results."""
    text = content_text(content) if isinstance(content, list) else tool_message_content(content)
    return text or NO_OUTPUT


# ---------------------------------------------------------------------------------------------
# Requests


def build_request(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    params: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON body of a non-streaming chat-completions call."""
    body: dict[str, Any] = {"model": model, "messages": [_wire_message(m) for m in messages]}
    if tools:
        body["tools"] = [dict(t) for t in tools]
    for key, value in params.items():
        if key in _RESERVED_PARAMS or (not tools and key in _TOOL_ONLY_PARAMS):
            continue
        body[key] = value
    body["stream"] = False
    return body


def _wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    calls = out.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list):
        # Strict OpenAI servers accept only string arguments on replay.
        out["tool_calls"] = [_wire_call(c) for c in calls]
    return out


def _wire_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if args is None or args == "":
        fn["arguments"] = "{}"
    elif not isinstance(args, str):
        fn["arguments"] = _compact(args)
    return {**call, "type": call.get("type") or "function", "function": fn}


# ---------------------------------------------------------------------------------------------
# Responses


def normalize_completion(raw: Any) -> dict[str, Any]:
    """Validate a provider reply and return the canonical single-choice `chat.completion`."""
    if not isinstance(raw, dict):
        raise ProviderProtocolError("completion is not a JSON object")
    choices = raw.get("choices")
    if not isinstance(choices, list) or not choices:
        if "error" in raw:
            raise ProviderProtocolError("provider returned an error object instead of a completion")
        raise ProviderProtocolError("completion has no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ProviderProtocolError("completion choice has no message")

    out: dict[str, Any] = {k: raw[k] for k in _TOP_LEVEL_KEPT if k in raw}
    out.setdefault("object", "chat.completion")
    completion_id = str(raw.get("id") or "")
    norm_message = _normalize_message(message, completion_id)
    out["choices"] = [
        {
            "index": 0,
            "message": norm_message,
            "finish_reason": _finish_reason(
                choice.get("finish_reason"), "tool_calls" in norm_message
            ),
        }
    ]
    out["usage"] = normalize_usage(raw.get("usage"))
    return out


def _normalize_message(message: Mapping[str, Any], completion_id: str) -> dict[str, Any]:
    role = message.get("role")
    if role not in (None, "", "assistant"):
        raise ProviderProtocolError(f"completion message has role {str(role)[:20]!r}")
    out: dict[str, Any] = {"role": "assistant", "content": _content(message.get("content"))}
    raw_calls = message.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise ProviderProtocolError("tool_calls is not a list")
    if not raw_calls and isinstance(message.get("function_call"), dict):
        raw_calls = [message["function_call"]]  # legacy: one call, its id synthesised below
        legacy = True
    else:
        legacy = False
    calls = [
        call
        for i, c in enumerate(raw_calls or [])
        if (call := _normalize_call(c, i, completion_id, legacy)) is not None
    ]
    if calls:
        out["tool_calls"] = _dedupe_ids(calls)
    for name in CHAT_REASONING_FIELDS:
        if message.get(name) is not None:
            out[name] = message[name]
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        out["refusal"] = message["refusal"]
    return out


def _content(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return content_text(content)  # some servers send content parts even without streaming
    raise ProviderProtocolError(f"message content has unsupported type {type(content).__name__}")


def _normalize_call(
    raw: Any, index: int, completion_id: str, legacy: bool
) -> dict[str, Any] | None:
    """A tool call in canonical form. One that names no function is kept under
    INVALID_CALL_NAME when it has an id (the model is told, VALIDATION_ERROR); one with
    nothing to answer it by is no call at all (logged at debug)."""
    if not isinstance(raw, dict):
        log.debug("tool call %d is not an object: dropped", index)
        return None
    fn = raw if legacy else raw.get("function")
    if not isinstance(fn, dict):
        fn = {}
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        if legacy or not isinstance(raw.get("id"), str) or not raw["id"]:
            log.debug("tool call %d names no function and has no id: dropped", index)
            return None
        fn = {**fn, "name": INVALID_CALL_NAME}
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        arguments = "{}"  # empty-string arguments are no arguments
    elif isinstance(args, str):
        arguments = args  # even invalid JSON is kept raw, so a replay is byte-faithful
    else:
        arguments = _compact(args)  # an object (llama.cpp, TGI, Ollama) is stored as text
    call_id = None if legacy else raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        # no id: one is made once and used on every replay
        call_id = _synthetic_id(completion_id, index, fn["name"], arguments)
    call_type = None if legacy else raw.get("type")
    return {
        "id": call_id,
        # a call with no type is a function call
        "type": call_type if isinstance(call_type, str) and call_type else "function",
        "function": {"name": fn["name"], "arguments": arguments},
    }


def _synthetic_id(completion_id: str, index: int, name: str, arguments: str) -> str:
    # Deterministic, so a redelivered step that normalises the same reply gets the same id.
    seed = "\x00".join((completion_id, str(index), name, arguments))
    return "call_" + hashlib.sha256(seed.encode()).hexdigest()[:24]


def _dedupe_ids(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Duplicate ids in one turn (some local servers): later ones become `<id>_2`, `<id>_3`...,
    never clashing with another id, so each result pairs with one call."""
    originals = {c["id"] for c in calls}
    used: set[str] = set()
    for call in calls:
        base = call["id"]
        if base in used:
            n = 2
            while f"{base}_{n}" in used or f"{base}_{n}" in originals:
                n += 1
            call["id"] = f"{base}_{n}"
        used.add(call["id"])
    return calls


def _finish_reason(raw: Any, has_calls: bool) -> str:
    reason = raw if isinstance(raw, str) and raw else "stop"
    if has_calls:
        # calls decide over "stop" or "function_call", unless they were cut off
        return reason if reason == "length" else "tool_calls"
    if reason in ("tool_calls", "function_call"):
        return "stop"  # the server said tool_calls but sent none: a plain answer
    return reason


def normalize_usage(raw: Any) -> dict[str, Any]:
    """The three token counts as ints; `*_details` (cached, reasoning tokens) kept exactly as
    received."""
    usage = raw if isinstance(raw, dict) else {}
    out: dict[str, Any] = {k: _as_int(usage.get(k)) for k in _USAGE_INTS}
    if usage.get("total_tokens") is None:
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    for key, value in usage.items():
        if key.endswith("_details"):
            out[key] = value
    return out


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int | float):
        return max(int(value), 0)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return 0


def tool_calls_of(completion: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The normalised calls of a canonical completion; [] for none (or for an error body)."""
    choices = completion.get("choices") or [{}]
    calls: list[dict[str, Any]] = (choices[0].get("message") or {}).get("tool_calls") or []
    return list(calls)


def is_empty_reply(completion: Mapping[str, Any]) -> bool:
    """No calls and no text (whitespace only counts as none); a refusal is an answer."""
    message = completion["choices"][0]["message"]
    if message.get("tool_calls") or message.get("refusal"):
        return False
    content = message.get("content")
    return content is None or not content.strip()


def add_usage(total: dict[str, int], usage: Any) -> None:
    for key, value in (usage or {}).items():
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


def with_spent(completion: dict[str, Any], spent: dict[str, int]) -> dict[str, Any]:
    """The reply with the usage of discarded attempts added: they were billed too."""
    if not spent:
        return completion
    usage = dict(completion.get("usage") or {})
    add_usage(usage, spent)
    return {**completion, "usage": usage}


def is_truncated(completion: Mapping[str, Any]) -> bool:
    """A call cut off by the token limit (finish_reason length) never runs: decode_arguments
    would 'repair' it into arguments the model never wrote."""
    return bool(completion["choices"][0].get("finish_reason") == "length")


# ---------------------------------------------------------------------------------------------
# Tool arguments and results


def decode_arguments(raw: str) -> dict[str, Any]:
    """Arguments text -> object. Raises ToolValidationError with a fix for the model to read."""
    if not raw.strip():
        return {}  # empty-string arguments are no arguments
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        value = _repair(raw, exc)
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except json.JSONDecodeError:
            inner = None
        if isinstance(inner, dict):
            # double-encoded: a string that parses to an object is used
            log.warning("double-encoded tool arguments (%d chars) decoded", len(raw))
            return inner
    if value is None:
        return {}  # `null` is read as "no arguments"; any other non-object is an error
    if not isinstance(value, dict):
        kind = _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
        raise ToolValidationError(f"tool arguments must be a JSON object, got {kind}")
    return value


def _repair(raw: str, error: json.JSONDecodeError) -> Any:
    """One cheap repair of arguments that are no JSON: drop code fences, then close what a
    truncation left open."""
    text = raw.strip()
    if text.startswith("```"):
        text = text[3:]
        first_nl = text.find("\n")
        # An info string such as ```json sits on the fence line.
        if first_nl >= 0 and text[:first_nl].strip().isalnum():
            text = text[first_nl + 1 :]
        text = text.removesuffix("```").strip()
    closed = _close_truncated(text)
    for candidate in (text, closed):
        if candidate is None:
            continue
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            pass
    raise ToolValidationError(f"invalid JSON arguments: {error}, resend valid JSON")


def _close_truncated(text: str) -> str | None:
    """Close open strings and brackets, or None when the text is malformed rather than cut."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and (not stack or stack.pop() != ch):
            return None  # a mismatched closer is not a truncation
    if not stack and not in_string:
        return None
    if in_string:
        text = (text[:-1] if escaped else text) + '"'
    text = text.rstrip()
    if text.endswith(","):
        text = text[:-1]
    return text + "".join(reversed(stack))


def tool_message_content(output: Any) -> str:
    """Tool results as non-empty text: other values as JSON, an empty one as a placeholder
    (some servers reject empty content)."""
    if output is None or output == "":
        return NO_OUTPUT
    if isinstance(output, str):
        return output
    if isinstance(output, bytes | bytearray):
        return bytes(output).decode("utf-8", errors="replace") or NO_OUTPUT
    try:
        # ensure_ascii=False: \uXXXX escapes cost the model several tokens per character.
        return json.dumps(output, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(output) or NO_OUTPUT

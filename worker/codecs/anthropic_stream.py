"""Anthropic Messages replies -> the canonical `chat.completion`: the JSON `message` decoder
and the SSE stream assembler (requests are built in `anthropic`).

Pure: no I/O. The assembler rebuilds the `message` object from the events (the way
anthropic-python's `accumulate_event` does) and decodes it with the JSON decoder, so a streamed
round yields exactly the canonical reply of the non-streamed one. Tool-call ids outside
`[a-zA-Z0-9_-]` (which Anthropic rejects) are sanitised by one deterministic function, so one
canonical id always gets one wire id; a reply's wire id is mapped back only when it is the
sanitised form of an id of the request, so the map needs nothing beyond the request.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from schemas.protocols import ANTHROPIC
from schemas.spec_types import INVALID_CALL_NAME
from worker.codecs.openai_chat import normalize_completion
from worker.codecs.protocol import Delta, SseEvent, kept_for_replay
from worker.errors import (
    ProviderError,
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
)

# Error types of an `event: error` that a retry can cure (529, 500, 429), and the 4xx ones.
_RETRYABLE_ERRORS = {"overloaded_error": 529, "api_error": 500, "rate_limit_error": 429}
_REQUEST_ERRORS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
}
_KNOWN_EVENTS = frozenset(
    {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "error",
        "message",  # an SSE event without an `event:` line
    }
)
_SAFE_TYPE = re.compile(r"[a-z_]{1,40}")
_ID_OK = re.compile(r"[a-zA-Z0-9_-]+")
_ID_BAD = re.compile(r"[^a-zA-Z0-9_-]")
_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "pause_turn": "length",  # the turn is unfinished; its content is kept for a continuation
    "refusal": "content_filter",
}


def wire_id(canonical_id: str) -> str:
    """The id Anthropic accepts; valid ids are kept, others get `_` for every bad
    character plus 8 hex of their hash (so `a.b` and `a:b` stay distinct)."""
    if _ID_OK.fullmatch(canonical_id):
        return canonical_id
    digest = hashlib.sha256(canonical_id.encode()).hexdigest()[:8]
    return f"{_ID_BAD.sub('_', canonical_id)}_{digest}"


def reverse_ids(messages: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """wire id -> canonical id for every id of the history that `wire_id` changed."""
    ids: set[str] = set()
    for message in messages:
        if isinstance(message.get("tool_call_id"), str):
            ids.add(message["tool_call_id"])
        for call in message.get("tool_calls") or []:
            if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                ids.add(call["id"])
    return {wire_id(i): i for i in sorted(ids) if wire_id(i) != i}


def _error_type(error: Any) -> str:
    """The `type` of an Anthropic error object, safe to log (never its message, which may
    quote the prompt)."""
    kind = error.get("type") if isinstance(error, Mapping) else None
    return kind if isinstance(kind, str) and _SAFE_TYPE.fullmatch(kind) else "unknown_error"


def _parse_input(raw: str) -> Any:
    """Accumulated `partial_json` -> the block's `input`; nothing streamed -> `{}`.
    Text that does not parse (cut by max_tokens) stays a string: the decoder keeps it as the
    raw arguments, which are never run as they are."""
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


# ---------------------------------------------------------------------------------------------
# JSON replies


def decode_message(body: Any, ids: Mapping[str, str]) -> dict[str, Any]:
    """An Anthropic `message` -> the canonical chat.completion; `ids` maps sanitised wire ids
    back to the request's ids."""
    if not isinstance(body, Mapping):
        raise ProviderProtocolError("Anthropic reply is not a JSON object")
    if body.get("type") == "error" or ("error" in body and "content" not in body):
        error = _error_type(body.get("error"))
        raise ProviderProtocolError(f"Anthropic replied with an error ({error})")
    content = body.get("content")
    if body.get("type") not in (None, "message") or not isinstance(content, list):
        raise ProviderProtocolError("Anthropic reply is not a message")
    if body.get("role") not in (None, "assistant"):
        raise ProviderProtocolError("Anthropic reply is not an assistant message")
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        if not isinstance(block, Mapping):
            raise ProviderProtocolError(f"Anthropic content block {i} is not an object")
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_call(block, i, ids))
        # other blocks (redacted_thinking, server tools, future types) only matter for replay
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    reasoning = "\n\n".join(t for t in thoughts if t)
    if reasoning:
        message["reasoning_content"] = reasoning
    stop = body.get("stop_reason")
    finish = _FINISH.get(stop, "stop") if isinstance(stop, str) else "stop"
    raw = {
        "id": str(body.get("id") or ""),
        "object": "chat.completion",
        "created": 0,
        "model": str(body.get("model") or ""),
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": _usage(body.get("usage")),
    }
    out = normalize_completion(raw)  # calls decide, unless cut off by max_tokens (length)
    choice = out["choices"][0]
    if finish == "content_filter":
        # like length (cut-off calls never run), a refusal outranks its calls
        choice["finish_reason"] = finish
    if any(b.get("type") != "text" for b in content):
        choice["message"]["_provider"] = kept_for_replay(ANTHROPIC, _replay(content, choice))
    return out


def _call(block: Mapping[str, Any], index: int, ids: Mapping[str, str]) -> dict[str, Any]:
    name = block.get("name")
    if not isinstance(name, str) or not name:
        name = INVALID_CALL_NAME  # answered as a VALIDATION_ERROR, not the end of the session
    value = block.get("input")
    if value is None or (isinstance(value, str) and not value.strip()):
        arguments = "{}"
    elif isinstance(value, str):
        arguments = value  # a stream cut inside the JSON: kept raw, never run as is
    else:
        arguments = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    wire = block.get("id")
    call_id = ids.get(wire, wire) if isinstance(wire, str) else ""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _replay(content: list[Any], choice: Mapping[str, Any]) -> list[Any]:
    """The blocks verbatim; a tool_use id the canonical call had to change (missing,
    duplicate) follows it, so the replayed tool_use and its tool_result agree."""
    blocks = copy.deepcopy(content)
    calls = iter(choice["message"].get("tool_calls") or [])
    for block in blocks:
        if block.get("type") == "tool_use":
            block["id"] = wire_id(next(calls)["id"])
    return blocks


def _usage(raw: Any) -> dict[str, Any]:
    """Anthropic's input_tokens excludes the cache reads and writes; the prompt is all three."""
    usage = raw if isinstance(raw, Mapping) else {}
    fresh, read, written, output = (
        _count(usage.get(k))
        for k in (
            "input_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
            "output_tokens",
        )
    )
    prompt = fresh + read + written
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {
            "cached_tokens": read,
            "input_tokens": fresh,
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
        },
    }
    details = usage.get("output_tokens_details")
    if isinstance(details, Mapping) and "thinking_tokens" in details:
        out["completion_tokens_details"] = {"reasoning_tokens": _count(details["thinking_tokens"])}
    return out


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


# ---------------------------------------------------------------------------------------------
# Streams


class AnthropicStreamAssembler:
    """Feeds on SSE events; `result()` is `decode_message(<the equivalent message JSON>)`."""

    def __init__(self, ids: Mapping[str, str]) -> None:
        self._ids = ids
        self._message: dict[str, Any] | None = None
        # keyed by the block index, not the tool ordinal: text may sit at 0, tools at 1 and 2
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}  # partial_json fragments of tool blocks
        self._call_of: dict[int, int] = {}  # a tool block's index -> its call number (Delta)
        self._done = False
        self._progress = 0

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def progress(self) -> int:
        return self._progress

    def feed(self, event: SseEvent) -> list[Delta]:
        if self._done:
            return []  # nothing after message_stop counts
        data = self._data(event)
        if data is None:
            return []
        kind = data.get("type") if isinstance(data.get("type"), str) else event.event
        if kind == "error":
            raise _stream_error(data.get("error"))
        if kind == "message_start":
            self._start(data.get("message"))
            self._progress += 1
            return []
        if kind not in _KNOWN_EVENTS or kind == "message":
            return []  # ping, and event types newer than this codec
        if self._message is None:
            raise ProviderProtocolError(f"Anthropic stream sent {kind} before message_start")
        if kind == "content_block_delta":
            deltas = self._delta(data)
            self._progress += bool(deltas)  # an empty text delta gives nothing new
            return deltas
        self._progress += 1
        if kind == "content_block_start":
            return self._block_start(data)
        elif kind == "content_block_stop":
            self._close(_index(data))
        elif kind == "message_delta":
            self._message_delta(data)
        elif kind == "message_stop":
            self._done = True
        return []

    def result(self) -> dict[str, Any]:
        if not self._done or self._message is None:
            raise ProviderProtocolError("Anthropic stream ended before message_stop")
        if not self._message.get("stop_reason"):
            raise ProviderProtocolError("Anthropic stream ended without a stop_reason")
        for index in list(self._json):
            self._close(index)
        message = dict(self._message)
        message["content"] = [copy.deepcopy(self._blocks[i]) for i in sorted(self._blocks)]
        return decode_message(message, self._ids)

    # -----------------------------------------------------------------------------------------

    @staticmethod
    def _data(event: SseEvent) -> dict[str, Any] | None:
        try:
            data = json.loads(event.data)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            return data
        if event.event in _KNOWN_EVENTS:
            raise ProviderProtocolError(f"Anthropic stream event {event.event} is not JSON")
        return None  # `ping` with no data, or an unknown event: ignored

    def _start(self, raw: Any) -> None:
        if not isinstance(raw, Mapping):
            raise ProviderProtocolError("Anthropic message_start carries no message")
        message = copy.deepcopy(dict(raw))
        initial = message.get("content")
        self._blocks = {
            i: b
            for i, b in enumerate(initial if isinstance(initial, list) else [])
            if isinstance(b, dict)
        }
        self._json = {}
        self._call_of = {}
        usage = message.get("usage")
        message["usage"] = dict(usage) if isinstance(usage, Mapping) else {}
        self._message = message

    def _block_start(self, data: Mapping[str, Any]) -> list[Delta]:
        index = _index(data)
        block = data.get("content_block")
        if not isinstance(block, Mapping):
            raise ProviderProtocolError(f"Anthropic content_block_start {index} has no block")
        self._blocks[index] = copy.deepcopy(dict(block))
        if not isinstance(block.get("input"), Mapping):
            return []
        self._json[index] = []  # the `{}` of the start event is not a fragment
        self._call_of[index] = len(self._call_of)  # the round's calls, in the order they open
        return [Delta("tool_call", "", self._call_of[index], str(block.get("name") or ""))]

    def _delta(self, data: Mapping[str, Any]) -> list[Delta]:
        index = _index(data)
        block = self._blocks.get(index)
        delta = data.get("delta")
        if block is None:
            raise ProviderProtocolError(f"Anthropic delta for unopened block {index}")
        if not isinstance(delta, Mapping):
            return []
        kind, btype = delta.get("type"), block.get("type")
        if kind == "text_delta" and btype == "text":
            text = str(delta.get("text") or "")
            block["text"] = str(block.get("text") or "") + text
            return [Delta("content", text)] if text else []
        if kind == "thinking_delta" and btype == "thinking":
            text = str(delta.get("thinking") or "")
            block["thinking"] = str(block.get("thinking") or "") + text
            return [Delta("reasoning", text)] if text else []
        if kind == "input_json_delta" and index in self._json:
            piece = str(delta.get("partial_json") or "")
            self._json[index].append(piece)
            return [Delta("tool_call", piece, self._call_of[index])] if piece else []
        elif kind == "signature_delta" and btype == "thinking":
            block["signature"] = delta.get("signature")
            self._progress += 1
        elif kind == "citations_delta" and btype == "text":
            block["citations"] = [*(block.get("citations") or []), delta.get("citation")]
            self._progress += 1
        return []  # other deltas (future types) are ignored, never a crash

    def _close(self, index: int) -> None:
        fragments = self._json.pop(index, None)
        if fragments is not None and index in self._blocks:
            self._blocks[index]["input"] = _parse_input("".join(fragments))

    def _message_delta(self, data: Mapping[str, Any]) -> None:
        assert self._message is not None
        delta = data.get("delta")
        if isinstance(delta, Mapping):
            for key, value in delta.items():
                if value is not None:
                    self._message[key] = value
        usage = data.get("usage")
        if isinstance(usage, Mapping):
            # the counts are cumulative, so they replace (absent ones keep the start's)
            self._message["usage"].update({k: v for k, v in usage.items() if v is not None})


def _index(data: Mapping[str, Any]) -> int:
    index = data.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ProviderProtocolError(f"Anthropic {data.get('type')} event has no block index")
    return index


def _stream_error(error: Any) -> ProviderError:
    """An `event: error` after HTTP 200 (overloaded, rate limits: retried if nothing ran)."""
    kind = _error_type(error)
    message = f"Anthropic stream error: {kind}"
    if kind in _RETRYABLE_ERRORS:
        return ProviderRetryableError(message, status=_RETRYABLE_ERRORS[kind])
    if kind in _REQUEST_ERRORS:
        return ProviderRequestError(message, status=_REQUEST_ERRORS[kind])
    return ProviderError(message)

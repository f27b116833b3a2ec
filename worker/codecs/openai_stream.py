"""OpenAI `chat.completion.chunk` streams -> the canonical `chat.completion`.

Pure: no I/O. The assembler rebuilds the JSON the same round would have returned without
streaming and runs it through `normalize_completion`, so every rule of non-streamed replies
(ids, types, empty arguments, finish reasons, usage) applies to streamed ones alike.

Tool-call fragments are merged into slots like openai-python's `accumulate_delta`: `index`
selects the slot (interleaved calls, even the same index twice in one chunk), `id`/`type` are
assigned and a repeated `name` is kept while a different one is appended (some servers split
long names), `arguments` always append. A fragment without `index` (some proxies) opens a new
slot when it brings an id not seen yet and otherwise continues the latest slot. Only choice 0
is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from schemas.protocols import CHAT_REASONING_FIELDS
from worker.codecs.openai_chat import content_text, normalize_completion
from worker.codecs.protocol import Delta, SseEvent
from worker.codecs.retry import should_retry_status
from worker.errors import (
    ProviderError,
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
)

DONE = "[DONE]"
_TOP_LEVEL = ("id", "created", "model", "system_fingerprint")
_MAX_ERROR_CHARS = 300
# error codes or types in a stream that say the request itself is wrong: retrying cannot help
_REQUEST_FAULTS = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "context_length_exceeded",
        "invalid_api_key",
    }
)


@dataclass
class _Slot:
    seq: int  # order of creation, for slots without an index
    index: int | None
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)

    def merge(self, fragment: dict[str, Any]) -> Delta | None:
        """Take a fragment of the call; what it added to the name and arguments, if anything."""
        if isinstance(fragment.get("id"), str) and fragment["id"]:
            self.id = fragment["id"]
        if isinstance(fragment.get("type"), str) and fragment["type"]:
            self.type = fragment["type"]
        fn = fragment.get("function")
        if not isinstance(fn, dict):
            return None
        name, added = fn.get("name"), ""
        if isinstance(name, str) and name and name != self.name:
            self.name, added = (self.name or "") + name, name  # a long name split in pieces
        args, piece = fn.get("arguments"), ""
        if isinstance(args, str):
            piece = args
            self.arguments.append(piece)
        elif isinstance(args, dict | list):  # a server that sends the whole object at once
            piece = json.dumps(args, separators=(",", ":"))
            self.arguments.append(piece)
        return Delta("tool_call", piece, self.seq, added) if added or piece else None

    def raw(self) -> dict[str, Any]:
        """The call as a non-streamed reply would have carried it (None: normalise decides)."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": "".join(self.arguments)},
        }


class OpenAIStreamAssembler:
    """`StreamAssembler` for OpenAI-compatible chat-completions SSE streams."""

    def __init__(self) -> None:
        self._top: dict[str, Any] = {}
        self._content: list[str] = []
        self._refusal: list[str] = []
        self._reasoning: dict[str, list[str]] = {}
        self._slots: list[_Slot] = []
        self._by_index: dict[int, _Slot] = {}
        self._legacy: _Slot | None = None  # the legacy single call, streamed: delta.function_call
        self._finish_reason: str | None = None
        self._usage: Any = None
        self._usage_final = False  # the usage came from the `choices: []` chunk
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
            return []  # anything after [DONE] is ignored
        data = event.data.strip()
        if data == DONE:
            self._done = True
            self._progress += 1
            return []
        if not data or event.event == "ping":
            return []
        try:
            chunk = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            if event.event == "error":
                raise stream_error(data) from None
            raise ProviderProtocolError(
                f"stream event is not JSON ({len(event.data)} chars)"
            ) from None
        if not isinstance(chunk, dict):
            raise ProviderProtocolError("stream chunk is not a JSON object")
        if chunk.get("error") is not None:
            raise stream_error(chunk["error"])  # an error object in a 200 stream
        if event.event == "error":
            raise stream_error(chunk)
        before = (self._finish_reason, self._usage)
        deltas = self._chunk(chunk)
        # a chunk with an empty delta (some servers' keepalive) gives nothing new
        self._progress += bool(deltas) or (self._finish_reason, self._usage) != before
        return deltas

    def _chunk(self, chunk: dict[str, Any]) -> list[Delta]:
        for key in _TOP_LEVEL:
            if self._top.get(key) is None and chunk.get(key) is not None:
                self._top[key] = chunk[key]
        choices = chunk.get("choices")
        if choices is not None and not isinstance(choices, list):
            raise ProviderProtocolError("stream chunk choices is not a list")
        if chunk.get("usage") is not None:
            # The `choices: []` chunk carries the usage; a server that puts a
            # cumulative usage on other chunks instead is read from its last one.
            if not choices:
                self._usage, self._usage_final = chunk["usage"], True
            elif not self._usage_final:
                self._usage = chunk["usage"]
        deltas: list[Delta] = []
        for choice in choices or []:
            if isinstance(choice, dict) and choice.get("index", 0) in (0, None):
                deltas.extend(self._choice(choice))
        return deltas

    def _choice(self, choice: dict[str, Any]) -> list[Delta]:
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self._finish_reason = reason
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return []
        out: list[Delta] = []
        for name in CHAT_REASONING_FIELDS:
            text = delta.get(name)
            if isinstance(text, str) and text:
                self._reasoning.setdefault(name, []).append(text)
                out.append(Delta("reasoning", text))
        text = content_text(delta.get("content"))  # content parts, as some servers send them
        if text:
            self._content.append(text)
            out.append(Delta("content", text))
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self._refusal.append(refusal)
            out.append(Delta("content", refusal))
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for fragment in calls:
                if isinstance(fragment, dict):
                    out.extend(_some(self._slot_for(fragment).merge(fragment)))
        elif calls is not None:
            raise ProviderProtocolError("stream delta tool_calls is not a list")
        if isinstance(delta.get("function_call"), dict):
            self._legacy = self._legacy or _Slot(seq=0, index=None)
            out.extend(_some(self._legacy.merge({"function": delta["function_call"]})))
        return out

    def _slot_for(self, fragment: dict[str, Any]) -> _Slot:
        index = fragment.get("index")
        if isinstance(index, int) and not isinstance(index, bool):
            slot = self._by_index.get(index)
            if slot is None:
                slot = self._by_index[index] = self._open(index)
            return slot
        # No index (some proxies). A new id opens a slot; no id (or a repeated one) continues.
        call_id = fragment.get("id")
        if isinstance(call_id, str) and call_id:
            for slot in reversed(self._slots):
                if slot.id == call_id:
                    return slot
            return self._open(None)
        return self._slots[-1] if self._slots else self._open(None)

    def _open(self, index: int | None) -> _Slot:
        slot = _Slot(seq=len(self._slots), index=index)
        self._slots.append(slot)
        return slot

    def result(self) -> dict[str, Any]:
        if not self._done:
            # truncated: its half-built calls must never run
            raise ProviderProtocolError("stream ended without [DONE] (truncated)")
        if self._finish_reason is None:
            raise ProviderProtocolError("stream ended without a finish_reason (truncated)")
        return normalize_completion(self.equivalent_completion())

    def equivalent_completion(self) -> dict[str, Any]:
        """The non-streamed reply this stream stands for, before normalisation."""
        message: dict[str, Any] = {
            "role": "assistant",
            # a stream that carried no text stands for `"content": null`
            "content": "".join(self._content) or None,
        }
        slots = sorted(self._slots, key=lambda s: (math.inf if s.index is None else s.index, s.seq))
        if slots:
            message["tool_calls"] = [s.raw() for s in slots]
        elif self._legacy is not None:
            message["function_call"] = self._legacy.raw()["function"]
        for name, parts in self._reasoning.items():
            message[name] = "".join(parts)
        if self._refusal:
            message["refusal"] = "".join(self._refusal)
        raw: dict[str, Any] = {"object": "chat.completion", **self._top}
        raw["choices"] = [{"index": 0, "message": message, "finish_reason": self._finish_reason}]
        raw["usage"] = self._usage
        return raw


def stream_error(error: Any) -> ProviderError:
    """An error object inside a 200 stream. A 4xx-style request fault ends the session;
    5xx, 429, 408/409 and anything unrecognised (upstream timeouts, disconnects) are retried."""
    if isinstance(error, dict):
        message, code, kind = error.get("message"), error.get("code"), error.get("type")
    else:
        message, code, kind = error, None, None
    status = _status(code)
    if status is None:
        status = _status(error.get("status")) if isinstance(error, dict) else None
    if not isinstance(message, str):
        message = json.dumps(message) if message is not None else str(kind or code or "")
    text = "error in stream: " + (" ".join(message.split()) or "no message")[:_MAX_ERROR_CHARS]
    if status is not None:
        if should_retry_status(status, {}):
            return ProviderRetryableError(text, status)
        return ProviderRequestError(text, status)
    if code in _REQUEST_FAULTS or kind in _REQUEST_FAULTS:
        return ProviderRequestError(text)
    return ProviderRetryableError(text)


def _status(code: Any) -> int | None:
    if isinstance(code, bool):
        return None
    if isinstance(code, str) and code.strip().isdigit():
        code = int(code)
    if isinstance(code, int) and 100 <= code <= 599:
        return code
    return None


def _some(delta: Delta | None) -> list[Delta]:
    return [] if delta is None else [delta]

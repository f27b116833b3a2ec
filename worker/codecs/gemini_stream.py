"""Gemini `streamGenerateContent?alt=sse` streams -> display Deltas and, at the end, the
canonical `chat.completion` (the JSON decoder of `gemini_reply` on the merged response).

Pure: no I/O.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from worker.codecs.gemini_reply import decode_completion, provider_error
from worker.codecs.protocol import ChatRequest, Delta, SseEvent
from worker.errors import ProviderProtocolError


class GeminiStreamAssembler:
    """Every SSE `data:` is a whole GenerateContentResponse. Parts are kept in arrival
    order (text increments concatenate into the content, each functionCall arrives whole and
    is appended, a thoughtSignature stays on its part); usage, responseId and modelVersion come
    from the last chunk that has them, the finish reason from the last chunk with one. Gemini
    sends no terminator: `finished` means a finishReason (or a prompt block) was seen.
    `result()` is `decode` of the merged response."""

    def __init__(self, request: ChatRequest) -> None:
        self._request = request
        self._parts: list[dict[str, Any]] = []
        self._top: dict[str, Any] = {}  # responseId, modelVersion, usageMetadata, promptFeedback
        self._candidate: dict[str, Any] = {}  # finishReason, finishMessage, index
        self._blocked = False
        self._calls = 0  # functionCall parts so far: the next call's number (Delta)
        self._progress = 0
        self._filled = 0  # parts with something in them (not an empty text)

    @property
    def progress(self) -> int:
        return self._progress

    def feed(self, event: SseEvent) -> list[Delta]:
        data = event.data.strip()
        if not data:
            return []
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ProviderProtocolError("Gemini stream event is not JSON") from None
        before = (self._filled, self.finished)
        deltas: list[Delta] = []
        for item in chunk if isinstance(chunk, list) else [chunk]:
            deltas.extend(self._feed_chunk(item))
        self._progress += bool(deltas) or (self._filled, self.finished) != before
        return deltas

    def _feed_chunk(self, chunk: Any) -> list[Delta]:
        if not isinstance(chunk, dict):
            raise ProviderProtocolError("Gemini stream chunk is not a JSON object")
        if "error" in chunk:
            raise provider_error(chunk)
        for key in ("responseId", "modelVersion", "usageMetadata", "promptFeedback"):
            if key in chunk:
                self._top[key] = chunk[key]
        feedback = chunk.get("promptFeedback")
        if isinstance(feedback, dict) and feedback.get("blockReason"):
            self._blocked = True
        candidates = chunk.get("candidates")
        if not isinstance(candidates, list) or not candidates:
            return []
        candidate = candidates[0]
        if not isinstance(candidate, dict):
            raise ProviderProtocolError("Gemini stream candidate is not an object")
        for key in ("finishReason", "finishMessage", "index"):
            if candidate.get(key) is not None:
                self._candidate[key] = candidate[key]
        content = candidate.get("content")
        parts = content.get("parts") if isinstance(content, dict) else None
        deltas: list[Delta] = []
        for part in parts if isinstance(parts, list) else []:
            if not isinstance(part, dict):
                raise ProviderProtocolError("Gemini stream part is not an object")
            self._parts.append(copy.deepcopy(part))
            self._filled += part != {"text": ""}
            text = part.get("text")
            call = part.get("functionCall")
            if isinstance(call, dict):  # a call comes whole in one part: name and arguments
                args = json.dumps(call.get("args") or {}, ensure_ascii=False)
                deltas.append(Delta("tool_call", args, self._calls, str(call.get("name") or "")))
                self._calls += 1
            elif isinstance(text, str) and text and "functionCall" not in part:
                thought = part.get("thought") is True
                deltas.append(Delta("reasoning" if thought else "content", text))
        return deltas

    @property
    def finished(self) -> bool:
        return "finishReason" in self._candidate or self._blocked

    def result(self) -> dict[str, Any]:
        if "finishReason" not in self._candidate and not self._blocked:
            raise ProviderProtocolError("Gemini stream ended without a finishReason (truncated)")
        merged = dict(self._top)
        if "finishReason" in self._candidate or self._parts:
            content = {"role": "model", "parts": self._parts}
            merged["candidates"] = [{"content": content, **self._candidate}]
        return decode_completion(merged, self._request)

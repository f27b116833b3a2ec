"""A streamed round's state so far (`cq:partial:<sk>`): its text, its thinking, and each tool
call's name and argument text as they arrive. The streaming worker writes it (throttled) while
the round streams and deletes it when the call ends; `cchatq status` and the session viewer
read it. It is the model's content: it lives in Redis only, never in logs, events or metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PartialCall:
    name: str  # as far as it has arrived ("" until then)
    arguments: str  # the argument text so far: JSON, usually not yet complete

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class PartialRound:
    text: str = ""
    thinking: str = ""
    tool_calls: tuple[PartialCall, ...] = field(default_factory=tuple)

    def encode(self) -> bytes:
        calls = [c.to_json() for c in self.tool_calls]
        value = {"text": self.text, "thinking": self.thinking, "tool_calls": calls}
        return json.dumps(value, ensure_ascii=False).encode()

    @classmethod
    def decode(cls, raw: bytes) -> PartialRound:
        """The stored value; a value that is not this JSON object is text (as a worker that
        streams text only writes it)."""
        try:
            value: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            value = None
        if not isinstance(value, dict) or not isinstance(value.get("text"), str):
            return cls(text=raw.decode(errors="replace"))
        calls = value.get("tool_calls")
        return cls(
            text=value["text"],
            thinking=str(value.get("thinking") or ""),
            tool_calls=tuple(
                PartialCall(str(c.get("name") or ""), str(c.get("arguments") or ""))
                for c in (calls if isinstance(calls, list) else [])
                if isinstance(c, dict)
            ),
        )

    def status_fields(self) -> dict[str, Any]:
        """What `cchatq status` shows of it: each part that has arrived."""
        out: dict[str, Any] = {"partial_text": self.text}
        if self.thinking:
            out["partial_thinking"] = self.thinking
        if self.tool_calls:
            out["partial_tool_calls"] = [c.to_json() for c in self.tool_calls]
        return out

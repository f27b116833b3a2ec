"""A model reply, read once: the canonical chat.completion a round stored (or the error body it
ended in), with its tool calls, message, finish reason and usage as typed values. It is made
where a reply is stored or loaded and used as it is everywhere after; a call's arguments are
decoded the first time they are asked for, and never again for that value.

Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from schemas.bodies import is_error_body
from worker.codecs.openai_chat import decode_arguments
from worker.errors import ToolValidationError


@dataclass(frozen=True)
class Arguments:
    """A call's arguments as decoded once: the object (repaired, unwrapped) and its compact JSON
    (what the tool receives), or why they cannot be read."""

    value: dict[str, Any] | None
    canonical: str | None  # compact JSON of `value`
    problem: str | None  # the decoder's message when they cannot be read


@dataclass(frozen=True)
class ReplyCall:
    """One tool call of a reply: its id, the function it names and the arguments text as the
    model wrote it (kept, so a replay is byte-faithful)."""

    id: str
    name: str
    arguments_text: str
    raw: dict[str, Any] = field(compare=False, repr=False)  # the canonical call object

    @cached_property
    def arguments(self) -> Arguments:
        try:
            value = decode_arguments(self.arguments_text)
        except ToolValidationError as exc:
            return Arguments(None, None, exc.message)
        canonical = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return Arguments(value, canonical, None)

    @property
    def key(self) -> tuple[str, str]:
        """What makes two calls the same call: the name and the decoded arguments."""
        return self.name, self.arguments.canonical or self.arguments_text


@dataclass(frozen=True)
class Reply:
    completion: dict[str, Any]  # the canonical chat.completion, or an error body
    message: dict[str, Any] = field(compare=False, repr=False)  # choices[0].message ({} if none)
    finish_reason: str | None = field(compare=False, repr=False)

    @classmethod
    def parse(cls, completion: dict[str, Any]) -> Reply:
        if is_error_body(completion):
            return cls(completion, {}, None)
        choices = completion.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message")
        if not isinstance(message, dict):
            message = {}
        reason = choice.get("finish_reason")
        return cls(completion, message, reason if isinstance(reason, str) else None)

    @cached_property
    def calls(self) -> tuple[ReplyCall, ...]:
        """The tool calls, in order (read when first asked for: a reply that cannot be read
        fails whoever asks, under that step's rules, not whoever merely loads it)."""
        return tuple(
            ReplyCall(c["id"], c["function"]["name"], c["function"]["arguments"], c)
            for c in self.message.get("tool_calls") or ()
        )

    @property
    def call_count(self) -> int:
        """How many tool calls the reply made, without reading them."""
        return len(self.message.get("tool_calls") or ())

    @property
    def error(self) -> dict[str, Any] | None:
        """The error object of an error body, else None."""
        return self.completion["error"] if is_error_body(self.completion) else None

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def content(self) -> str | None:
        content = self.message.get("content")
        return content if isinstance(content, str) else None

    @property
    def usage(self) -> dict[str, Any]:
        usage = self.completion.get("usage")
        return usage if isinstance(usage, dict) else {}

    def tokens(self, key: str) -> int | None:
        """One usage count (`prompt_tokens`, `completion_tokens`, `total_tokens`), if given."""
        value = self.usage.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

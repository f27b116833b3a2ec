"""The contract every wire protocol meets (OpenAI-compatible, Anthropic Messages, Gemini
generateContent, `<tool_call>` text tags): pure translation between the canonical OpenAI
`chat.completion` shape and a wire format, for JSON replies and for SSE streams.

Canonical shapes
----------------
Request (`ChatRequest`): OpenAI-style `messages` and `tools`. An assistant message may carry
  - `reasoning_content`: the model's thinking text (any protocol);
  - `_provider`: `{"<protocol>": {<own entry>: <verbatim wire content of that turn>}}`, e.g.
    Anthropic `{"anthropic": {"content": [blocks with signed thinking]}}` or Gemini
    `{"gemini": {"parts": [parts with thoughtSignature]}}`. A codec replays its own entry
    verbatim (signatures must go back untouched) and ignores the others'; each protocol's
    entry is declared with its replay rules in `schemas.protocols` (`kept_for_replay`,
    `own_replay`).
Reply: an OpenAI `chat.completion` with one choice; `message.content` (str | None),
  `message.tool_calls` (ids, `type`, `function.name`, `function.arguments` as a JSON string),
  `message.reasoning_content` when the model thought, `message._provider` as above,
  `finish_reason` in stop | tool_calls | length | content_filter, and `usage` with
  `prompt_tokens`, `completion_tokens`, `total_tokens` (ints, the prompt with its cached
  tokens, the completion with its reasoning tokens), plus the `*_details` the provider gave.
A streamed round yields exactly the reply the same round would have had without streaming.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from schemas.protocols import WireProtocol

ToolChoice = Literal["auto", "none", "required"] | dict[str, str] | None  # {"name": f} = that tool


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool dicts
    params: dict[str, Any] = field(default_factory=dict)  # passed through as top-level fields
    tool_choice: ToolChoice = None  # None: the provider's default (auto)
    parallel_tool_calls: bool | None = None
    stream: bool = False
    thinking_budget_tokens: int | None = None  # None: thinking off
    max_tokens: int | None = None  # Anthropic requires one: its codec falls back to a default
    # the bound on the whole call, retries included (limits.request_timeout_ms); None: the
    # backend's total_timeout_s. Not part of the wire body.
    timeout_s: float | None = None


@dataclass(frozen=True)
class WireRequest:
    path: str  # appended to the backend's base URL, e.g. "/chat/completions"
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)  # protocol headers; auth is the edge's
    query: dict[str, str] = field(default_factory=dict)  # e.g. Gemini's {"alt": "sse"}


@dataclass(frozen=True)
class SseEvent:
    event: str  # "message" when the stream named none
    data: str  # the data lines joined with "\n"
    id: str | None = None


@dataclass(frozen=True)
class Delta:
    """Text to show while a round runs (`cchatq status`); never needed for the result. A
    `tool_call` delta is a piece of the round's tool call number `call` (0, 1, ... in the
    order the calls open): `name` as far as this piece gives it, `text` its argument text."""

    kind: Literal["content", "reasoning", "tool_call", "restart"]  # restart: a retry starts over
    text: str
    call: int = 0
    name: str = ""


class StreamAssembler(Protocol):
    def feed(self, event: SseEvent) -> list[Delta]:
        """Take one SSE event. Raises ProviderError for an error event in the stream."""
        ...

    @property
    def finished(self) -> bool:
        """The protocol's terminator was seen ([DONE], message_stop; Gemini: end of body)."""
        ...

    @property
    def progress(self) -> int:
        """How many events so far gave the reply something new (text, a piece of a call, a
        finish, usage, a terminator). An event that leaves it where it was (a `ping`, an empty
        delta) is a keepalive: the stream's idle timeout does not count it as content."""
        ...

    def result(self) -> dict[str, Any]:
        """The canonical chat.completion. Raises ProviderProtocolError when the stream was
        truncated (no terminator or no finish reason): a truncated call is never executed."""
        ...


class Codec(Protocol):
    protocol: str

    def encode(self, request: ChatRequest) -> WireRequest: ...

    def decode(self, body: Any, request: ChatRequest) -> dict[str, Any]:
        """A JSON reply -> the canonical chat.completion (ProviderProtocolError if unreadable)."""
        ...

    def assembler(self, request: ChatRequest) -> StreamAssembler: ...

    def retry_after_s(self, status: int, body: Any) -> float | None:
        """A retry delay the protocol puts in an error body (Gemini RetryInfo), if any."""
        ...


def kept_for_replay(declared: WireProtocol, wire_copy: Any) -> dict[str, Any]:
    """A decoded turn's `_provider`: its wire copy under the protocol's own entry."""
    if declared.replay.own_entry is None:
        raise ValueError(f"protocol {declared.name} keeps no wire copy of a turn")
    return {declared.name: {declared.replay.own_entry: wire_copy}}


def own_replay(message: Mapping[str, Any], declared: WireProtocol) -> Any:
    """The wire copy an assistant turn kept for this protocol, or None (the turn came from
    another protocol, or kept none)."""
    provider = message.get("_provider")
    entry = provider.get(declared.name) if isinstance(provider, Mapping) else None
    key = declared.replay.own_entry
    return entry.get(key) if key is not None and isinstance(entry, Mapping) else None

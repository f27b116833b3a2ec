"""The OpenAI-compatible chat-completions protocol ("openai") as a `Codec`. Pure: no I/O.

Built on the functions of `openai_chat` (bodies out, `normalize_completion` in) and the
streaming assembler of `openai_stream`.

Decisions:
- Reasoning replay: an assistant turn's `reasoning_content` / `reasoning` is sent back
  only when the request params say `"replay_reasoning": true` (DeepSeek thinking mode needs
  it; strict servers reject unknown fields). The switch itself never reaches the wire.
- `_provider` (other protocols' verbatim turns) is never sent.
- tool_choice as docs/provider-conformance.md maps it: auto | none | required as strings, a specific
  tool as `{"type": "function", "function": {"name": f}}`; `parallel_tool_calls` is sent when
  set. Both are dropped when the request has no tools (strict servers answer 400).
- `thinking_budget_tokens` has no standard chat-completions field and is ignored: a backend's
  own switch (`reasoning_effort`, `chat_template_kwargs`...) goes in the params.
- `max_tokens` is sent as `max_tokens` unless the params already set it or
  `max_completion_tokens`.
"""

from __future__ import annotations

from typing import Any

from schemas.protocols import CHAT_REASONING_FIELDS, OPENAI, WireProtocol
from worker.codecs.openai_chat import build_request, normalize_completion
from worker.codecs.openai_stream import OpenAIStreamAssembler
from worker.codecs.protocol import ChatRequest, StreamAssembler, ToolChoice, WireRequest
from worker.errors import ProviderRequestError

REPLAY_REASONING = "replay_reasoning"  # a params switch read here, never sent
_MAX_TOKENS_PARAMS = ("max_tokens", "max_completion_tokens")


class OpenAICodec:
    """Speaks `declared` (openai; the text-tag codec sends its bodies through one speaking
    openai-text-tags), whose replay rules say which reasoning fields may go back."""

    def __init__(self, declared: WireProtocol = OPENAI) -> None:
        self.protocol = declared.name
        self._reasoning_fields = declared.replay.reasoning_fields

    def encode(self, request: ChatRequest) -> WireRequest:
        params = dict(request.params)
        replay = params.pop(REPLAY_REASONING, False) is True
        replayed = self._reasoning_fields if replay else ()
        messages = [outgoing_message(m, replayed) for m in request.messages]
        body = build_request(request.model, messages, request.tools, params)
        if request.tools:
            choice = wire_tool_choice(request.tool_choice)
            if choice is not None:
                body["tool_choice"] = choice
            if request.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = request.parallel_tool_calls
        if request.max_tokens is not None and not any(k in params for k in _MAX_TOKENS_PARAMS):
            body["max_tokens"] = request.max_tokens
        body["stream"] = request.stream
        if request.stream:
            # the usage then comes in a last `choices: []` chunk; without it, none comes
            body["stream_options"] = {"include_usage": True}
        return WireRequest("/chat/completions", body)

    def decode(self, body: Any, request: ChatRequest) -> dict[str, Any]:
        return normalize_completion(body)

    def assembler(self, request: ChatRequest) -> StreamAssembler:
        return OpenAIStreamAssembler()

    def retry_after_s(self, status: int, body: Any) -> float | None:
        return None  # OpenAI-style servers say it in headers only


def outgoing_message(message: dict[str, Any], replayed: tuple[str, ...]) -> dict[str, Any]:
    """A transcript message as this protocol sends it: `_provider` stays home, and so does
    every reasoning field of an assistant turn but the `replayed` ones (strict servers reject
    unknown fields)."""
    out = {k: v for k, v in message.items() if k != "_provider"}
    if out.get("role") == "assistant":
        for name in CHAT_REASONING_FIELDS:
            if name not in replayed:
                out.pop(name, None)
    return out


def wire_tool_choice(choice: ToolChoice) -> Any:
    """The neutral tool choice in chat-completions spelling (None: the server's default)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise ProviderRequestError(f"unsupported tool_choice {str(choice)[:40]!r}")

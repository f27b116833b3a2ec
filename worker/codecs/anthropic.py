"""Anthropic Messages codec: canonical OpenAI-shaped requests out (this module), canonical
`chat.completion` dicts in (`anthropic_stream`: JSON replies and SSE streams).

Pure: no I/O.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from schemas.protocols import ANTHROPIC
from schemas.spec_types import default_parameters
from worker.codecs.anthropic_stream import (
    AnthropicStreamAssembler,
    decode_message,
    reverse_ids,
    wire_id,
)
from worker.codecs.openai_chat import NO_OUTPUT, content_text, tool_result_text
from worker.codecs.protocol import ChatRequest, WireRequest, own_replay
from worker.codecs.replay_arguments import arguments_text, replay_object
from worker.errors import ProviderRequestError

if TYPE_CHECKING:
    from worker.codecs.protocol import Codec

API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
MIN_THINKING_BUDGET = 1024  # the API's floor for budget_tokens
THINKING_HEADROOM = 1024  # max_tokens >= budget + this, so thinking leaves room for the answer
PLACEHOLDER_USER = "."  # the first turn must be a user turn

_THINKING = frozenset({"thinking", "redacted_thinking"})
# Owned by the codec (ChatRequest fields or translated below), never passed through.
_OWNED_PARAMS = frozenset(
    {
        "model", "messages", "system", "tools", "tool_choice", "parallel_tool_calls", "stream",
        "stream_options", "thinking", "max_tokens", "max_completion_tokens", "stop", "user",
    }
)  # fmt: skip
# OpenAI-only knobs the Messages API rejects as unknown fields.
_OPENAI_ONLY_PARAMS = frozenset(
    {
        "n", "response_format", "frequency_penalty", "presence_penalty", "logit_bias",
        "logprobs", "top_logprobs", "seed", "reasoning_effort", "modalities", "audio",
        "prediction", "store", "web_search_options", "verbosity", "functions", "function_call",
    }
)  # fmt: skip


class AnthropicCodec:
    """The Anthropic Messages API (`POST /messages`, `anthropic-version: 2023-06-01`)."""

    protocol = ANTHROPIC.name

    def encode(self, request: ChatRequest) -> WireRequest:
        return WireRequest(
            path="/messages", headers={"anthropic-version": API_VERSION}, body=build_body(request)
        )

    def decode(self, body: Any, request: ChatRequest) -> dict[str, Any]:
        return decode_message(body, reverse_ids(request.messages))

    def assembler(self, request: ChatRequest) -> AnthropicStreamAssembler:
        return AnthropicStreamAssembler(reverse_ids(request.messages))

    def retry_after_s(self, status: int, body: Any) -> float | None:
        return None  # Anthropic puts delays in headers only, which the edge reads


if TYPE_CHECKING:
    _: Codec = AnthropicCodec()


# ---------------------------------------------------------------------------------------------
# Requests


def build_body(request: ChatRequest) -> dict[str, Any]:
    params = request.params
    thinking = _thinking(request)
    system, turns = _convert(request.messages)
    if thinking is not None and _last_tool_turn_unsigned(turns):
        # Would 400 "Expected `thinking`...": history from elsewhere has no signed blocks.
        thinking = None
    if thinking is None:
        # thinking blocks are sent back only while thinking is on
        turns = _normalise([_without_thinking(t) for t in turns])
    body: dict[str, Any] = {
        "model": request.model,
        "max_tokens": _max_tokens(request, thinking),
        "messages": turns,
    }
    if system:
        body["system"] = "\n\n".join(system)  # no system role inside `messages`
    elif isinstance(params.get("system"), str | list) and params["system"]:
        body["system"] = params["system"]
    tools = [_wire_tool(t) for t in request.tools]
    choice = _tool_choice(request, thinking)
    if not tools:
        tools = _history_tools(turns)  # tool blocks in a history without tools: a 400
        choice = {"type": "none"} if tools else None
    if tools:
        body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = choice
    if thinking is not None:
        body["thinking"] = thinking
    body.update(_passthrough(params, thinking is not None))
    body["stream"] = request.stream
    return body


def _thinking(request: ChatRequest) -> dict[str, Any] | None:
    budget = request.thinking_budget_tokens
    if budget is not None:
        if budget <= 0:
            return None
        return {"type": "enabled", "budget_tokens": max(budget, MIN_THINKING_BUDGET)}
    raw = request.params.get("thinking")  # an Anthropic-native setting, used as given
    if isinstance(raw, Mapping) and raw.get("type") not in (None, "disabled"):
        return dict(raw)
    return None


def _max_tokens(request: ChatRequest, thinking: Mapping[str, Any] | None) -> int:
    params = request.params
    limit = DEFAULT_MAX_TOKENS
    given = (request.max_tokens, params.get("max_tokens"), params.get("max_completion_tokens"))
    for value in given:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            limit = value
            break
    budget = (thinking or {}).get("budget_tokens")
    if isinstance(budget, int):
        limit = max(limit, budget + THINKING_HEADROOM)
    return limit


def _passthrough(params: Mapping[str, Any], thinking_on: bool) -> dict[str, Any]:
    out = {
        k: v for k, v in params.items() if k not in _OWNED_PARAMS and k not in _OPENAI_ONLY_PARAMS
    }
    stop = params.get("stop")
    if "stop_sequences" not in out and stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if "metadata" not in out and isinstance(params.get("user"), str) and params["user"]:
        out["metadata"] = {"user_id": params["user"]}
    if thinking_on:
        # The API rejects these sampling changes while thinking.
        if out.get("temperature") not in (None, 1, 1.0):
            del out["temperature"]
        out.pop("top_k", None)
        top_p = out.get("top_p")
        if isinstance(top_p, int | float) and top_p < 0.95:
            del out["top_p"]
    return out


def _wire_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    if "input_schema" in tool or tool.get("type") not in (None, "function"):
        return dict(tool)  # already an Anthropic tool, or a server tool
    fn: Mapping[str, Any] = tool["function"] if isinstance(tool.get("function"), Mapping) else tool
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ProviderRequestError("a tool has no name")
    out: dict[str, Any] = {"name": name}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["input_schema"] = fn.get("parameters") or default_parameters()
    return out


def _history_tools(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """No tools given but the history holds tool blocks (a 400 without tools) -> a stub per
    tool used."""
    names = dict.fromkeys(
        b["name"]
        for t in turns
        for b in t["content"]
        if b.get("type") == "tool_use" and isinstance(b.get("name"), str)
    )
    return [{"name": n, "input_schema": default_parameters()} for n in names]


def _tool_choice(request: ChatRequest, thinking: Mapping[str, Any] | None) -> dict[str, Any] | None:
    choice = request.tool_choice
    wire: dict[str, Any] | None
    if isinstance(choice, Mapping):
        name = choice.get("name")
        wire = {"type": "tool", "name": name} if isinstance(name, str) and name else None
    elif choice == "required":
        wire = {"type": "any"}
    elif choice in ("auto", "none"):
        wire = {"type": choice}
    else:
        wire = None
    if wire and wire["type"] in ("any", "tool") and (thinking or {}).get("type") == "enabled":
        wire = {"type": "auto"}  # thinking with a forced tool choice is a 400
    if request.parallel_tool_calls is False and (wire or {}).get("type") != "none":
        wire = {**(wire or {"type": "auto"}), "disable_parallel_tool_use": True}
    return wire


# Messages


def _convert(messages: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in ("system", "developer"):
            text = content_text(message.get("content"))
            if text.strip():
                system.append(text)
        elif role == "user":
            turns.append({"role": "user", "content": _user_blocks(message.get("content"))})
        elif role == "tool":
            turns.append({"role": "user", "content": [_tool_result(message)]})
        elif role == "assistant":
            turns.append({"role": "assistant", "content": _assistant_blocks(message)})
        else:
            raise ProviderRequestError(f"message {i} has unsupported role {str(role)[:20]!r}")
    return system, _normalise(turns)


def _normalise(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge same-role turns (tool results first), drop empty ones, start with user, no
    trailing whitespace on an assistant prefill: what the Messages API accepts."""
    merged: list[dict[str, Any]] = []
    for turn in turns:
        if not turn["content"]:
            continue
        if merged and merged[-1]["role"] == turn["role"]:
            merged[-1] = {"role": turn["role"], "content": merged[-1]["content"] + turn["content"]}
        else:
            merged.append(turn)
    for turn in merged:
        if turn["role"] == "user":
            turn["content"].sort(key=lambda b: b.get("type") != "tool_result")  # stable
    if merged and merged[-1]["role"] == "assistant":
        last = merged[-1]["content"]
        if last[-1].get("type") == "text":
            last[-1] = {**last[-1], "text": last[-1]["text"].rstrip()}
            if not last[-1]["text"]:
                last.pop()
        if not last:
            merged.pop()
    if not merged or merged[0]["role"] != "user":
        merged.insert(0, {"role": "user", "content": [_text_block(PLACEHOLDER_USER)]})
    return merged


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _user_blocks(content: Any) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        text = content_text(content)
        return [_text_block(text)] if text.strip() else []
    blocks: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = content_text([part])
            if text.strip():  # empty text blocks are rejected
                blocks.append(_text_block(text))
        elif isinstance(part, Mapping) and part.get("type") == "image_url":
            blocks.append(_image(part.get("image_url")))
        elif isinstance(part, Mapping):
            blocks.append(dict(part))  # an Anthropic block (image, document...) as given
    return blocks


def _image(image_url: Any) -> dict[str, Any]:
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    url = str(url or "")
    if url.startswith("data:") and ";base64," in url:
        media_type, data = url[5:].split(";base64,", 1)
        source = {"type": "base64", "media_type": media_type, "data": data}
    else:
        source = {"type": "url", "url": url}
    return {"type": "image", "source": source}


def _tool_result(message: Mapping[str, Any]) -> dict[str, Any]:
    """One `tool_result` per call (merged into one user turn); our error JSON
    `{"error": {...}}` sets `is_error`."""
    text = tool_result_text(message.get("content"))
    if not text.strip():
        text = NO_OUTPUT  # Anthropic rejects blank text too
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": wire_id(str(message.get("tool_call_id") or "")),
        "content": text,
    }
    if _is_error_json(text):
        block["is_error"] = True
    return block


def _is_error_json(text: str) -> bool:
    if not text.startswith("{"):
        return False
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and isinstance(value.get("error"), dict)


def _assistant_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The turn's own wire blocks verbatim when they match its tool calls (signed thinking
    must come back unchanged, or the API answers 400); else text + tool_use built from the
    canonical fields (reasoning text without a signature is dropped)."""
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
    uses = [_tool_use(c) for c in calls]
    blocks = own_replay(message, ANTHROPIC)
    if isinstance(blocks, list) and all(isinstance(b, Mapping) for b in blocks):
        replay = [_replay_block(b) for b in blocks]
        replay = [b for b in replay if b.get("type") != "text" or str(b.get("text")).strip()]
        if [b["id"] for b in replay if b.get("type") == "tool_use"] == [u["id"] for u in uses]:
            return replay
        thoughts = [b for b in replay if b.get("type") in _THINKING]
    else:
        thoughts = []
    text = content_text(message.get("content"))
    return thoughts + ([_text_block(text)] if text.strip() else []) + uses


def _replay_block(block: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(block))  # signatures and `data` untouched
    if out.get("type") == "tool_use":
        out["id"] = wire_id(str(out.get("id") or ""))
        if not isinstance(out.get("input"), dict):
            out["input"] = _input_object(out.get("input"))  # `input` must be an object
    return out


def _tool_use(call: Mapping[str, Any]) -> dict[str, Any]:
    fn: Mapping[str, Any] = call["function"] if isinstance(call.get("function"), Mapping) else {}
    return {
        "type": "tool_use",
        "id": wire_id(str(call.get("id") or "")),
        "name": str(fn.get("name") or ""),
        "input": replay_object(fn.get("arguments")),
    }


def _input_object(value: Any) -> dict[str, Any]:
    """A kept block's `input` -> the object it must be. A string is the arguments text the
    decoder kept (a stream cut inside its JSON); another value is JSON. See `replay_arguments`."""
    return replay_object(value if isinstance(value, str | Mapping) else arguments_text(value))


def _last_tool_turn_unsigned(turns: list[dict[str, Any]]) -> bool:
    assistants = [t["content"] for t in turns if t["role"] == "assistant"]
    if not assistants:
        return False
    last = assistants[-1]
    has_use = any(b.get("type") == "tool_use" for b in last)
    return has_use and last[0].get("type") not in _THINKING


def _without_thinking(turn: dict[str, Any]) -> dict[str, Any]:
    return {**turn, "content": [b for b in turn["content"] if b.get("type") not in _THINKING]}

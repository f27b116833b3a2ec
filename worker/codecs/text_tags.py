"""The `<tool_call>` text-tag protocol ("openai-text-tags"). Pure: no I/O.

For OpenAI-compatible servers without native tool calling: the chat-completions endpoint, no
`tools` field; a system prompt (Hermes/Qwen style) lists the tools and teaches the model to
answer with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and results
come back as `<tool_response>` blocks in a user turn (such servers have no `tool` role).

This module is the codec and writes the requests. Replies are read by `text_tags_parse`
(its docstring has the rules, shared by `decode` and the stream's `result()`); streamed
content is shown by `text_tags_stream`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from schemas.protocols import TEXT_TAGS
from schemas.spec_types import INVALID_CALL_NAME, default_parameters
from worker.codecs.openai_chat import content_text, normalize_completion, tool_result_text
from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.protocol import ChatRequest, ToolChoice, WireRequest, own_replay
from worker.codecs.text_tags_parse import (
    CALL_CLOSE,
    CALL_OPEN,
    FENCE,
    PROTOCOL,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    ParsedText,
    apply_text_tags,
    parse_block,
    parse_text,
)
from worker.codecs.text_tags_stream import TextTagAssembler, VisibleText

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "FENCE",
    "INVALID_CALL_NAME",
    "NO_CALLS_RULE",
    "PROTOCOL",
    "RESPONSE_CLOSE",
    "RESPONSE_OPEN",
    "THINK_CLOSE",
    "THINK_OPEN",
    "ParsedText",
    "TextTagAssembler",
    "TextTagCodec",
    "VisibleText",
    "apply_text_tags",
    "parse_block",
    "parse_text",
    "render_messages",
    "tool_prompt",
]


# ---------------------------------------------------------------------------------------------
# Requests


class TextTagCodec:
    protocol = PROTOCOL

    def __init__(self) -> None:
        self._openai = OpenAICodec(TEXT_TAGS)

    def encode(self, request: ChatRequest) -> WireRequest:
        """The OpenAI body with no `tools`: tools in the system prompt, calls and results as
        tags in content (stop sequences are left to the params)."""
        plain = replace(
            request,
            messages=render_messages(request),
            tools=[],
            tool_choice=None,
            parallel_tool_calls=None,
        )
        return self._openai.encode(plain)

    def decode(self, body: Any, request: ChatRequest) -> dict[str, Any]:
        return apply_text_tags(normalize_completion(body), _parses_calls(request))

    def assembler(self, request: ChatRequest) -> TextTagAssembler:
        return TextTagAssembler(_parses_calls(request))

    def retry_after_s(self, status: int, body: Any) -> float | None:
        return None


NO_CALLS_RULE = "Do not call any function now: answer in plain text."


def _parses_calls(request: ChatRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def tool_prompt(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool | None) -> str:
    """The system-prompt section that teaches the tags; the tool choice, which tags cannot
    enforce, becomes a rule in it ("may", "must", "only f", "one call per turn")."""
    lines = []
    for tool in tools:
        fn = tool.get("function") or tool
        entry: dict[str, Any] = {"name": fn.get("name")}
        if fn.get("description"):
            entry["description"] = fn["description"]
        entry["parameters"] = fn.get("parameters") or default_parameters()
        lines.append(json.dumps(entry, ensure_ascii=False))
    if parallel is False:
        several = "call at most one function per turn"
    else:
        several = "to call several functions at once, write several blocks"
    if choice == "required":
        rule = "You must call at least one function in this turn."
    elif isinstance(choice, dict) and choice.get("name"):
        rule = f'You must call the function "{choice["name"]}" in this turn, and no other.'
    else:
        rule = "Call a function only when it helps; otherwise answer directly."
    return "\n".join(
        [
            "# Tools",
            "",
            "You can call functions. They are listed inside <tools></tools>, one JSON object"
            " per line with the function's name, description and JSON schema of its arguments:",
            "<tools>",
            *lines,
            "</tools>",
            "",
            "To call a function, write its name and arguments as one JSON object inside"
            " <tool_call></tool_call> tags:",
            CALL_OPEN,
            '{"name": "<function-name>", "arguments": {<arguments as a JSON object>}}',
            CALL_CLOSE,
            f"Write one <tool_call> block per call; {several}. After your calls, stop and"
            " wait: each result comes back in a user message inside"
            " <tool_response></tool_response> tags. Never write <tool_response> yourself.",
            rule,
        ]
    )


def render_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The transcript without native tool fields: one merged system message first, assistant
    calls as `<tool_call>` blocks, tool results as `<tool_response>` blocks in one user turn
    per run of tool messages, in call order."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the responses
    responses: dict[str, Any] | None = None  # the user turn collecting consecutive results
    for message in request.messages:
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(content_text(message.get("content")))
            continue
        if role in ("tool", "function"):  # function: the legacy function_call's result role
            block = _response_block(message, names)
            if responses is None:
                responses = {"role": "user", "content": block}
                out.append(responses)
            else:
                responses["content"] += "\n" + block
            continue
        responses = None
        if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
            out.append(_assistant_with_calls(message, names))
        else:
            out.append(dict(message))
    if _parses_calls(request):
        system.append(tool_prompt(request.tools, request.tool_choice, request.parallel_tool_calls))
    elif request.tools and request.tool_choice == "none":
        system.append(NO_CALLS_RULE)  # the history may show calls: say that none are wanted now
    text = "\n\n".join(t for t in system if t)
    return [{"role": "system", "content": text}, *out] if text else out


def _assistant_with_calls(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    calls = message.get("tool_calls") or [{"function": message["function_call"]}]
    for call in calls:
        fn = call.get("function") or {}
        if isinstance(call.get("id"), str):
            names[call["id"]] = str(fn.get("name") or "")
    verbatim = own_replay(message, TEXT_TAGS)
    if isinstance(verbatim, str):
        content = verbatim  # the turn exactly as the model wrote it
    else:
        parts = [content_text(message.get("content"))] + [_call_block(c) for c in calls]
        content = "\n".join(p for p in parts if p)
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "function_call")}
    out["content"] = content
    return out


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            decoded = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            decoded = None
        args = decoded if isinstance(decoded, dict) else args
    elif args is None:
        args = {}
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _response_block(message: dict[str, Any], names: dict[str, str]) -> str:
    name = message.get("name") or names.get(str(message.get("tool_call_id")), "")
    text = tool_result_text(message.get("content"))
    body = json.dumps({"name": name, "content": text}, ensure_ascii=False)
    return f"{RESPONSE_OPEN}\n{body}\n{RESPONSE_CLOSE}"

"""Anthropic Messages codec: each case of docs/provider-conformance.md's Anthropic lists (requests,
replies, streams), its usage accounting, a cancelled turn's results, and the bugs users report
(arg-less streamed calls as `""`, thinking blocks lost with tool calls, tool input dropped by
streaming translators).

Replies and streams are built with the official `anthropic` SDK's types, so the payloads are
the real wire shapes; request bodies are checked against the SDK's request TypedDicts.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
from anthropic.types import (
    CitationsDelta,
    InputJSONDelta,
    Message,
    MessageDeltaUsage,
    MessageParam,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    RedactedThinkingBlock,
    ServerToolUseBlock,
    SignatureDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolChoiceParam,
    ToolParam,
    ToolUseBlock,
    Usage,
    WebSearchToolResultBlock,
)
from anthropic.types import message_create_params as sdk_params
from anthropic.types.raw_message_delta_event import Delta as MessageDelta

from schemas.spec_types import INVALID_CALL_NAME
from worker.codecs.anthropic import AnthropicCodec
from worker.codecs.anthropic_stream import wire_id
from worker.codecs.openai_chat import decode_arguments
from worker.codecs.protocol import ChatRequest, Codec, Delta, SseEvent
from worker.errors import (
    ProviderError,
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
)

CODEC = AnthropicCodec()
MODEL = "claude-sonnet-4-5"
ANTHROPIC_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
SIG_1 = "EqQBCkYIBxgCIkBmN2Y0ZTNhYS1zaWduZWQtdGhpbmtpbmctb25lEgxhYmNkZWZnaGlqa2wY"
SIG_2 = "ErUBCkYIBxgCIkCzZWNvbmQtc2lnbmVkLXRoaW5raW5nLWJsb2NrLWZvci1yb3VuZC10d28Y"
REDACTED = "EmwKAhgBEgy3va3pzbFd8o0ziNMaDPRlZ3VsYXItcmVkYWN0ZWQtZGF0YQ=="
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


# ---------------------------------------------------------------------------------------------
# Helpers


def req(messages: list[dict[str, Any]], **kw: Any) -> ChatRequest:
    kw.setdefault("tools", [WEATHER, TIME])
    return ChatRequest(model=MODEL, messages=messages, **kw)


def body_of(request: ChatRequest) -> dict[str, Any]:
    wire = CODEC.encode(request)
    assert wire.path == "/messages"
    assert wire.headers == {"anthropic-version": "2023-06-01"}
    return wire.body


def message(
    blocks: list[Any],
    stop_reason: str = "end_turn",
    usage: Usage | None = None,
    msg_id: str = "msg_01XFDUDYJgAACzvnptvVoYEL",
) -> Message:
    return Message(
        id=msg_id,
        type="message",
        role="assistant",
        model=MODEL,
        content=blocks,
        stop_reason=stop_reason,  # type: ignore[arg-type]
        stop_sequence=None,
        usage=usage or Usage(input_tokens=472, output_tokens=89),
    )


def wire(msg: Message) -> dict[str, Any]:
    """The message as the API sends it (fields it did not set are absent)."""
    return msg.to_dict(mode="json")


def decoded(msg: Message, request: ChatRequest | None = None) -> dict[str, Any]:
    return CODEC.decode(wire(msg), request or req([{"role": "user", "content": "hi"}]))


def text(value: str) -> TextBlock:
    return TextBlock(type="text", text=value)


def tool_use(call_id: str, name: str, arguments: dict[str, Any]) -> ToolUseBlock:
    return ToolUseBlock(type="tool_use", id=call_id, name=name, input=arguments)


def thinking(thought: str, signature: str) -> ThinkingBlock:
    return ThinkingBlock(type="thinking", thinking=thought, signature=signature)


def pieces(value: str, n: int) -> list[str]:
    if n <= 0 or not value:
        return []
    size = max(1, -(-len(value) // n))
    out = [value[i : i + size] for i in range(0, len(value), size)]
    return out + [""] * (n - len(out))


def block_events(index: int, block: Any, n: int) -> tuple[Any, list[Any]]:
    """The content_block_start and the deltas that stream `block` in about `n` fragments."""

    def delta(d: Any) -> RawContentBlockDeltaEvent:
        return RawContentBlockDeltaEvent(type="content_block_delta", index=index, delta=d)

    deltas: list[Any] = []
    if isinstance(block, TextBlock):
        start: Any = TextBlock(type="text", text="")
        deltas = [delta(TextDelta(type="text_delta", text=p)) for p in pieces(block.text, n) if p]
    elif isinstance(block, ThinkingBlock):
        start = ThinkingBlock.model_construct(type="thinking", thinking="")
        deltas = [
            delta(ThinkingDelta(type="thinking_delta", thinking=p))
            for p in pieces(block.thinking, n)
            if p
        ]
        deltas.append(delta(SignatureDelta(type="signature_delta", signature=block.signature)))
    elif isinstance(block, ToolUseBlock | ServerToolUseBlock):
        start = block.model_copy(update={"input": {}})
        raw = json.dumps(block.input) if block.input else ""
        deltas = [
            delta(InputJSONDelta(type="input_json_delta", partial_json=p))
            for p in ["", *pieces(raw, n - 1)]  # the first fragment is often ""
        ]
    else:
        start = block  # redacted_thinking, server tool results: whole in the start event
    return RawContentBlockStartEvent(
        type="content_block_start", index=index, content_block=start
    ), deltas


def stream_events(
    msg: Message, n: int = 3, interleave: bool = False, extra: list[Any] | None = None
) -> list[Any]:
    """The SDK event objects the API sends for `msg`."""
    events: list[Any] = [
        RawMessageStartEvent(
            type="message_start",
            message=msg.model_copy(
                update={
                    "content": [],
                    "stop_reason": None,
                    "usage": msg.usage.model_copy(update={"output_tokens": 1}),
                }
            ),
        )
    ]
    parts = [block_events(i, b, n) for i, b in enumerate(msg.content)]
    stops = [
        RawContentBlockStopEvent(type="content_block_stop", index=i) for i in range(len(parts))
    ]
    if interleave:
        events += [start for start, _ in parts]
        for row in range(max((len(d) for _, d in parts), default=0)):
            events += [d[row] for _, d in parts if row < len(d)]
        events += stops
    else:
        for (start, deltas), stop in zip(parts, stops, strict=True):
            events += [start, *deltas, stop]
    events += extra or []
    events.append(
        RawMessageDeltaEvent(
            type="message_delta",
            delta=MessageDelta(stop_reason=msg.stop_reason, stop_sequence=None),
            usage=MessageDeltaUsage(output_tokens=msg.usage.output_tokens),
        )
    )
    events.append(RawMessageStopEvent(type="message_stop"))
    return events


def sse(events: list[Any]) -> list[SseEvent]:
    return [SseEvent(event=e.type, data=e.to_json(indent=None)) for e in events]


def assemble(
    events: list[SseEvent], request: ChatRequest | None = None
) -> tuple[dict[str, Any], list[Delta]]:
    assembler = CODEC.assembler(request or req([{"role": "user", "content": "hi"}]))
    shown: list[Delta] = []
    for event in events:
        shown += assembler.feed(event)
    assert assembler.finished
    return assembler.result(), shown


def streamed(msg: Message, request: ChatRequest | None = None, **kw: Any) -> dict[str, Any]:
    """The streamed round's result, asserted equal to the non-streamed one (C21)."""
    result, _ = assemble(sse(stream_events(msg, **kw)), request)
    assert result == decoded(msg, request)
    return result


def only(completion: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = completion["choices"][0]
    return choice


def _force(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        return _force(value.model_dump(exclude_unset=True))
    if isinstance(value, dict):
        return {k: _force(v) for k, v in value.items()}
    if isinstance(value, list | tuple | Iterator):
        return [_force(v) for v in value]
    return value


def sdk_validate(body: dict[str, Any]) -> None:
    """The body's keys are MessageCreateParams keys, and every message, tool and tool_choice
    validates against the SDK's TypedDicts without losing a field."""
    allowed = (
        sdk_params.MessageCreateParamsStreaming.__required_keys__
        | sdk_params.MessageCreateParamsStreaming.__optional_keys__
    )
    assert set(body) <= allowed, set(body) - allowed
    assert {"model", "max_tokens", "messages"} <= set(body)
    for adapter, values in (
        (pydantic.TypeAdapter(MessageParam), body["messages"]),
        (pydantic.TypeAdapter(ToolParam), body.get("tools", [])),
        (
            pydantic.TypeAdapter(ToolChoiceParam),
            [body["tool_choice"]] if "tool_choice" in body else [],
        ),
    ):
        for value in values:
            assert _force(adapter.validate_python(value)) == value


def tool_msg(call_id: str, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def call(call_id: str, name: str = "get_weather", arguments: Any = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def calling(*calls: dict[str, Any], content: Any = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def assistant_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return calling(call(call_id, name, arguments))


# ---------------------------------------------------------------------------------------------
# The contract


def test_codec_satisfies_the_protocol() -> None:
    codec: Codec = CODEC
    assert codec.protocol == "anthropic"
    assert (
        codec.retry_after_s(529, {"type": "error", "error": {"type": "overloaded_error"}}) is None
    )
    body = body_of(req([{"role": "user", "content": "hi"}], stream=True))
    assert body["stream"] is True and body["model"] == MODEL
    sdk_validate(body)


def test_tool_choice_table() -> None:
    """Section A's table: auto/none/required/specific, and no-parallel inside tool_choice."""
    hi = [{"role": "user", "content": "weather in Paris?"}]
    cases: list[tuple[Any, bool | None, Any]] = [
        (None, None, None),
        ("auto", None, {"type": "auto"}),
        ("none", None, {"type": "none"}),
        ("required", None, {"type": "any"}),
        ({"name": "get_weather"}, None, {"type": "tool", "name": "get_weather"}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
        ("auto", True, {"type": "auto"}),
    ]
    for choice, parallel, expected in cases:
        body = body_of(req(hi, tool_choice=choice, parallel_tool_calls=parallel))
        assert body.get("tool_choice") == expected, (choice, parallel)
        assert [t["name"] for t in body["tools"]] == ["get_weather", "get_time"]
        sdk_validate(body)
    assert body["tools"][0] == {
        "name": "get_weather",
        "description": "Current weather for a city",
        "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
    }
    no_tools = body_of(req(hi, tools=[], tool_choice="required", parallel_tool_calls=False))
    assert "tools" not in no_tools and "tool_choice" not in no_tools


def test_params_pass_through_or_translate() -> None:
    params = {
        "max_completion_tokens": 900,
        "temperature": 0.2,
        "stop": "END",
        "metadata": {"user_id": "u-1"},
        "response_format": {"type": "json_object"},
        "n": 1,
        "seed": 7,
        "top_k": 5,
    }
    body = body_of(req([{"role": "user", "content": "hi"}], params=params))
    assert body["max_tokens"] == 900
    assert body["temperature"] == 0.2 and body["top_k"] == 5
    assert body["stop_sequences"] == ["END"]
    assert body["metadata"] == {"user_id": "u-1"}
    for dropped in ("max_completion_tokens", "stop", "response_format", "n", "seed"):
        assert dropped not in body
    assert body_of(req([{"role": "user", "content": "x"}], params={"user": "u-2"}))["metadata"] == {
        "user_id": "u-2"
    }


# ---------------------------------------------------------------------------------------------
# Anthropic Messages requests and replies


def test_system_messages_become_top_level_system() -> None:
    body = body_of(
        req(
            [
                {"role": "system", "content": "You are terse."},
                {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "developer", "content": "Use metric units."},
            ]
        )
    )
    assert body["system"] == "You are terse.\n\nAnswer in French.\n\nUse metric units."
    assert [m["role"] for m in body["messages"]] == ["user"]
    sdk_validate(body)


def test_tool_tool_user_merge_into_one_user_turn() -> None:
    body = body_of(
        req(
            [
                {"role": "user", "content": "Paris and Rome?"},
                calling(
                    call("toolu_01A", arguments='{"city":"Paris"}'),
                    call("toolu_01B", arguments='{"city":"Rome"}'),
                    content="Checking both.",
                ),
                tool_msg("toolu_01A", "18C cloudy"),
                tool_msg("toolu_01B", "24C sunny"),
                {"role": "user", "content": "Also, which is warmer?"},
                {"role": "assistant", "content": "Rome is warmer"},
                {"role": "assistant", "content": " by 6 degrees."},
            ]
        )
    )
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    merged = body["messages"][2]["content"]
    assert [b["type"] for b in merged] == ["tool_result", "tool_result", "text"]
    assert [b.get("tool_use_id") for b in merged[:2]] == ["toolu_01A", "toolu_01B"]
    assert merged[2]["text"] == "Also, which is warmer?"
    assert body["messages"][1]["content"] == [
        {"type": "text", "text": "Checking both."},
        {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_01B", "name": "get_weather", "input": {"city": "Rome"}},
    ]
    assert [b["text"] for b in body["messages"][3]["content"]] == [
        "Rome is warmer",
        " by 6 degrees.",
    ]
    sdk_validate(body)


def test_history_shape_and_max_tokens() -> None:
    body = body_of(
        req(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": ""},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": ""}, {"type": "text", "text": "Hi"}],
                },
                {"role": "assistant", "content": "The answer is:  \n"},
            ]
        )
    )
    messages = body["messages"]
    assert messages[0] == {"role": "user", "content": [{"type": "text", "text": "."}]}
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == [{"type": "text", "text": "Hi"}]
    assert messages[3]["content"] == [{"type": "text", "text": "The answer is:"}]  # prefill
    assert all(b.get("text") != "" for m in messages for b in m["content"])
    assert body["max_tokens"] == 4096
    sdk_validate(body)
    only_system = body_of(req([{"role": "system", "content": "x"}]))
    assert only_system["messages"] == [{"role": "user", "content": [{"type": "text", "text": "."}]}]
    hi = [{"role": "user", "content": "hi"}]
    assert body_of(req(hi, max_tokens=300))["max_tokens"] == 300
    assert body_of(req(hi, params={"max_tokens": 500}))["max_tokens"] == 500
    thought = body_of(req(hi, max_tokens=2000, thinking_budget_tokens=4000))
    assert thought["thinking"] == {"type": "enabled", "budget_tokens": 4000}
    assert thought["max_tokens"] == 5024 > thought["thinking"]["budget_tokens"]
    assert body_of(req(hi, thinking_budget_tokens=100))["thinking"]["budget_tokens"] == 1024


def test_several_tool_uses_answered_in_one_user_turn() -> None:
    msg = message(
        [
            text("I'll check both cities."),
            tool_use("toolu_01Paris", "get_weather", {"city": "Paris"}),
            tool_use("toolu_01Rome", "get_weather", {"city": "Rome", "unit": "C"}),
        ],
        stop_reason="tool_use",
    )
    request = req([{"role": "user", "content": "Paris and Rome?"}])
    for reply in (decoded(msg, request), streamed(msg, request)):
        choice = only(reply)
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert [c["id"] for c in calls] == ["toolu_01Paris", "toolu_01Rome"]
        assert [c["function"]["arguments"] for c in calls] == [
            '{"city":"Paris"}',
            '{"city":"Rome","unit":"C"}',
        ]
        assert choice["message"]["content"] == "I'll check both cities."
    history = [
        {"role": "user", "content": "Paris and Rome?"},
        {k: v for k, v in choice["message"].items() if k != "role"} | {"role": "assistant"},
        tool_msg("toolu_01Paris", "18C cloudy"),
        tool_msg("toolu_01Rome", "24C sunny"),
    ]
    body = body_of(req(history))
    assert len(body["messages"]) == 3
    results = body["messages"][2]["content"]
    assert [(b["type"], b["tool_use_id"]) for b in results] == [
        ("tool_result", "toolu_01Paris"),
        ("tool_result", "toolu_01Rome"),
    ]
    uses = [b["id"] for b in body["messages"][1]["content"] if b["type"] == "tool_use"]
    assert uses == [b["tool_use_id"] for b in results]
    sdk_validate(body)


def test_error_results_set_is_error() -> None:
    error = json.dumps({"error": {"code": "tool_exec_failed", "message": "timeout after 10s"}})
    body = body_of(
        req(
            [
                {"role": "user", "content": "go"},
                calling(*(call(f"toolu_{i}") for i in range(4))),
                tool_msg("toolu_0", error),
                tool_msg("toolu_1", "plain text that mentions error"),
                tool_msg("toolu_2", {"temp": 18}),
                tool_msg("toolu_3", '{"error": "a tool payload, not our error body"}'),
            ]
        )
    )
    results = body["messages"][2]["content"]
    assert results[0] == {
        "type": "tool_result",
        "tool_use_id": "toolu_0",
        "content": error,
        "is_error": True,
    }
    assert [r.get("is_error") for r in results[1:]] == [None, None, None]
    assert results[2]["content"] == '{"temp":18}'
    sdk_validate(body)


def test_input_is_an_object() -> None:
    cases = [
        ('{"city":"Paris"}', {"city": "Paris"}),
        ("", {}),
        ("null", {}),
        ('"{\\"city\\":\\"Rome\\"}"', {"city": "Rome"}),  # double-encoded
        ('{"city": "Pa', {"city": "Pa"}),  # truncated: the cheap repair closes it
        ("{not json", {"_raw_arguments": "{not json"}),  # never read: the text, in an object
        ('["Paris"]', {"_raw_arguments": '["Paris"]'}),
        ({"city": "Oslo"}, {"city": "Oslo"}),  # already an object
    ]
    for arguments, expected in cases:
        body = body_of(
            req(
                [
                    {"role": "user", "content": "go"},
                    assistant_call("toolu_1", "get_weather", arguments),
                    tool_msg("toolu_1", "done"),
                ]
            )
        )
        use = body["messages"][1]["content"][0]
        assert use["input"] == expected, arguments
        sdk_validate(body)


def test_foreign_ids_are_sanitised_consistently_and_mapped_back() -> None:
    foreign = ["functions.get_weather:0", "call_x__thought__Zm9v=", "functions.get_weather:1"]
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    history.append(calling(*(call(i) for i in foreign)))
    history += [tool_msg(i, "ok") for i in foreign]
    request = req(history)
    body = body_of(request)
    uses = [b["id"] for b in body["messages"][1]["content"]]
    results = [b["tool_use_id"] for b in body["messages"][2]["content"]]
    assert uses == results
    assert all(ANTHROPIC_ID.match(i) for i in uses)
    assert len(set(uses)) == 3
    assert uses == [wire_id(i) for i in foreign] and body == body_of(request)  # deterministic
    assert wire_id("toolu_01A") == "toolu_01A"
    # A reply that uses a sanitised id of the request gets the canonical id back.
    msg = message([tool_use(uses[1], "get_weather", {"city": "Paris"})], stop_reason="tool_use")
    for reply in (decoded(msg, request), streamed(msg, request)):
        got = only(reply)["message"]["tool_calls"][0]
        assert got["id"] == "call_x__thought__Zm9v="
        replayed = only(reply)["message"]["_provider"]["anthropic"]["content"][0]
        assert replayed["id"] == uses[1]  # the verbatim block keeps the wire id
    sdk_validate(body)


def test_tools_stay_on_every_request_with_tool_history() -> None:
    history = [
        {"role": "user", "content": "go"},
        assistant_call("toolu_1", "get_weather", '{"city":"Paris"}'),
        tool_msg("toolu_1", "18C"),
    ]
    body = body_of(req(history, tool_choice="none"))
    assert [t["name"] for t in body["tools"]] == ["get_weather", "get_time"]
    assert body["tool_choice"] == {"type": "none"}
    stubbed = body_of(req(history, tools=[]))
    assert stubbed["tools"] == [
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
    ]
    assert stubbed["tool_choice"] == {"type": "none"}
    sdk_validate(body)
    sdk_validate(stubbed)


def test_thinking_blocks_are_echoed_verbatim() -> None:
    blocks = [
        thinking("The user wants Paris weather; call the tool.", SIG_1),
        RedactedThinkingBlock(type="redacted_thinking", data=REDACTED),
        tool_use("toolu_01T", "get_weather", {"city": "Paris"}),
    ]
    msg = message(blocks, stop_reason="tool_use")
    request = req([{"role": "user", "content": "Paris?"}], thinking_budget_tokens=2048)
    for reply in (decoded(msg, request), streamed(msg, request)):
        out = only(reply)["message"]
        assert out["reasoning_content"] == "The user wants Paris weather; call the tool."
        assert out["content"] is None
        assert out["_provider"] == {"anthropic": {"content": wire(msg)["content"]}}
    history = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", **{k: v for k, v in out.items() if k != "role"}},
        tool_msg("toolu_01T", "18C"),
    ]
    body = body_of(req(history, thinking_budget_tokens=2048))
    assert body["messages"][1]["content"] == wire(msg)["content"]
    stored = out["_provider"]["anthropic"]["content"]
    assert json.dumps(body["messages"][1]["content"]) == json.dumps(stored)  # byte-identical
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    sdk_validate(body)
    # Thinking off for this request: no thinking blocks are sent.
    off = body_of(req(history))
    assert [b["type"] for b in off["messages"][1]["content"]] == ["tool_use"]
    assert "thinking" not in off
    # Thinking on, but the open tool turn came from elsewhere (no signature): thinking is
    # dropped rather than sending a request the API rejects.
    unsigned = [
        {"role": "user", "content": "Paris?"},
        {
            **assistant_call("call_abc", "get_weather", '{"city":"Paris"}'),
            "reasoning_content": "hm",
        },
        tool_msg("call_abc", "18C"),
    ]
    dropped = body_of(req(unsigned, thinking_budget_tokens=2048))
    assert "thinking" not in dropped
    assert [b["type"] for b in dropped["messages"][1]["content"]] == ["tool_use"]


def test_thinking_with_forced_choice_falls_back_to_auto() -> None:
    hi = [{"role": "user", "content": "weather?"}]
    for choice in ("required", {"name": "get_weather"}):
        body = body_of(req(hi, tool_choice=choice, thinking_budget_tokens=2048))
        assert body["tool_choice"] == {"type": "auto"}
        sdk_validate(body)
    body = body_of(
        req(hi, tool_choice="required", thinking_budget_tokens=2048, parallel_tool_calls=False)
    )
    assert body["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    assert body_of(req(hi, tool_choice="none", thinking_budget_tokens=2048))["tool_choice"] == {
        "type": "none"
    }


@pytest.mark.parametrize(
    ("stop_reason", "finish", "with_call"),
    [
        ("end_turn", "stop", False),
        ("stop_sequence", "stop", False),
        ("tool_use", "tool_calls", True),
        ("end_turn", "tool_calls", True),  # calls present decide
        ("max_tokens", "length", False),
        ("max_tokens", "length", True),  # a cut tool_use must not run
        ("refusal", "content_filter", False),
        ("pause_turn", "length", False),
        ("model_context_window_exceeded", "length", False),
    ],
)
def test_stop_reasons(stop_reason: str, finish: str, with_call: bool) -> None:
    blocks: list[Any] = [text("Partial answer")]
    if with_call:
        blocks.append(tool_use("toolu_9", "get_weather", {"city": "Paris"}))
    msg = message(blocks, stop_reason=stop_reason)
    for reply in (decoded(msg), streamed(msg)):
        assert only(reply)["finish_reason"] == finish


# ---------------------------------------------------------------------------------------------
# Anthropic streaming


def test_tool_block_start_is_not_seeded() -> None:
    msg = message(
        [
            tool_use("toolu_1", "list_files", {}),
            tool_use("toolu_2", "get_weather", {"city": "Oslo"}),
        ],
        stop_reason="tool_use",
    )
    events = stream_events(msg, n=4)
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.input == {}
    reply = streamed(msg, n=4)
    calls = only(reply)["message"]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"city":"Oslo"}']
    assert decode_arguments(calls[0]["function"]["arguments"]) == {}


def test_c1_argless_stream_tool_gets_empty_object() -> None:
    """litellm #5063: an arg-less streamed tool surfaced as `""`."""
    msg = message([tool_use("toolu_x", "list_files", {})], stop_reason="tool_use")
    events = stream_events(msg, n=1)
    assert [e.delta.partial_json for e in events if e.type == "content_block_delta"] == [""]
    reply = streamed(msg, n=1)
    assert only(reply)["message"]["tool_calls"][0]["function"]["arguments"] == "{}"
    replay = only(reply)["message"]["_provider"]["anthropic"]["content"][0]
    assert replay["input"] == {}


def test_deltas_are_routed_by_block_index() -> None:
    msg = message(
        [
            text("Looking up both."),
            tool_use("toolu_A", "get_weather", {"city": "Paris", "unit": "C"}),
            tool_use("toolu_B", "get_time", {"tz": "Europe/Rome"}),
        ],
        stop_reason="tool_use",
    )
    events = stream_events(msg, n=5, interleave=True)
    json_deltas = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert [e.index for e in json_deltas[:2]] == [1, 2] and json_deltas[0].delta.partial_json == ""
    reply, shown = assemble(sse(events))
    assert reply == decoded(msg)
    calls = only(reply)["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"]) for c in calls] == [
        ("toolu_A", "get_weather"),
        ("toolu_B", "get_time"),
    ]
    assert "".join(d.text for d in shown if d.kind == "content") == "Looking up both."


def test_interleaved_tool_json_in_20_fragments_equals_the_json_reply() -> None:
    args_a = {"city": "São Paulo", "unit": "C", "note": "mkdir -p a/{b,c}"}
    args_b = {"tz": "America/Sao_Paulo"}
    msg = message(
        [tool_use("toolu_A", "get_weather", args_a), tool_use("toolu_B", "get_time", args_b)],
        stop_reason="tool_use",
    )
    events = stream_events(msg, n=10, interleave=True)
    fragments = [e for e in events if e.type == "content_block_delta"]
    assert len(fragments) == 20
    assert [e.index for e in fragments[:4]] == [0, 1, 0, 1]
    reply, _ = assemble(sse(events))
    assert reply == decoded(msg)
    calls = only(reply)["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [args_a, args_b]


def test_thinking_stream_keeps_blocks_in_order() -> None:
    msg = message(
        [
            thinking("Step 1: need weather. Step 2: call the tool.", SIG_1),
            RedactedThinkingBlock(type="redacted_thinking", data=REDACTED),
            text("Let me check."),
            tool_use("toolu_W", "get_weather", {"city": "Paris"}),
        ],
        stop_reason="tool_use",
    )
    events = stream_events(msg, n=4)
    kinds = [e.delta.type if e.type == "content_block_delta" else e.type for e in events]
    assert kinds[kinds.index("signature_delta") + 1] == "content_block_stop"
    reply, shown = assemble(sse(events))
    assert reply == decoded(msg)
    out = only(reply)["message"]
    assert out["reasoning_content"] == "Step 1: need weather. Step 2: call the tool."
    assert "".join(d.text for d in shown if d.kind == "reasoning") == out["reasoning_content"]
    blocks = out["_provider"]["anthropic"]["content"]
    assert [b["type"] for b in blocks] == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert blocks[0]["signature"] == SIG_1 and blocks[1]["data"] == REDACTED


def test_message_delta_gives_stop_reason_and_cumulative_usage() -> None:
    msg = message(
        [tool_use("toolu_1", "get_weather", {"city": "Paris"})],
        stop_reason="tool_use",
        usage=Usage(input_tokens=472, output_tokens=87),
    )
    events = stream_events(msg)
    early = RawMessageDeltaEvent(
        type="message_delta",
        delta=MessageDelta(stop_reason=None, stop_sequence=None),
        usage=MessageDeltaUsage(output_tokens=40),
    )
    events.insert(-2, early)  # two cumulative counts: the last one wins, nothing is added
    reply, _ = assemble(sse(events))
    assert only(reply)["finish_reason"] == "tool_calls"
    assert reply["usage"]["completion_tokens"] == 87
    assert reply["usage"]["prompt_tokens"] == 472
    assert reply == decoded(msg)


def test_ping_is_ignored_and_error_events_raise() -> None:
    msg = message([text("Hello")])
    events = sse(stream_events(msg))
    with_pings = [
        events[0],
        SseEvent("ping", '{"type": "ping"}'),
        SseEvent("ping", ""),
        *events[1:],
    ]
    reply, _ = assemble(with_pings)
    assert reply == decoded(msg)

    overloaded = SseEvent(
        "error", '{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'
    )
    assembler = CODEC.assembler(req([{"role": "user", "content": "hi"}]))
    assembler.feed(events[0])
    with pytest.raises(ProviderRetryableError) as retry:
        assembler.feed(overloaded)
    assert "overloaded_error" in str(retry.value)

    secret = "the user's secret prompt"
    invalid = SseEvent(
        "error",
        json.dumps(
            {"type": "error", "error": {"type": "invalid_request_error", "message": secret}}
        ),
    )
    with pytest.raises(ProviderRequestError) as bad:
        CODEC.assembler(req([])).feed(invalid)
    assert secret not in str(bad.value)
    future = SseEvent("error", '{"type":"error","error":{"type":"brand_new_error"}}')
    with pytest.raises(ProviderError) as other:
        CODEC.assembler(req([])).feed(future)
    assert type(other.value) is ProviderError


def test_unknown_events_deltas_and_blocks_are_ignored_but_kept() -> None:
    server_use = ServerToolUseBlock(
        type="server_tool_use", id="srvtoolu_1", name="web_search", input={"query": "Paris weather"}
    )
    search = WebSearchToolResultBlock.model_validate(
        {
            "type": "web_search_tool_result",
            "tool_use_id": "srvtoolu_1",
            "content": [
                {
                    "type": "web_search_result",
                    "title": "Paris",
                    "url": "https://example.com/paris",
                    "encrypted_content": "EqgfCioIARgBIiQ3",
                    "page_age": None,
                }
            ],
        }
    )
    msg = message([server_use, search, text("It is 18C in Paris.")])
    citation = RawContentBlockDeltaEvent(
        type="content_block_delta",
        index=2,
        delta=CitationsDelta.model_validate(
            {
                "type": "citations_delta",
                "citation": {
                    "type": "web_search_result_location",
                    "cited_text": "18C",
                    "url": "https://example.com/paris",
                    "title": "Paris",
                    "encrypted_index": "Eo8BCioIAhgB",
                },
            }
        ),
    )
    events = sse(stream_events(msg))
    stop_of_text = max(i for i, e in enumerate(events) if e.event == "content_block_stop")
    events.insert(stop_of_text, sse([citation])[0])
    events.insert(1, SseEvent("future_event", '{"type":"future_event","x":1}'))
    future_delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "future_delta"}}
    events.insert(3, SseEvent("content_block_delta", json.dumps(future_delta)))
    reply, _ = assemble(events)
    out = only(reply)["message"]
    assert out["content"] == "It is 18C in Paris."
    assert "tool_calls" not in out and only(reply)["finish_reason"] == "stop"
    kept = out["_provider"]["anthropic"]["content"]
    assert [b["type"] for b in kept] == ["server_tool_use", "web_search_tool_result", "text"]
    assert kept[0]["input"] == {"query": "Paris weather"}
    assert kept[2]["citations"][0]["cited_text"] == "18C"
    json_out = only(decoded(msg))["message"]
    assert json_out["_provider"]["anthropic"]["content"] == wire(msg)["content"]


def test_truncated_streams_raise_protocol_errors() -> None:
    msg = message([tool_use("toolu_1", "get_weather", {"city": "Paris"})], stop_reason="tool_use")
    events = sse(stream_events(msg))
    for cut in (len(events) - 1, len(events) - 3, 1):
        assembler = CODEC.assembler(req([]))
        for event in events[:cut]:
            assembler.feed(event)
        assert not assembler.finished
        with pytest.raises(ProviderProtocolError):
            assembler.result()
    no_reason = [e for e in events if e.event != "message_delta"]
    assembler = CODEC.assembler(req([]))
    for event in no_reason:
        assembler.feed(event)
    with pytest.raises(ProviderProtocolError):
        assembler.result()
    with pytest.raises(ProviderProtocolError):
        CODEC.assembler(req([])).feed(events[1])  # a block before message_start
    with pytest.raises(ProviderProtocolError):
        CODEC.assembler(req([])).feed(SseEvent("message_start", "not json"))


def test_stream_cut_inside_tool_json_keeps_raw_arguments() -> None:
    msg = message([tool_use("toolu_1", "write_file", {"path": "/tmp/a"})], stop_reason="max_tokens")
    events = stream_events(msg, n=3)
    for e in events:
        if e.type == "content_block_delta":
            e.delta.partial_json = e.delta.partial_json.replace("}", "")
    reply, _ = assemble(sse(events))
    assert only(reply)["finish_reason"] == "length"
    assert only(reply)["message"]["tool_calls"][0]["function"]["arguments"] == '{"path": "/tmp/a"'
    # The replayed block still carries an object, as the API requires.
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", **{k: v for k, v in only(reply)["message"].items() if k != "role"}},
        tool_msg("toolu_1", '{"error":{"code":"invalid_arguments","message":"truncated"}}'),
    ]
    body = body_of(req(history))
    assert body["messages"][1]["content"][0]["input"] == {"path": "/tmp/a"}
    sdk_validate(body)


def test_assembler_agrees_with_the_sdk_accumulator() -> None:
    streaming = pytest.importorskip("anthropic.lib.streaming._messages")
    msg = message(
        [
            thinking("Think first.", SIG_1),
            text("Checking."),
            tool_use("toolu_S", "get_weather", {"city": "Lima", "unit": "C"}),
        ],
        stop_reason="tool_use",
    )
    events = stream_events(msg, n=6)
    snapshot: Any = None
    kwargs: dict[str, Any] = {}
    if "json_bufs" in inspect.signature(streaming.accumulate_event).parameters:
        kwargs["json_bufs"] = {}
    for event in events:
        snapshot = streaming.accumulate_event(event=event, current_snapshot=snapshot, **kwargs)
    mine, _ = assemble(sse(events))
    assert mine == CODEC.decode(snapshot.to_dict(mode="json"), req([]))


# ---------------------------------------------------------------------------------------------
# Round trips


def test_two_tool_rounds_with_thinking_replay_signed_blocks_byte_identical() -> None:
    """C2/C3 (litellm #8961, agents #1704): signed thinking goes back untouched every round."""
    tools = [WEATHER, TIME]
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather and time in Paris?"},
    ]
    round_1 = message(
        [
            thinking("I need the weather first.", SIG_1),
            tool_use("toolu_R1", "get_weather", {"city": "Paris"}),
        ],
        stop_reason="tool_use",
        msg_id="msg_round1",
    )
    round_2 = message(
        [
            thinking("Now the time.", SIG_2),
            RedactedThinkingBlock(type="redacted_thinking", data=REDACTED),
            text("Weather done; checking the time."),
            tool_use("toolu_R2", "get_time", {"tz": "Europe/Paris"}),
        ],
        stop_reason="tool_use",
        msg_id="msg_round2",
    )
    sent: list[dict[str, Any]] = []
    for n, (reply_msg, result) in enumerate(((round_1, "18C cloudy"), (round_2, "14:05"))):
        request = ChatRequest(
            model=MODEL, messages=list(history), tools=tools, thinking_budget_tokens=4096,
            stream=n == 1,
        )  # fmt: skip
        sent.append(body_of(request))
        reply = (
            streamed(reply_msg, request)
            if request.stream
            else CODEC.decode(wire(reply_msg), request)
        )
        out = only(reply)["message"]
        history.append({"role": "assistant", **{k: v for k, v in out.items() if k != "role"}})
        history.append(tool_msg(out["tool_calls"][0]["id"], result))
    final = body_of(
        ChatRequest(model=MODEL, messages=history, tools=tools, thinking_budget_tokens=4096)
    )
    sdk_validate(final)
    assistants = [m for m in final["messages"] if m["role"] == "assistant"]
    stored = [m["_provider"]["anthropic"]["content"] for m in history if m["role"] == "assistant"]
    for sent_turn, kept, msg in zip(assistants, stored, (round_1, round_2), strict=True):
        assert json.dumps(sent_turn["content"]) == json.dumps(kept)  # byte-identical
        assert json.dumps(sent_turn["content"], sort_keys=True) == json.dumps(
            wire(msg)["content"], sort_keys=True
        )
    assert [m["role"] for m in final["messages"]] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert final["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_R1", "content": "18C cloudy"}
    ]
    # The earlier request's replay is a prefix of the later one.
    assert sent[1]["messages"] == final["messages"][:3]


def test_decode_reads_sdk_model_dump_and_rejects_non_messages() -> None:
    msg = message(
        [thinking("Hmm.", SIG_1), text("Hi "), text("there."), tool_use("toolu_D", "get_time", {})],
        stop_reason="tool_use",
        usage=Usage(input_tokens=10, output_tokens=20),
    )
    reply = CODEC.decode(msg.model_dump(), req([]))
    assert reply["id"] == "msg_01XFDUDYJgAACzvnptvVoYEL"
    assert (
        reply["object"] == "chat.completion" and reply["created"] == 0 and reply["model"] == MODEL
    )
    out = only(reply)["message"]
    assert out["content"] == "Hi there."
    assert out["tool_calls"] == [
        {"id": "toolu_D", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    ]
    assert out["_provider"]["anthropic"]["content"] == msg.model_dump()["content"]
    plain = only(decoded(message([text("Just text.")])))["message"]
    assert plain == {"role": "assistant", "content": "Just text."}  # nothing to replay

    secret = "my secret prompt text"
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": secret}}
    bad: Any
    for bad in (error, [], "text", {"type": "completion", "content": []}, {"id": "x"}):
        with pytest.raises(ProviderProtocolError) as exc:
            CODEC.decode(bad, req([{"role": "user", "content": secret}]))
        assert secret not in str(exc.value)
    # a tool_use with no name is a call the loop answers with VALIDATION_ERROR
    nameless = CODEC.decode(
        {"type": "message", "content": [{"type": "tool_use", "id": "t"}]}, req([])
    )
    [call] = nameless["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": INVALID_CALL_NAME, "arguments": "{}"}


# ---------------------------------------------------------------------------------------------
# A cancelled turn's results, usage accounting


def test_cancelled_calls_still_get_error_results() -> None:
    cancelled = json.dumps(
        {"error": {"code": "cancelled", "message": "session cancelled before this call ran"}},
        separators=(",", ":"),
        sort_keys=True,
    )
    history = [
        {"role": "user", "content": "go"},
        calling(call("toolu_a"), call("toolu_b", "get_time")),
        tool_msg("toolu_a", "18C"),
        tool_msg("toolu_b", cancelled),
    ]
    results = body_of(req(history))["messages"][2]["content"]
    assert [(r["tool_use_id"], r.get("is_error", False)) for r in results] == [
        ("toolu_a", False),
        ("toolu_b", True),
    ]
    empty = body_of(req([*history[:2], tool_msg("toolu_a", ""), tool_msg("toolu_b", None)]))
    assert [r["content"] for r in empty["messages"][2]["content"]] == ["(no output)"] * 2


def test_usage_sums_the_cache_counts() -> None:
    usage = Usage(
        input_tokens=50,
        cache_read_input_tokens=1000,
        cache_creation_input_tokens=200,
        output_tokens=120,
    )
    msg = message([text("Cached answer.")], usage=usage)
    expected = {
        "prompt_tokens": 1250,
        "completion_tokens": 120,
        "total_tokens": 1370,
        "prompt_tokens_details": {
            "cached_tokens": 1000,
            "input_tokens": 50,
            "cache_read_input_tokens": 1000,
            "cache_creation_input_tokens": 200,
        },
    }
    assert decoded(msg)["usage"] == expected
    assert CODEC.decode(msg.model_dump(), req([]))["usage"] == expected
    assert streamed(msg)["usage"] == expected  # message_start input, message_delta output
    bare = copy.deepcopy(wire(msg))
    del bare["usage"]
    assert CODEC.decode(bare, req([]))["usage"]["total_tokens"] == 0

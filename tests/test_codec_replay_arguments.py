"""A tool call whose arguments are no JSON object (a JSON string, array or number, or text
that is no JSON) is answered with a VALIDATION_ERROR; the next request replays the model's
turn. Each protocol's request must still have the shape its API accepts: Gemini's
`functionCall.args` and Anthropic's `tool_use.input` an object (`{"_raw_arguments": <text>}`),
OpenAI's `function.arguments` and the text-tag content a string (the text as it came)."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from anthropic.types import Message, MessageParam, ToolUseBlock, Usage

from worker.codecs.anthropic import AnthropicCodec
from worker.codecs.gemini import GeminiCodec
from worker.codecs.openai_chat import decode_arguments
from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.protocol import ChatRequest
from worker.codecs.replay_arguments import RAW_ARGUMENTS_KEY, replay_object
from worker.codecs.text_tags import TextTagCodec
from worker.errors import ToolValidationError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# arguments text a model may send that the loop cannot read as an object
UNREADABLE = {
    "json_string": '"Paris"',
    "array": "[1,2]",
    "number": "42",
    "invalid_json": "{city: Paris",
    "prose": "the weather in Paris please",
}
# decoded JSON values a wire may carry in `args`/`input`, with the text the decoders write
NON_OBJECT_VALUES = {"json_string": ("Paris", '"Paris"'), "array": ([1, 2], "[1,2]"),
                     "number": (42, "42"), "boolean": (True, "true")}  # fmt: skip
ERROR = json.dumps({"error": {"code": "VALIDATION_ERROR", "message": "must be an object"}})


def history(arguments: str) -> list[dict[str, Any]]:
    """A turn that called get_weather with `arguments`, and the error that answered it."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": ERROR},
    ]


def request(messages: list[dict[str, Any]], model: str = "m") -> ChatRequest:
    return ChatRequest(model=model, messages=messages, tools=[WEATHER])


def gemini_args(body: dict[str, Any]) -> list[Any]:
    return [
        part["functionCall"].get("args", {})
        for content in body["contents"]
        for part in content["parts"]
        if "functionCall" in part
    ]


def anthropic_inputs(body: dict[str, Any]) -> list[Any]:
    pydantic.TypeAdapter(list[MessageParam]).validate_python(body["messages"])
    return [
        block["input"]
        for message in body["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_use"
    ]


# The rule --------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_unreadable_arguments_replay_as_their_raw_text(raw: str) -> None:
    with pytest.raises(ToolValidationError):
        decode_arguments(raw)  # what the loop answers with a VALIDATION_ERROR
    assert replay_object(raw) == {RAW_ARGUMENTS_KEY: raw}


def test_readable_arguments_replay_as_the_loop_read_them() -> None:
    assert replay_object("") == replay_object("null") == replay_object(None) == {}
    assert replay_object('{"city":"Paris"}') == {"city": "Paris"}
    assert replay_object('"{\\"city\\":\\"Paris\\"}"') == {"city": "Paris"}  # double-encoded
    assert replay_object({"city": "Paris"}) == {"city": "Paris"}
    assert replay_object([1, 2]) == {RAW_ARGUMENTS_KEY: "[1,2]"}  # a decoded JSON value


# Each protocol, from canonical arguments text -----------------------------------------------------


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_gemini_function_call_args_stay_an_object(raw: str) -> None:
    from google.genai import types as gt

    body = GeminiCodec().encode(request(history(raw), "gemini-2.5-flash")).body
    assert gemini_args(body) == [{RAW_ARGUMENTS_KEY: raw}]
    for content in body["contents"]:
        gt.Content.model_validate(content)


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_anthropic_tool_use_input_stays_an_object(raw: str) -> None:
    body = AnthropicCodec().encode(request(history(raw), "claude-sonnet-4-5")).body
    assert anthropic_inputs(body) == [{RAW_ARGUMENTS_KEY: raw}]


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_openai_arguments_stay_the_text_as_it_came(raw: str) -> None:
    body = OpenAICodec().encode(request(history(raw))).body
    calls = [c for m in body["messages"] for c in m.get("tool_calls") or []]
    assert [c["function"]["arguments"] for c in calls] == [raw]


@pytest.mark.parametrize("raw", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_text_tags_write_the_text_as_it_came(raw: str) -> None:
    body = TextTagCodec().encode(request(history(raw))).body
    assert all(isinstance(m["content"], str) for m in body["messages"])
    turn = next(m for m in body["messages"] if m["role"] == "assistant")
    assert json.dumps(raw, ensure_ascii=False) in turn["content"]


# Each protocol, from the wire copy a turn keeps for replay ------------------------------------


@pytest.mark.parametrize("value", NON_OBJECT_VALUES.values(), ids=NON_OBJECT_VALUES.keys())
def test_gemini_kept_parts_replay_args_as_an_object(value: tuple[Any, str]) -> None:
    from google.genai import types as gt

    args, text = value
    codec = GeminiCodec()
    part = {"functionCall": {"name": "get_weather", "args": args}, "thoughtSignature": "c2ln"}
    reply = {
        "candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP"}]
    }
    turn = codec.decode(reply, request(history("{}")[:1]))["choices"][0]["message"]
    assert turn["tool_calls"][0]["function"]["arguments"] == text
    assert "_provider" in turn  # the kept parts are what is replayed
    answer = {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": ERROR}
    messages = [history("{}")[0], turn, answer]
    body = codec.encode(request(messages, "gemini-2.5-flash")).body
    assert gemini_args(body) == [{RAW_ARGUMENTS_KEY: text}]
    assert body["contents"][1]["parts"][0]["thoughtSignature"] == "c2ln"  # still verbatim
    assert turn["_provider"]["gemini"]["parts"][0]["functionCall"]["args"] == args  # untouched
    for content in body["contents"]:
        gt.Content.model_validate(content)


@pytest.mark.parametrize("value", NON_OBJECT_VALUES.values(), ids=NON_OBJECT_VALUES.keys())
def test_anthropic_kept_blocks_replay_input_as_an_object(value: tuple[Any, str]) -> None:
    codec = AnthropicCodec()
    use = ToolUseBlock(type="tool_use", id="toolu_01", name="get_weather", input={})
    msg = Message(id="msg_01", type="message", role="assistant", model="claude-sonnet-4-5",
                  content=[use], stop_reason="tool_use", stop_sequence=None,
                  usage=Usage(input_tokens=1, output_tokens=1))  # fmt: skip
    raw: dict[str, Any] = msg.to_dict(mode="json")
    raw["content"][0]["input"] = value[0]  # what the SDK's types would not let us build
    turn = codec.decode(raw, request(history("{}")[:1]))["choices"][0]["message"]
    arguments = turn["tool_calls"][0]["function"]["arguments"]
    answer = {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": ERROR}
    body = codec.encode(request([history("{}")[0], turn, answer], "claude-sonnet-4-5")).body
    assert anthropic_inputs(body) == [{RAW_ARGUMENTS_KEY: arguments}]

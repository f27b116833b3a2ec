"""The replay server driven by the OFFICIAL `openai`, `anthropic` and `google-genai` clients.

If these SDKs can parse every reply (JSON and streams) and the server accepts what they send
back, the replay wire formats are the real ones. Everything runs on loopback; the clients'
retries are off so a fault shows up as the SDK's own exception type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from fixtures.replay.server import ReplayServer

OPENAI_WEATHER: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ANTHROPIC_WEATHER: list[Any] = [
    {
        "name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
ANTHROPIC_CALC: list[Any] = [
    {"name": "calculate", "input_schema": {"type": "object", "properties": {}}}
]
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def server() -> Iterator[ReplayServer]:
    srv = ReplayServer(port=0).start()
    yield srv
    srv.stop()


@pytest.fixture()
def oai(server: ReplayServer) -> Iterator[openai.OpenAI]:
    server.reset()
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture()
def claude(server: ReplayServer) -> Iterator[anthropic.Anthropic]:
    server.reset()
    client = anthropic.Anthropic(base_url=server.root, api_key="x", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture()
def gemini(server: ReplayServer) -> genai.Client:
    server.reset()
    # No retry_options: google-genai then makes exactly one attempt.
    options = types.HttpOptions(base_url=server.root, timeout=10_000)
    return genai.Client(api_key="x", http_options=options)


# --- OpenAI -------------------------------------------------------------------------------


def assistant_with_calls(msg: Any) -> dict[str, Any]:
    """What a client sends back for an assistant turn with tool calls."""
    return {
        "role": "assistant",
        "content": msg.content,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in msg.tool_calls
        ],
    }


def test_openai_json_tool_round_trip(oai: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.chat.completions.create(
        model="replay/weather", messages=messages, tools=OPENAI_WEATHER
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_0_0",
        "get_weather",
        {"city": "Paris"},
    )
    assert first.usage is not None and first.usage.total_tokens == 15
    messages += [
        assistant_with_calls(choice.message),
        {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"},
    ]
    second = oai.chat.completions.create(
        model="replay/weather", messages=messages, tools=OPENAI_WEATHER
    )
    assert second.choices[0].message.content == "Weather report: 18C, sunny"
    assert second.choices[0].finish_reason == "stop"


def test_openai_stream_tool_round_trip(oai: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris, Tokyo, Lima"}]
    chunks = list(
        oai.chat.completions.create(
            model="replay/parallel",
            messages=messages,
            tools=OPENAI_WEATHER,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    # The SDK's own accumulator (openai-python `accumulate_delta`) rebuilds the calls.
    with oai.chat.completions.stream(
        model="replay/parallel", messages=messages, tools=OPENAI_WEATHER
    ) as stream:
        final = stream.get_final_completion()
    msg = final.choices[0].message
    assert msg.tool_calls is not None
    calls = [(c.id, json.loads(c.function.arguments)["city"]) for c in msg.tool_calls]
    assert calls == [("call_0_0", "Paris"), ("call_0_1", "Tokyo"), ("call_0_2", "Lima")]
    messages.append(assistant_with_calls(msg))
    messages += [
        {"role": "tool", "tool_call_id": c.id, "content": w}
        for c, w in zip(msg.tool_calls, ["sun", "rain", "fog"], strict=True)
    ]
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in oai.chat.completions.create(
            model="replay/parallel", messages=messages, tools=OPENAI_WEATHER, stream=True
        )
        if chunk.choices
    )
    assert text == "sun | rain | fog"


def test_openai_client_on_text_tags_stream(oai: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris"}]
    with oai.chat.completions.stream(model="replay-tags/weather", messages=messages) as stream:
        final = stream.get_final_completion()
    content = final.choices[0].message.content
    assert content == '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    assert final.choices[0].message.tool_calls in (None, [])
    response = '<tool_response>\n{"name": "get_weather", "content": "sunny"}\n</tool_response>'
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": response}]
    reply = oai.chat.completions.create(model="replay-tags/weather", messages=messages)
    assert reply.choices[0].message.content == "Weather report: sunny"


def test_openai_client_error_types(oai: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.RateLimitError) as limited:
        oai.chat.completions.create(model="replay/rate_limited", messages=messages)
    assert limited.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.InternalServerError):
        oai.chat.completions.create(model="replay/flaky", messages=messages)
    with pytest.raises(openai.UnprocessableEntityError, match="unknown scenario"):
        oai.chat.completions.create(model="replay/nope", messages=messages)


# --- Anthropic ------------------------------------------------------------------------------


def test_anthropic_create_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(
        model="replay/weather", max_tokens=256, messages=messages, tools=ANTHROPIC_WEATHER
    )
    assert first.stop_reason == "tool_use"
    block = first.content[0]
    assert block.type == "tool_use"
    assert (block.id, block.name, block.input) == (
        "toolu_replay_0_0",
        "get_weather",
        {"city": "Paris"},
    )
    assert (first.usage.input_tokens, first.usage.output_tokens) == (10, 5)
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18C"}],
        },
    ]
    second = claude.messages.create(
        model="replay/weather", max_tokens=256, messages=messages, tools=ANTHROPIC_WEATHER
    )
    assert second.stop_reason == "end_turn"
    assert second.content[0].type == "text" and second.content[0].text == "Weather report: 18C"


def test_anthropic_stream_parallel_round_trip(claude: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris, Rome"}]
    with claude.messages.stream(
        model="replay/parallel", max_tokens=256, messages=messages, tools=ANTHROPIC_WEATHER
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_message()
    assert {"message_start", "content_block_start", "message_stop"} <= kinds
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [(u.id, u.input) for u in uses] == [
        ("toolu_replay_0_0", {"city": "Paris"}),
        ("toolu_replay_0_1", {"city": "Rome"}),
    ]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 5
    messages += [
        {"role": "assistant", "content": final.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": w}
                for u, w in zip(uses, ["sun", "rain"], strict=True)
            ],
        },
    ]
    with claude.messages.stream(
        model="replay/parallel", max_tokens=256, messages=messages, tools=ANTHROPIC_WEATHER
    ) as stream:
        text = "".join(stream.text_stream)
    assert text == "sun | rain"


def test_anthropic_thinking_round_trip(claude: anthropic.Anthropic) -> None:
    """Thinking blocks come back signed and are replayed verbatim; dropping one is a 400."""
    messages: list[Any] = [{"role": "user", "content": "Add 2 and 3, then multiply by 10"}]
    common: Any = {
        "model": "replay/two_rounds",
        "max_tokens": 2048,
        "tools": ANTHROPIC_CALC,
        "thinking": THINKING,
    }
    first = claude.messages.create(messages=messages, **common)
    thinking, use = first.content
    assert thinking.type == "thinking" and thinking.signature and thinking.thinking
    assert use.type == "tool_use" and use.input == {"a": 2, "b": 3, "op": "add"}
    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"result":5}'}],
        },
    ]
    with claude.messages.stream(messages=messages, **common) as stream:
        second = stream.get_final_message()  # thinking_delta + signature_delta assembled
    thinking2, use2 = second.content
    assert thinking2.type == "thinking" and thinking2.signature != thinking.signature
    assert use2.type == "tool_use" and use2.input == {"a": 5, "b": 10, "op": "mul"}
    messages += [
        {"role": "assistant", "content": second.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use2.id, "content": '{"result":50}'}
            ],
        },
    ]
    final = claude.messages.create(messages=messages, **common)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].type == "text" and final.content[1].text == "Result: 50"

    without = [*messages[:3], {"role": "assistant", "content": [use2]}, messages[4]]
    with pytest.raises(
        anthropic.BadRequestError, match="Expected `thinking` or `redacted_thinking`"
    ):
        claude.messages.create(messages=without, **common)


def test_anthropic_client_error_types(claude: anthropic.Anthropic) -> None:
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.RateLimitError) as limited:
        claude.messages.create(model="replay/rate_limited", max_tokens=16, messages=messages)
    assert limited.value.body == {
        "type": "error",
        "error": {
            "type": "rate_limit_error",
            "message": "Number of requests has exceeded your rate limit",
        },
    }
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        claude.messages.create(model="replay/flaky", max_tokens=16, messages=messages)
    assert overloaded.value.status_code == 529
    with pytest.raises(anthropic.BadRequestError, match="first message must use"):
        claude.messages.create(
            model="replay/plain", max_tokens=16, messages=[{"role": "assistant", "content": "x"}]
        )


# --- Gemini ---------------------------------------------------------------------------------


def gemini_config(thinking: bool) -> types.GenerateContentConfig:
    declaration = types.FunctionDeclaration(
        name="calculate", parameters=types.Schema(type=types.Type.OBJECT)
    )
    weather = types.FunctionDeclaration(
        name="get_weather", parameters=types.Schema(type=types.Type.OBJECT)
    )
    return types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[declaration, weather])],
        thinking_config=(
            types.ThinkingConfig(include_thoughts=True, thinking_budget=1024) if thinking else None
        ),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )


def responses_for(content: types.Content, results: list[dict[str, Any]]) -> types.Content:
    calls = [p.function_call for p in content.parts or [] if p.function_call]
    parts = [
        types.Part(function_response=types.FunctionResponse(id=c.id, name=c.name, response=r))
        for c, r in zip(calls, results, strict=True)
    ]
    return types.Content(role="user", parts=parts)


def test_gemini_function_call_round_trip_with_thought_signatures(gemini: genai.Client) -> None:
    config = gemini_config(thinking=True)
    model = "replay-two_rounds"
    history = [
        types.Content(role="user", parts=[types.Part(text="Add 2 and 3, then multiply by 10")])
    ]
    first = gemini.models.generate_content(model=model, contents=history, config=config)
    assert first.function_calls is not None
    assert [(c.name, c.args) for c in first.function_calls] == [
        ("calculate", {"a": 2, "b": 3, "op": "add"})
    ]
    assert first.candidates and first.candidates[0].content is not None
    model_turn = first.candidates[0].content
    parts = model_turn.parts or []
    assert parts[0].thought is True and parts[1].thought_signature
    assert first.usage_metadata is not None and first.usage_metadata.thoughts_token_count
    # The signature bytes hold '+' and '/' in standard base64; the SDK sends them back in
    # URL-safe base64, which the server (like the real API) must accept.
    history += [model_turn, responses_for(model_turn, [{"result": 5}])]

    streamed: list[types.Part] = []
    for chunk in gemini.models.generate_content_stream(
        model=model, contents=history, config=config
    ):
        assert chunk.candidates and chunk.candidates[0].content is not None
        streamed += chunk.candidates[0].content.parts or []
    call_parts = [p for p in streamed if p.function_call]
    assert call_parts[0].function_call is not None
    assert call_parts[0].function_call.args == {"a": 5, "b": 10, "op": "mul"}
    assert call_parts[0].thought_signature
    second_turn = types.Content(role="model", parts=streamed)
    history += [second_turn, responses_for(second_turn, [{"result": 50}])]
    final = gemini.models.generate_content(model=model, contents=history, config=config)
    assert final.text == "Result: 50"

    bare = types.Part(function_call=parts[1].function_call)  # signature dropped
    broken = [history[0], types.Content(role="model", parts=[bare]), *history[2:]]
    with pytest.raises(genai_errors.ClientError) as rejected:
        gemini.models.generate_content(model=model, contents=broken, config=config)
    assert rejected.value.code == 400
    assert "missing a thought_signature" in str(rejected.value.message)


def test_gemini_stream_parallel_round_trip(gemini: genai.Client) -> None:
    config = gemini_config(thinking=False)
    history: list[Any] = [
        types.Content(role="user", parts=[types.Part(text="Weather in Oslo, Rome")])
    ]
    chunks = list(
        gemini.models.generate_content_stream(
            model="replay-parallel", contents=history, config=config
        )
    )
    assert [c.candidates[0].finish_reason if c.candidates else None for c in chunks] == [
        None,
        types.FinishReason.STOP,
    ]
    parts = [p for c in chunks if c.candidates and c.candidates[0].content
             for p in c.candidates[0].content.parts or []]  # fmt: skip
    calls = [p.function_call for p in parts if p.function_call]
    assert [(c.id, c.args) for c in calls] == [
        ("replay-call-0-0", {"city": "Oslo"}),
        ("replay-call-0-1", {"city": "Rome"}),
    ]
    model_turn = types.Content(role="model", parts=parts)
    history += [model_turn, responses_for(model_turn, [{"result": "sun"}, {"result": "rain"}])]
    text = "".join(
        chunk.text or ""
        for chunk in gemini.models.generate_content_stream(
            model="replay-parallel", contents=history, config=config
        )
    )
    assert text == "sun | rain"


def test_gemini_client_error_types(gemini: genai.Client) -> None:
    with pytest.raises(genai_errors.ClientError) as limited:
        gemini.models.generate_content(model="replay-rate_limited", contents="hi")
    assert limited.value.code == 429 and limited.value.status == "RESOURCE_EXHAUSTED"
    assert limited.value.details["error"]["details"][0]["retryDelay"] == "1s"
    with pytest.raises(genai_errors.ServerError) as flaky:
        gemini.models.generate_content(model="replay-flaky", contents="hi")
    assert flaky.value.code == 500
    assert gemini.models.generate_content(model="replay-flaky", contents="hi").text == "Echo: hi"

"""Gemini generateContent codec: each case of docs/provider-conformance.md's Gemini list and its
usage accounting, replaying realistic payloads without and with streaming; then a two-round
tool conversation, id stability, and the field names of the real google-genai SDK.

Pure: no network. Replies are built either by hand in REST camelCase or with
`google.genai.types.GenerateContentResponse(...).model_dump(mode="json", by_alias=True,
exclude_none=True)` (skipped when the SDK is not installed); encoded request pieces are
validated by the SDK's models, which forbid unknown fields.
"""

from __future__ import annotations

import json
import re
from types import ModuleType
from typing import Any

import pytest

from schemas.spec_types import INVALID_CALL_NAME
from worker.codecs.gemini import GeminiCodec, GeminiStreamAssembler
from worker.codecs.openai_chat import NO_OUTPUT, decode_arguments
from worker.codecs.protocol import ChatRequest, Codec, Delta, SseEvent
from worker.errors import (
    ProviderError,
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
    ToolValidationError,
)

CODEC = GeminiCodec()
SYNTH_ID = re.compile(r"^gcall_[0-9a-f]{24}$")
SIG_A = "CiIBVKhc7oNhNTYUEyhLpHfbHx3cuJtMAZzy5ipTFlcGnRyA3A=="
SIG_B = "CikBVKhc7mZ8lpIcW9PdrQJ2CjQzLQw8P4D+X0L3f2uY1jAb1sF9pQ=="
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def gt() -> ModuleType:
    """google.genai.types, or skip."""
    module: ModuleType = pytest.importorskip("google.genai.types")
    return module


def dump(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return out


def req(messages: list[dict[str, Any]] | None = None, **kw: Any) -> ChatRequest:
    kw.setdefault("tools", [WEATHER_TOOL])
    return ChatRequest(
        model="gemini-2.5-flash",
        messages=messages or [{"role": "user", "content": "Weather in Paris and London?"}],
        **kw,
    )


def reply(
    parts: list[dict[str, Any]],
    finish: str | None = "STOP",
    usage: dict[str, Any] | None = None,
    response_id: str | None = "x7tKaLmHFo2Y1dkP7-3y2Ac",
) -> dict[str, Any]:
    """A non-streamed REST reply, camelCase as on the wire."""
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish is not None:
        candidate["finishReason"] = finish
    body: dict[str, Any] = {
        "candidates": [candidate],
        "usageMetadata": usage
        or {"promptTokenCount": 42, "candidatesTokenCount": 12, "totalTokenCount": 54},
        "modelVersion": "gemini-2.5-flash",
    }
    if response_id is not None:
        body["responseId"] = response_id
    return body


def fcall(name: str, args: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    call: dict[str, Any] = {"name": name}
    if args is not None:
        call["args"] = args
    call.update(extra)
    return {"functionCall": call}


def message(completion: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = completion["choices"][0]["message"]
    return out


def finish(completion: dict[str, Any]) -> str:
    out: str = completion["choices"][0]["finish_reason"]
    return out


def chunk(
    parts: list[dict[str, Any]] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    response_id: str = "x7tKaLmHFo2Y1dkP7-3y2Ac",
) -> dict[str, Any]:
    """One streamed GenerateContentResponse (one SSE `data:`)."""
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts or []}, "index": 0}
    if finish is not None:
        candidate["finishReason"] = finish
    body: dict[str, Any] = {
        "candidates": [candidate],
        "modelVersion": "gemini-2.5-flash",
        "responseId": response_id,
    }
    if usage is not None:
        body["usageMetadata"] = usage
    return body


def stream(
    request: ChatRequest, chunks: list[dict[str, Any]]
) -> tuple[GeminiStreamAssembler, list[Delta]]:
    asm = CODEC.assembler(request)
    deltas: list[Delta] = []
    for c in chunks:
        deltas += asm.feed(SseEvent(event="message", data=json.dumps(c)))
    return asm, deltas


def streamed(request: ChatRequest, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    asm, _ = stream(request, chunks)
    assert asm.finished
    return asm.result()


def merged(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The same round unstreamed: parts in arrival order, the last usage and finishReason."""
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    usage = [c["usageMetadata"] for c in chunks if "usageMetadata" in c][-1]
    reason = [
        c["candidates"][0]["finishReason"] for c in chunks if c["candidates"][0].get("finishReason")
    ]
    return reply(parts, reason[-1], usage, chunks[-1]["responseId"])


def walk(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node, *(d for v in node.values() for d in walk(v))]
    if isinstance(node, list):
        return [d for v in node for d in walk(v)]
    return []


def test_codec_meets_the_protocol() -> None:
    codec: Codec = GeminiCodec()
    assert codec.protocol == "gemini"
    assert isinstance(codec.assembler(req()), GeminiStreamAssembler)


# Roles: only user and model; system text goes to systemInstruction ---------------------------


def test_roles_user_model_and_system_instruction(gt: ModuleType) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "gcall_0123456789abcdef01234567",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "gcall_0123456789abcdef01234567", "content": "18C"},
        {"role": "assistant", "content": "18C in Paris."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
        {"role": "user", "content": "Thanks!"},
    ]
    wire = CODEC.encode(req(messages))
    assert wire.path == "/models/gemini-2.5-flash:generateContent"
    assert wire.query == {}
    body = wire.body
    assert body["systemInstruction"] == {
        "parts": [{"text": "You are terse."}, {"text": "Answer in English."}]
    }
    roles = [c["role"] for c in body["contents"]]
    assert roles == ["user", "model", "user", "model", "user"]
    assert body["contents"][2]["parts"] == [
        {"functionResponse": {"name": "get_weather", "response": {"content": "18C"}}}
    ]
    for content in [*body["contents"], body["systemInstruction"]]:
        gt.Content.model_validate(content)

    wire = CODEC.encode(req(messages, stream=True))
    assert wire.path == "/models/gemini-2.5-flash:streamGenerateContent"
    assert wire.query == {"alt": "sse"}
    assert wire.body == body
    prefixed = ChatRequest(model="models/gemini-2.5-pro", messages=messages)
    assert CODEC.encode(prefixed).path == "/models/gemini-2.5-pro:generateContent"


# Args are an object, absent for a function without arguments ---------------------------------


def test_args_are_an_object_both_ways() -> None:
    completion = CODEC.decode(
        reply([fcall("get_weather", {"city": "Paris", "units": ["C"]}), fcall("list_cities")]),
        req(),
    )
    calls = message(completion)["tool_calls"]
    assert calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Paris","units":["C"]}',
    }
    assert calls[1]["function"] == {"name": "list_cities", "arguments": "{}"}  # args missing
    assert all(c["type"] == "function" for c in calls)

    # replayed without _provider: arguments text -> args object again
    assistant = {**message(completion)}
    assistant.pop("_provider")
    body = CODEC.encode(req([{"role": "user", "content": "hi"}, assistant])).body
    parts = body["contents"][1]["parts"]
    assert parts[0]["functionCall"]["args"] == {"city": "Paris", "units": ["C"]}
    assert parts[1]["functionCall"]["args"] == {}

    streamed_completion = streamed(
        req(), [chunk([fcall("list_cities")]), chunk(finish="STOP", usage={"totalTokenCount": 3})]
    )
    assert message(streamed_completion)["tool_calls"][0]["function"]["arguments"] == "{}"


# Text plus calls in one candidate: a preamble and parallel calls -----------------------------


def test_text_plus_parallel_calls(gt: ModuleType) -> None:
    raw = dump(
        gt.GenerateContentResponse(
            response_id="b47-resp",
            model_version="gemini-2.5-flash",
            candidates=[
                gt.Candidate(
                    index=0,
                    finish_reason=gt.FinishReason.STOP,
                    content=gt.Content(
                        role="model",
                        parts=[
                            gt.Part(text="Checking."),
                            gt.Part(
                                function_call=gt.FunctionCall(
                                    name="get_weather", args={"city": "Paris"}
                                )
                            ),
                            gt.Part(
                                function_call=gt.FunctionCall(
                                    name="get_weather", args={"city": "London"}
                                )
                            ),
                        ],
                    ),
                )
            ],
            usage_metadata=gt.GenerateContentResponseUsageMetadata(
                prompt_token_count=60, candidates_token_count=20, total_token_count=80
            ),
        )
    )
    assert "functionCall" in raw["candidates"][0]["content"]["parts"][1]  # real camelCase names
    completion = CODEC.decode(raw, req())
    msg = message(completion)
    assert msg["content"] == "Checking."
    assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == [
        "Paris",
        "London",
    ]
    assert finish(completion) == "tool_calls"

    chunks = [
        chunk([{"text": "Check"}]),
        chunk([{"text": "ing."}]),
        chunk([fcall("get_weather", {"city": "Paris"})]),
        chunk(
            [fcall("get_weather", {"city": "London"})],
            "STOP",
            {"promptTokenCount": 60, "candidatesTokenCount": 20, "totalTokenCount": 80},
        ),
    ]
    result = streamed(req(), chunks)
    assert message(result)["content"] == "Checking."
    assert [c["function"]["arguments"] for c in message(result)["tool_calls"]] == [
        c["function"]["arguments"] for c in msg["tool_calls"]
    ]
    assert finish(result) == "tool_calls"


# Ids: synthesised when Gemini sends none, echoed when it does --------------------------------


def test_synthesised_ids_distinct_stable_never_sent() -> None:
    raw = reply([fcall("get_weather", {"city": "Paris"}), fcall("get_weather", {"city": "Paris"})])
    first = message(CODEC.decode(raw, req()))
    again = message(CODEC.decode(json.loads(json.dumps(raw)), req()))
    ids = [c["id"] for c in first["tool_calls"]]
    assert all(SYNTH_ID.match(i) for i in ids)
    assert len(set(ids)) == 2  # same name and args, still two ids
    assert ids == [c["id"] for c in again["tool_calls"]]  # redelivery-stable
    other = reply([fcall("get_weather", {"city": "Paris"})], response_id="another-response")
    assert message(CODEC.decode(other, req()))["tool_calls"][0]["id"] != ids[0]
    # without responseId the request length separates rounds
    bare = reply([fcall("get_weather", {"city": "Paris"})], response_id=None)
    one = message(CODEC.decode(bare, req()))["tool_calls"][0]["id"]
    two = message(CODEC.decode(bare, req([{"role": "user", "content": "a"}] * 3)))
    assert SYNTH_ID.match(one) and one != two["tool_calls"][0]["id"]

    chunks = [chunk([p]) for p in raw["candidates"][0]["content"]["parts"]]
    chunks[-1]["candidates"][0]["finishReason"] = "STOP"
    assert [c["id"] for c in message(streamed(req(), chunks))["tool_calls"]] == ids

    body = CODEC.encode(req(_round_two(first, ["18C", "18C"]))).body
    model_parts, user_parts = body["contents"][1]["parts"], body["contents"][2]["parts"]
    assert all("id" not in p["functionCall"] for p in model_parts)
    assert all("id" not in p["functionResponse"] for p in user_parts)


def test_provider_ids_are_echoed() -> None:
    raw = reply(
        [
            fcall("get_weather", {"city": "Paris"}, id="fc-1a2b"),
            fcall("get_weather", {"city": "London"}, id="fc-3c4d"),
        ]
    )
    first = message(CODEC.decode(raw, req()))
    assert [c["id"] for c in first["tool_calls"]] == ["fc-1a2b", "fc-3c4d"]
    body = CODEC.encode(req(_round_two(first, ["18C", "12C"]))).body
    assert [p["functionCall"]["id"] for p in body["contents"][1]["parts"]] == ["fc-1a2b", "fc-3c4d"]
    assert [p["functionResponse"]["id"] for p in body["contents"][2]["parts"]] == [
        "fc-1a2b",
        "fc-3c4d",
    ]
    # also when the assistant turn is rebuilt (no _provider)
    rebuilt = {k: v for k, v in first.items() if k != "_provider"}
    body = CODEC.encode(req(_round_two(rebuilt, ["18C", "12C"]))).body
    assert [p["functionCall"]["id"] for p in body["contents"][1]["parts"]] == ["fc-1a2b", "fc-3c4d"]


def _round_two(assistant: dict[str, Any], outputs: list[str]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Paris and London?"},
        assistant,
        *(
            {"role": "tool", "tool_call_id": c["id"], "content": out}
            for c, out in zip(assistant["tool_calls"], outputs, strict=True)
        ),
    ]


# functionResponse.response is an object named like the call ----------------------------------


def test_function_response_is_an_object_named_like_the_call(gt: ModuleType) -> None:
    error = {"error": {"code": "tool_exec_failed", "message": "timeout after 10s"}}
    outputs = ["18C cloudy", '{"temp_c": 18, "sky": "cloudy"}', json.dumps(error), "[1, 2]", ""]
    calls = [
        {
            "id": f"fc-{i}",
            "type": "function",
            "function": {"name": f"tool_{i}", "arguments": "{}"},
        }
        for i in range(len(outputs))
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *(
            {"role": "tool", "tool_call_id": c["id"], "content": out}
            for c, out in zip(calls, outputs, strict=True)
        ),
    ]
    parts = CODEC.encode(req(messages)).body["contents"][2]["parts"]
    responses = [p["functionResponse"] for p in parts]
    assert [r["name"] for r in responses] == [f"tool_{i}" for i in range(len(outputs))]
    assert [r["response"] for r in responses] == [
        {"content": "18C cloudy"},
        {"temp_c": 18, "sky": "cloudy"},
        error,  # our error JSON stays an object
        {"content": "[1, 2]"},
        {"content": NO_OUTPUT},
    ]
    gt.Content.model_validate({"role": "user", "parts": parts})

    orphan = [
        {"role": "user", "content": "go"},
        {"role": "tool", "tool_call_id": "x", "content": "1"},
    ]
    with pytest.raises(ProviderRequestError):
        CODEC.encode(req(orphan))


# All responses of a turn in one user content, in call order ----------------------------------


def test_all_responses_of_a_turn_in_one_user_content() -> None:
    first = message(
        CODEC.decode(
            reply(
                [fcall("get_weather", {"city": "Paris"}), fcall("get_weather", {"city": "Rome"})]
            ),
            req(),
        )
    )
    messages = [*_round_two(first, ["18C", "25C"]), {"role": "user", "content": "And Oslo?"}]
    contents = CODEC.encode(req(messages)).body["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user"]
    parts = contents[2]["parts"]
    assert [p["functionResponse"]["response"] for p in parts[:2]] == [
        {"content": "18C"},
        {"content": "25C"},
    ]
    assert parts[2] == {"text": "And Oslo?"}  # a following user message joins the same turn


# STOP with calls means tool calls; a malformed call is retried -------------------------------


def test_stop_with_calls_and_failed_rounds() -> None:
    calls = [fcall("get_weather", {"city": "Paris"})]
    assert finish(CODEC.decode(reply(calls, "STOP"), req())) == "tool_calls"
    assert finish(CODEC.decode(reply(calls, "MAX_TOKENS"), req())) == "length"
    assert finish(CODEC.decode(reply([{"text": "Hi"}], "STOP"), req())) == "stop"
    assert finish(CODEC.decode(reply([{"text": "Hi"}], "MAX_TOKENS"), req())) == "length"
    for reason in ("SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT"):
        assert finish(CODEC.decode(reply([], reason), req())) == "content_filter"
    assert finish(streamed(req(), [chunk(calls, "STOP", {"totalTokenCount": 1})])) == "tool_calls"

    malformed = reply([], "MALFORMED_FUNCTION_CALL")
    malformed["candidates"][0]["finishMessage"] = "Malformed function call: print(default_api.x())"
    for body in (malformed, reply([], "UNEXPECTED_TOOL_CALL")):
        with pytest.raises(ProviderRetryableError):
            CODEC.decode(body, req())
    asm, _ = stream(req(), [chunk([{"text": "Let me"}]), chunk(finish="MALFORMED_FUNCTION_CALL")])
    assert asm.finished
    with pytest.raises(ProviderRetryableError):
        asm.result()
    with pytest.raises(ProviderRequestError):
        CODEC.decode(reply([], "MISSING_THOUGHT_SIGNATURE"), req())

    blocked = {"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"}, "usageMetadata": {}}
    with pytest.raises(ProviderRequestError, match="PROHIBITED_CONTENT"):
        CODEC.decode(blocked, req())
    asm, _ = stream(req(), [blocked])
    assert asm.finished
    with pytest.raises(ProviderRequestError, match="PROHIBITED_CONTENT"):
        asm.result()
    with pytest.raises(ProviderProtocolError):
        CODEC.decode({"candidates": [], "usageMetadata": {}}, req())
    with pytest.raises(ProviderProtocolError):
        CODEC.decode(["not", "an", "object"], req())


# Thought signatures go back on their own part, unchanged -------------------------------------


def test_thought_signatures_replayed_verbatim(gt: ModuleType) -> None:
    raw = dump(
        gt.GenerateContentResponse(
            response_id="b52-resp",
            model_version="gemini-3-pro-preview",
            candidates=[
                gt.Candidate(
                    index=0,
                    finish_reason=gt.FinishReason.STOP,
                    content=gt.Content(
                        role="model",
                        parts=[
                            gt.Part(text="**Planning** I need the weather.", thought=True),
                            gt.Part(
                                function_call=gt.FunctionCall(
                                    id="fc-9z", name="get_weather", args={"city": "Paris"}
                                ),
                                thought_signature=b"\x0a\x22\x01signed-by-gemini",
                            ),
                        ],
                    ),
                )
            ],
        )
    )
    parts = raw["candidates"][0]["content"]["parts"]
    assert isinstance(parts[1]["thoughtSignature"], str)  # base64 on the wire
    msg = message(CODEC.decode(raw, req()))
    assert msg["reasoning_content"] == "**Planning** I need the weather."
    assert msg["content"] is None
    assert msg["_provider"] == {"gemini": {"parts": parts}}

    body = CODEC.encode(req(_round_two(msg, ["18C"]))).body
    assert body["contents"][1] == {"role": "model", "parts": parts}  # thought part included
    gt.Content.model_validate(body["contents"][1])
    msg["_provider"]["gemini"]["parts"][1]["thoughtSignature"] = "tampered"
    assert parts[1]["thoughtSignature"] != "tampered"  # decode kept its own copy

    # a signed text answer keeps its signature; a plain one carries no replay data
    signed = message(CODEC.decode(reply([{"text": "Done.", "thoughtSignature": SIG_A}]), req()))
    assert signed["_provider"] == {
        "gemini": {"parts": [{"text": "Done.", "thoughtSignature": SIG_A}]}
    }
    assert "_provider" not in message(CODEC.decode(reply([{"text": "Done."}]), req()))

    # another protocol's replay data is ignored
    foreign = {
        "role": "assistant",
        "content": "Hello.",
        "reasoning_content": "thinking elsewhere",
        "_provider": {"anthropic": {"content": [{"type": "thinking", "signature": "x"}]}},
    }
    body = CODEC.encode(req([{"role": "user", "content": "hi"}, foreign])).body
    assert body["contents"][1] == {"role": "model", "parts": [{"text": "Hello."}]}


# Streams: each chunk a whole response, calls appended, never merged --------------------------


def test_stream_assembly_equals_the_unstreamed_reply(gt: ModuleType) -> None:
    def sdk_chunk(parts: list[Any], finish: Any = None, usage: Any = None) -> dict[str, Any]:
        return dump(
            gt.GenerateContentResponse(
                response_id="b53-resp",
                model_version="gemini-2.5-flash",
                candidates=[
                    gt.Candidate(
                        index=0, finish_reason=finish, content=gt.Content(role="model", parts=parts)
                    )
                ],
                usage_metadata=usage,
            )
        )

    weather = gt.FunctionCall(name="get_weather", args={"city": "Paris"})
    chunks = [
        sdk_chunk([gt.Part(text="Weighing the ", thought=True)]),
        sdk_chunk([gt.Part(text="two cities.", thought=True)]),
        sdk_chunk([gt.Part(text="Checking "), gt.Part(text="both.")]),
        sdk_chunk([gt.Part(function_call=weather, thought_signature=b"sig-1")]),
        sdk_chunk(
            [gt.Part(function_call=weather)],  # same name and args: appended, never merged
            usage=gt.GenerateContentResponseUsageMetadata(
                prompt_token_count=70, candidates_token_count=15, total_token_count=85
            ),
        ),
        sdk_chunk(
            [gt.Part(text="", thought_signature=b"sig-2")],
            finish=gt.FinishReason.STOP,
            usage=gt.GenerateContentResponseUsageMetadata(
                prompt_token_count=70,
                candidates_token_count=31,
                thoughts_token_count=12,
                total_token_count=113,
            ),
        ),
    ]
    asm = CODEC.assembler(req(stream=True))
    deltas: list[Delta] = []
    for i, c in enumerate(chunks):
        assert not asm.finished
        deltas += asm.feed(SseEvent(event="message", data=json.dumps(c), id=str(i)))
        assert asm.feed(SseEvent(event="message", data="")) == []
    assert asm.finished
    assert deltas == [
        Delta("reasoning", "Weighing the "),
        Delta("reasoning", "two cities."),
        Delta("content", "Checking "),
        Delta("content", "both."),
        Delta("tool_call", '{"city": "Paris"}', 0, "get_weather"),  # a call comes whole
        Delta("tool_call", '{"city": "Paris"}', 1, "get_weather"),
    ]
    result = asm.result()
    assert result == CODEC.decode(merged(chunks), req(stream=True))
    msg = message(result)
    assert msg["content"] == "Checking both."
    assert msg["reasoning_content"] == "Weighing the two cities."
    assert len(msg["tool_calls"]) == 2 and msg["tool_calls"][0]["id"] != msg["tool_calls"][1]["id"]
    replay = msg["_provider"]["gemini"]["parts"]
    assert len(replay) == 7  # as they came
    assert (
        replay[4]["thoughtSignature"]
        == chunks[3]["candidates"][0]["content"]["parts"][0]["thoughtSignature"]
    )
    assert "thoughtSignature" not in replay[5]
    assert replay[6]["thoughtSignature"]
    assert result["usage"]["total_tokens"] == 113  # the last chunk's usage
    assert finish(result) == "tool_calls"


def test_truncated_stream_and_stream_errors() -> None:
    asm, _ = stream(req(), [chunk([{"text": "Partial"}]), chunk([fcall("get_weather", {})])])
    assert not asm.finished
    with pytest.raises(ProviderProtocolError, match="truncated"):
        asm.result()

    asm = CODEC.assembler(req())
    with pytest.raises(ProviderProtocolError):
        asm.feed(SseEvent(event="message", data="{not json"))

    overloaded = {
        "error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}
    }
    with pytest.raises(ProviderRetryableError) as retry:
        stream(req(), [chunk([{"text": "Hi"}]), overloaded])
    assert retry.value.status == 503
    invalid = {"error": {"code": 400, "message": "Invalid argument.", "status": "INVALID_ARGUMENT"}}
    with pytest.raises(ProviderRequestError):
        stream(req(), [invalid])
    with pytest.raises(ProviderError):
        CODEC.decode(invalid, req())


# Schema dialect: the OpenAPI subset Gemini accepts -------------------------------------------


PYDANTIC_STYLE = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "BookTrip",
    "type": "object",
    "additionalProperties": False,
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "homepage": {"type": "string", "format": "uri"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "Stop": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "next": {"$ref": "#/$defs/Stop"}},
        },
    },
    "properties": {
        "to": {"$ref": "#/$defs/Address", "description": "Destination"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "seats": {"type": ["integer", "null"], "minimum": 1, "maximum": 9, "default": 1},
        "class": {"type": "integer", "enum": [1, 2], "description": "Fare class."},
        "meal": {"enum": ["veg", "any", None]},
        "when": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "uniqueItems": True},
        "code": {"type": ["string", "integer"], "minLength": 3, "exclusiveMinimum": 0},
        "route": {"$ref": "#/$defs/Stop"},
        "options": {
            "allOf": [
                {"type": "object", "properties": {"window": {"type": "boolean"}}},
                {"properties": {"aisle": {"type": "boolean"}}, "required": ["aisle"]},
            ]
        },
        "extra": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["to", "ghost"],
}


def test_schema_dialect(gt: ModuleType) -> None:
    tool = {"type": "function", "function": {"name": "book_trip", "parameters": PYDANTIC_STYLE}}
    original = json.dumps(PYDANTIC_STYLE, sort_keys=True)
    body = CODEC.encode(req(tools=[tool, _no_args_tool()])).body
    assert json.dumps(PYDANTIC_STYLE, sort_keys=True) == original  # input untouched
    declarations = body["tools"][0]["functionDeclarations"]
    assert declarations[1] == {"name": "ping", "description": "Liveness."}  # no parameters
    params = declarations[0]["parameters"]
    banned = {"$ref", "$defs", "$schema", "additionalProperties", "default", "uniqueItems"}
    banned |= {"exclusiveMinimum", "allOf", "oneOf", "const"}
    assert not [n for n in walk(params) if banned & (n.keys() - {"properties"})]
    assert params["type"] == "OBJECT"
    assert params["required"] == ["to"]
    props = params["properties"]
    assert props["to"] == {
        "description": "Destination",
        "type": "OBJECT",
        "properties": {"city": {"type": "STRING"}, "homepage": {"type": "STRING"}},
        "required": ["city"],
    }
    assert props["note"] == {"type": "STRING", "nullable": True}
    assert props["seats"] == {"type": "INTEGER", "minimum": 1, "maximum": 9, "nullable": True}
    assert props["class"] == {"description": "Fare class. Allowed values: 1, 2.", "type": "INTEGER"}
    assert props["meal"] == {"nullable": True, "enum": ["veg", "any"], "type": "STRING"}
    assert props["when"] == {"type": "STRING", "format": "date-time"}
    assert props["tags"] == {"type": "ARRAY", "items": {"type": "STRING"}}
    assert props["code"] == {
        "anyOf": [{"type": "STRING", "minLength": 3}, {"type": "INTEGER", "minimum": 0}]
    }
    assert props["route"]["properties"]["next"] == {}  # recursion cut where it recurs
    assert props["options"]["properties"].keys() == {"window", "aisle"}
    assert props["options"]["required"] == ["aisle"]
    assert props["extra"] == {"type": "OBJECT"}  # never an empty `properties` map
    gt.Tool.model_validate(body["tools"][0])


def _no_args_tool() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": "ping",
            "description": "Liveness.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }


# A 429's RetryInfo delay when there is no Retry-After ----------------------------------------


QUOTA_429: dict[str, Any] = {
    "error": {
        "code": 429,
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "status": "RESOURCE_EXHAUSTED",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [
                    {
                        "quotaMetric": "generativelanguage.googleapis.com/"
                        "generate_content_free_tier_requests",
                        "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                        "quotaDimensions": {"location": "global", "model": "gemini-2.5-flash"},
                        "quotaValue": "10",
                    }
                ],
            },
            {
                "@type": "type.googleapis.com/google.rpc.Help",
                "links": [
                    {
                        "description": "Learn more",
                        "url": "https://ai.google.dev/gemini-api/docs/rate-limits",
                    }
                ],
            },
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "21s"},
        ],
    }
}


def _with_delay(delay: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json.dumps(QUOTA_429))
    body["error"]["details"][2]["retryDelay"] = delay
    return body


def test_retry_info_delay() -> None:
    assert CODEC.retry_after_s(429, QUOTA_429) == 21.0
    assert CODEC.retry_after_s(429, [QUOTA_429]) == 21.0  # stream endpoints wrap it in a list
    assert CODEC.retry_after_s(429, json.dumps(QUOTA_429)) == 21.0
    assert CODEC.retry_after_s(429, json.dumps(QUOTA_429).encode()) == 21.0
    assert CODEC.retry_after_s(429, _with_delay("1.5s")) == 1.5
    assert CODEC.retry_after_s(429, _with_delay("0.750s")) == 0.75
    assert CODEC.retry_after_s(429, _with_delay("750ms")) == 0.75
    assert CODEC.retry_after_s(429, _with_delay({"seconds": "2", "nanos": 500000000})) == 2.5
    for bad in ("soon", "-3s", "", None, "infs"):
        assert CODEC.retry_after_s(429, _with_delay(bad)) is None
    without = json.loads(json.dumps(QUOTA_429))
    del without["error"]["details"][2]
    assert CODEC.retry_after_s(429, without) is None
    assert CODEC.retry_after_s(429, None) is None
    assert CODEC.retry_after_s(502, "<html>Bad Gateway</html>") is None

    with pytest.raises(ProviderRetryableError) as exc:
        stream(req(), [QUOTA_429])
    assert exc.value.retry_after_s == 21.0
    assert exc.value.status == 429


# Usage: thoughts counted once, whether or not candidates include them ------------------------


def test_usage_accounting(gt: ModuleType) -> None:
    outside = {
        "promptTokenCount": 100,
        "candidatesTokenCount": 50,
        "thoughtsTokenCount": 30,
        "toolUsePromptTokenCount": 8,
        "cachedContentTokenCount": 64,
        "totalTokenCount": 188,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 100}],
    }
    usage = CODEC.decode(reply([{"text": "ok"}], usage=outside), req())["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        108,
        80,
        188,
    )
    assert usage["prompt_tokens_details"] == {"cached_tokens": 64}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 30}
    assert usage["gemini_details"] == outside  # raw, as received

    included = {
        "promptTokenCount": 100,
        "candidatesTokenCount": 80,
        "thoughtsTokenCount": 30,
        "totalTokenCount": 180,
    }
    usage = CODEC.decode(reply([{"text": "ok"}], usage=included), req())["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        100,
        80,
        180,
    )

    sdk_usage = dump(
        gt.GenerateContentResponseUsageMetadata(
            prompt_token_count=10, candidates_token_count=5, thoughts_token_count=7
        )
    )
    usage = CODEC.decode(reply([{"text": "ok"}], usage=sdk_usage), req())["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        10,
        12,
        22,
    )

    bare = reply([{"text": "ok"}])
    del bare["usageMetadata"]
    assert CODEC.decode(bare, req())["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
    }

    chunks = [
        chunk([{"text": "a"}], usage={"promptTokenCount": 100, "totalTokenCount": 100}),
        chunk(
            [{"text": "b"}],
            usage={"promptTokenCount": 100, "candidatesTokenCount": 4, "totalTokenCount": 104},
        ),
        chunk([{"text": "c"}], "STOP", outside),
    ]
    usage = streamed(req(), chunks)["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        108,
        80,
        188,
    )


# Conversation, ids, encoding details ---------------------------------------------------------


def test_two_round_tool_conversation_echoes_signatures() -> None:
    tools = [WEATHER_TOOL]
    user = {"role": "user", "content": "Is it warmer in Paris or in London?"}
    round_one: dict[str, Any] = {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": "Comparing two cities.", "thought": True},
                        {
                            "functionCall": {
                                "id": "fc-p",
                                "name": "get_weather",
                                "args": {"city": "Paris"},
                            },
                            "thoughtSignature": SIG_A,
                        },
                        {
                            "functionCall": {
                                "id": "fc-l",
                                "name": "get_weather",
                                "args": {"city": "London"},
                            }
                        },
                    ],
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 90,
            "candidatesTokenCount": 40,
            "thoughtsTokenCount": 55,
            "totalTokenCount": 185,
        },
        "modelVersion": "gemini-3-pro-preview",
        "responseId": "round-1",
    }
    request_one = ChatRequest(
        model="gemini-3-pro-preview", messages=[user], tools=tools, thinking_budget_tokens=1024
    )
    wire_one = CODEC.encode(request_one).body
    assert wire_one["generationConfig"]["thinkingConfig"] == {
        "thinkingBudget": 1024,
        "includeThoughts": True,
    }
    first = message(CODEC.decode(round_one, request_one))

    history = [
        user,
        first,
        {"role": "tool", "tool_call_id": "fc-p", "content": '{"temp_c": 18}'},
        {"role": "tool", "tool_call_id": "fc-l", "content": '{"temp_c": 12}'},
    ]
    request_two = ChatRequest(
        model="gemini-3-pro-preview", messages=history, tools=tools, thinking_budget_tokens=1024
    )
    contents = CODEC.encode(request_two).body["contents"]
    assert contents[1] == {"role": "model", "parts": round_one["candidates"][0]["content"]["parts"]}
    assert contents[2] == {
        "role": "user",
        "parts": [
            {"functionResponse": {"name": "get_weather", "response": {"temp_c": 18}, "id": "fc-p"}},
            {"functionResponse": {"name": "get_weather", "response": {"temp_c": 12}, "id": "fc-l"}},
        ],
    }

    round_two = reply(
        [{"text": "Paris is warmer (18C vs 12C).", "thoughtSignature": SIG_B}],
        response_id="round-2",
    )
    second = message(CODEC.decode(round_two, request_two))
    assert second["content"] == "Paris is warmer (18C vs 12C)."
    request_three = ChatRequest(
        model="gemini-3-pro-preview",
        messages=[*history, second, {"role": "user", "content": "And tomorrow?"}],
        tools=tools,
    )
    contents = CODEC.encode(request_three).body["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user", "model", "user"]
    assert contents[1]["parts"][1]["thoughtSignature"] == SIG_A
    assert contents[3]["parts"] == [
        {"text": "Paris is warmer (18C vs 12C).", "thoughtSignature": SIG_B}
    ]


def test_decode_sdk_and_hand_built_payloads_agree(gt: ModuleType) -> None:
    hand = reply(
        [
            {"text": "Hi", "thoughtSignature": "c2ln"},
            fcall("get_weather", {"city": "Oslo"}, id="fc-1"),
        ],
        usage={"promptTokenCount": 3, "candidatesTokenCount": 2, "totalTokenCount": 5},
    )
    sdk = dump(gt.GenerateContentResponse.model_validate(hand))
    assert sdk == hand  # the hand-built camelCase names are the SDK's wire names
    assert CODEC.decode(sdk, req()) == CODEC.decode(hand, req())


def test_tool_choice_table(gt: ModuleType) -> None:
    cases: list[tuple[Any, dict[str, Any] | None]] = [
        (None, None),
        ("auto", {"mode": "AUTO"}),
        ("none", {"mode": "NONE"}),
        ("required", {"mode": "ANY"}),
        ({"name": "get_weather"}, {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}),
    ]
    for choice, expected in cases:
        body = CODEC.encode(req(tool_choice=choice, parallel_tool_calls=False)).body
        if expected is None:
            assert "toolConfig" not in body
        else:
            assert body["toolConfig"] == {"functionCallingConfig": expected}
            gt.ToolConfig.model_validate(body["toolConfig"])
        assert "parallel_tool_calls" not in json.dumps(body)
    body = CODEC.encode(req(tools=[], tool_choice="required")).body
    assert "tools" not in body and "toolConfig" not in body


def test_params_map_to_generation_config(gt: ModuleType) -> None:
    params = {
        "temperature": 0.2,
        "top_p": 0.9,
        "max_completion_tokens": 512,
        "stop": "END",
        "seed": 7,
        "topK": 40,
        "response_mime_type": "text/plain",
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        "n": 3,
        "user": "u-1",
        "logit_bias": {"1": 2},
        "model": "ignored",
    }
    body = CODEC.encode(req(params=params)).body
    assert body["generationConfig"] == {
        "temperature": 0.2,
        "topP": 0.9,
        "maxOutputTokens": 512,
        "stopSequences": ["END"],
        "seed": 7,
        "topK": 40,
        "responseMimeType": "text/plain",
    }
    assert body["safetySettings"] == params["safetySettings"]
    gt.GenerationConfig.model_validate(body["generationConfig"])

    native = CODEC.encode(req(params={"max_tokens": 100, "maxOutputTokens": 200})).body
    assert native["generationConfig"] == {"maxOutputTokens": 200}  # the Gemini name wins
    field = CODEC.encode(req(params={"max_tokens": 100}, max_tokens=300)).body
    assert field["generationConfig"] == {"maxOutputTokens": 300}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    body = CODEC.encode(req(params={"response_format": fmt})).body
    assert body["generationConfig"] == {
        "responseMimeType": "application/json",
        "responseJsonSchema": {"type": "object"},
    }
    assert "generationConfig" not in CODEC.encode(req()).body


def test_user_media_parts(gt: ModuleType) -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
    ]
    parts = CODEC.encode(req([{"role": "user", "content": content}])).body["contents"][0]["parts"]
    assert parts == [
        {"text": "What is this?"},
        {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
        {"fileData": {"fileUri": "https://example.com/cat.jpg", "mimeType": "image/jpeg"}},
    ]
    gt.Content.model_validate({"role": "user", "parts": parts})
    with pytest.raises(ProviderRequestError):
        CODEC.encode(req([{"role": "user", "content": [{"type": "hologram"}]}]))


def test_unreadable_function_calls_are_kept_for_the_loop_to_answer() -> None:
    """Arguments must be a JSON object: args that are no object, or a call with no name, are
    calls the loop answers with VALIDATION_ERROR; the session goes on."""
    raw = reply(
        [
            {"functionCall": {"name": "get_weather", "args": ["Paris"]}},
            {"functionCall": {"args": {"city": "Oslo"}}},
        ]
    )
    calls = message(CODEC.decode(raw, req()))["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", INVALID_CALL_NAME]
    assert calls[0]["function"]["arguments"] == '["Paris"]'
    with pytest.raises(ToolValidationError, match="must be a JSON object, got array"):
        decode_arguments(calls[0]["function"]["arguments"])

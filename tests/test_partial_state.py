"""A streamed round's partial state (`cq:partial:<sk>`) carries its thinking and each tool
call's name and argument text while the round streams, for each protocol with a streaming
adapter: SSE events go one at a time through the protocol's assembler into PartialState (as
the HTTP edge feeds them) and the store is read between events. Writes stay throttled."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from schemas.partial import PartialCall, PartialRound
from worker.codecs.anthropic import AnthropicCodec
from worker.codecs.gemini import GeminiCodec
from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.protocol import ChatRequest, Codec, Delta, SseEvent
from worker.session import model_call
from worker.session.model_call import PartialState
from worker.session.store_ports import SessionStore
from worker.session.twins.store import MemoryStore

SK = "sk-partial"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
REQUEST = ChatRequest(
    model="m", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=True
)


def openai_events() -> list[SseEvent]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> SseEvent:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        return SseEvent(event="message", data=json.dumps({**body, "choices": [choice]}))

    def call(index: int, **function: str) -> dict[str, Any]:
        extra = {"id": f"call_{index}", "type": "function"} if "name" in function else {}
        return {"tool_calls": [{"index": index, **extra, "function": function}]}

    return [
        chunk({"role": "assistant", "reasoning_content": "Paris, "}),
        chunk({"reasoning_content": "then Rome."}),
        chunk({"content": "Checking."}),
        chunk(call(0, name="get_weather", arguments="")),
        chunk(call(0, arguments='{"city": "Pa')),  # mid-stream: after this event
        chunk(call(0, arguments='ris"}')),
        chunk(call(1, name="get_weather", arguments='{"city": "Rome"}')),
        chunk({}, finish="tool_calls"),
        SseEvent(event="message", data="[DONE]"),
    ]


def anthropic_events() -> list[SseEvent]:
    def event(kind: str, **data: Any) -> SseEvent:
        return SseEvent(event=kind, data=json.dumps({"type": kind, **data}))

    message: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [], "stop_reason": None, "usage": {"input_tokens": 5}}  # fmt: skip
    return [
        event("message_start", message=message),
        event("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}),
        event("content_block_delta", index=0,
              delta={"type": "thinking_delta", "thinking": "Paris, "}),
        event("content_block_delta", index=0,
              delta={"type": "thinking_delta", "thinking": "then Rome."}),
        event("content_block_stop", index=0),
        event("content_block_start", index=1, content_block={"type": "text", "text": ""}),
        event("content_block_delta", index=1, delta={"type": "text_delta", "text": "Checking."}),
        event("content_block_stop", index=1),
        event("content_block_start", index=2, content_block={
            "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}),
        event("content_block_delta", index=2,
              delta={"type": "input_json_delta", "partial_json": '{"city": "Pa'}),  # mid-stream
        event("content_block_delta", index=2,
              delta={"type": "input_json_delta", "partial_json": 'ris"}'}),
        event("content_block_stop", index=2),
        event("content_block_start", index=3, content_block={
            "type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}),
        event("content_block_delta", index=3,
              delta={"type": "input_json_delta", "partial_json": '{"city": "Rome"}'}),
        event("content_block_stop", index=3),
        event("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 9}),
        event("message_stop"),
    ]  # fmt: skip


def gemini_events() -> list[SseEvent]:
    def chunk(*parts: dict[str, Any], finish: str | None = None) -> SseEvent:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": list(parts)}}
        if finish:
            candidate["finishReason"] = finish
        return SseEvent(event="message", data=json.dumps({"candidates": [candidate]}))

    weather = {"name": "get_weather", "args": {"city": "Paris"}}
    return [
        chunk({"text": "Paris, ", "thought": True}),
        chunk({"text": "then Rome.", "thought": True}),
        chunk({"text": "Checking."}),
        chunk({"functionCall": weather}),  # mid-stream: a call comes whole
        chunk({"functionCall": {"name": "get_weather", "args": {"city": "Rome"}}}),
        chunk({"text": ""}, finish="STOP"),
    ]


# (codec, its events, the event after which the round is looked at, the calls seen by then)
CASES = {
    "openai": (OpenAICodec(), openai_events, 4, (PartialCall("get_weather", '{"city": "Pa'),)),
    "anthropic": (
        AnthropicCodec(),
        anthropic_events,
        9,
        (PartialCall("get_weather", '{"city": "Pa'),),
    ),
    "gemini": (GeminiCodec(), gemini_events, 3, (PartialCall("get_weather", '{"city": "Paris"}'),)),
}


@pytest.mark.parametrize("protocol", sorted(CASES))
def test_the_partial_state_carries_thinking_and_tool_call_arguments_mid_stream(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_call, "PARTIAL_EVERY_S", 0.0)  # every delta written: read each
    codec, events, middle, calls = CASES[protocol]
    store = MemoryStore()
    partial = PartialState(cast(SessionStore, store), SK)
    assembler = cast(Codec, codec).assembler(REQUEST)
    for n, event in enumerate(events()):
        for delta in assembler.feed(event):
            partial(delta)
        if n == middle:
            assert store.partials[SK] == PartialRound("Checking.", "Paris, then Rome.", calls)
    assert assembler.finished
    both = (
        PartialCall("get_weather", '{"city": "Paris"}'),
        PartialCall("get_weather", '{"city": "Rome"}'),
    )
    assert json.loads(store.partials[SK].encode()) == {
        "text": "Checking.",
        "thinking": "Paris, then Rome.",
        "tool_calls": [c.to_json() for c in both],
    }
    assert [
        c["function"]["name"] for c in assembler.result()["choices"][0]["message"]["tool_calls"]
    ] == ["get_weather"] * 2
    partial.close()
    assert SK not in store.partials


class CountingStore:
    def __init__(self) -> None:
        self.writes: list[PartialRound | None] = []

    def set_partial(self, sk: str, value: PartialRound | None) -> None:
        self.writes.append(value)


def test_writes_stay_throttled_and_a_restart_starts_the_state_over() -> None:
    store = CountingStore()
    partial = PartialState(cast(SessionStore, store), SK)
    for n in range(200):  # far faster than PARTIAL_EVERY_S: one write, at the first delta
        partial(Delta("tool_call", "x", n % 2, "f" if n < 2 else ""))
    assert store.writes == [PartialRound(tool_calls=(PartialCall("f", "x"),))]
    assert partial.state().tool_calls == (PartialCall("f", "x" * 100), PartialCall("f", "x" * 100))
    partial(Delta("restart", ""))
    partial(Delta("reasoning", "again"))
    assert partial.state() == PartialRound(thinking="again")


def test_a_stored_value_that_is_not_the_json_object_reads_as_text() -> None:
    assert PartialRound.decode(b"plain text so far") == PartialRound(text="plain text so far")
    assert PartialRound.decode(b'["x"]') == PartialRound(text='["x"]')
    shown = PartialRound("a", "b", (PartialCall("f", '{"x'),))
    assert PartialRound.decode(shown.encode()) == shown
    assert shown.status_fields() == {
        "partial_text": "a",
        "partial_thinking": "b",
        "partial_tool_calls": [{"name": "f", "arguments": '{"x'}],
    }
    assert PartialRound("a").status_fields() == {"partial_text": "a"}

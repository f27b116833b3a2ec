"""OpenAI streaming assembly (tool-call fragments, finish and usage chunks, errors inside
the stream, truncation, [DONE]) and the OpenAI `Codec` (encode rules, reasoning sent back only
when asked, the tool-choice mapping).

Each stream is replayed as SSE bytes through SseParser and the assembler; its result must
equal `normalize_completion` of the reply the same round would have had without streaming.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from schemas.spec_types import INVALID_CALL_NAME
from worker.codecs.openai_chat import normalize_completion, tool_calls_of
from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.openai_stream import OpenAIStreamAssembler
from worker.codecs.protocol import ChatRequest, Delta, SseEvent
from worker.codecs.sse import SseParser
from worker.errors import (
    ProviderError,
    ProviderProtocolError,
    ProviderRequestError,
    ProviderRetryableError,
)

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
TOP = {
    "id": "chatcmpl-B9x",
    "created": 1718000000,
    "model": "gpt-4o-mini-2024-07-18",
    "system_fingerprint": "fp_0ba0d124f1",
}
USAGE = {
    "prompt_tokens": 82,
    "completion_tokens": 17,
    "total_tokens": 99,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        **TOP,
        "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}],
        "usage": None,
    }


def usage_chunk(usage: dict[str, Any] = USAGE) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", **TOP, "choices": [], "usage": usage}


def frag(index: int | None = None, **fields: Any) -> dict[str, Any]:
    """One delta.tool_calls entry: frag(0, id=..., name=..., args=...)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    if "id" in fields:
        out["id"] = fields["id"]
        out["type"] = "function"
    fn = {k: fields[k] for k in ("name",) if k in fields}
    if "args" in fields:
        fn["arguments"] = fields["args"]
    if fn:
        out["function"] = fn
    return out


def sse(*chunks: Any, done: bool = True) -> bytes:
    lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def run(body: bytes, assembler: OpenAIStreamAssembler | None = None) -> Any:
    asm = assembler or OpenAIStreamAssembler()
    parser = SseParser()
    deltas: list[Delta] = []
    for event in parser.feed(body) + parser.close():
        deltas.extend(asm.feed(event))
    return asm, deltas


def streamed(*chunks: Any, done: bool = True) -> dict[str, Any]:
    asm, _ = run(sse(*chunks, done=done))
    assert asm.finished is done
    result: dict[str, Any] = asm.result()
    return result


def non_streamed(
    message: dict[str, Any], finish: str, usage: dict[str, Any] | None = USAGE
) -> dict[str, Any]:
    """The same round without streaming, normalised."""
    raw = {
        "object": "chat.completion",
        **TOP,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
    }
    return normalize_completion(raw)


def call(call_id: str, name: str, args: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def calls_message(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


ROLE = chunk({"role": "assistant", "content": None})


# Streamed tool calls, usage, reasoning, errors and truncation --------------------------------


def test_first_fragment_has_id_and_name_later_ones_only_arguments() -> None:
    got = streamed(
        ROLE,
        chunk({"tool_calls": [frag(0, id="call_a", name="get_weather", args="")]}),
        chunk({"tool_calls": [frag(0, args='{"city":')]}),
        chunk({"tool_calls": [frag(0, args=' "Paris"')]}),
        chunk({"tool_calls": [frag(0, args="}")]}),
        chunk(finish="tool_calls"),
        usage_chunk(),
    )
    expected = non_streamed(
        calls_message(call("call_a", "get_weather", '{"city": "Paris"}')), "tool_calls"
    )
    assert got == expected
    assert tool_calls_of(got)[0]["function"]["arguments"] == '{"city": "Paris"}'


def test_interleaved_calls_keep_separate_buffers_ordered_by_index() -> None:
    got = streamed(
        ROLE,
        chunk({"tool_calls": [frag(1, id="call_b", name="get_time", args="")]}),
        chunk({"tool_calls": [frag(0, id="call_a", name="get_weather", args="")]}),
        chunk({"tool_calls": [frag(1, args='{"tz":')]}),
        chunk({"tool_calls": [frag(0, args='{"city":')]}),
        chunk({"tool_calls": [frag(1, args='"CET"}')]}),
        chunk({"tool_calls": [frag(0, args='"Oslo"}')]}),
        chunk(finish="tool_calls"),
        usage_chunk(),
    )
    assert got == non_streamed(
        calls_message(
            call("call_a", "get_weather", '{"city":"Oslo"}'),
            call("call_b", "get_time", '{"tz":"CET"}'),
        ),
        "tool_calls",
    )


def test_twenty_interleaved_fragments_assemble_exactly() -> None:
    args = {
        0: json.dumps({"path": "/srv/data/report 2024.csv", "limit": 50, "cols": ["a", "b"]}),
        1: json.dumps({"query": 'name = "Zoë" AND {x,y}', "page": 2}, ensure_ascii=False),
    }
    pieces: dict[int, list[str]] = {}
    for i, text in args.items():
        size = -(-len(text) // 10)  # ten fragments, cut anywhere (inside strings and escapes)
        pieces[i] = [text[k * size : (k + 1) * size] for k in range(10)]
        assert "".join(pieces[i]) == text and all(pieces[i])
    chunks: list[Any] = [
        ROLE,
        chunk({"tool_calls": [frag(0, id="call_r", name="read_file", args="")]}),
        chunk({"tool_calls": [frag(1, id="call_s", name="search", args="")]}),
    ]
    for k in range(10):  # 20 argument fragments, indices 0 and 1 alternating
        chunks.append(chunk({"tool_calls": [frag(0, args=pieces[0][k])]}))
        chunks.append(chunk({"tool_calls": [frag(1, args=pieces[1][k])]}))
    chunks += [chunk(finish="tool_calls"), usage_chunk()]
    got = streamed(*chunks)
    expected = non_streamed(
        calls_message(call("call_r", "read_file", args[0]), call("call_s", "search", args[1])),
        "tool_calls",
    )
    assert got == expected
    assert [c["function"]["arguments"] for c in tool_calls_of(got)] == [args[0], args[1]]


def test_same_index_twice_in_one_chunk_is_merged() -> None:
    # openai-python #3201: the first chunk carries two entries for index 0
    got = streamed(
        chunk(
            {
                "role": "assistant",
                "tool_calls": [
                    frag(0, id="call_a", name="list_files", args=""),
                    frag(0, args='{"dir":'),
                ],
            }
        ),
        chunk({"tool_calls": [frag(0, args='"/tmp"}'), frag(1, id="call_b", name="f", args="{}")]}),
        chunk(finish="tool_calls"),
        usage_chunk(),
    )
    assert got == non_streamed(
        calls_message(call("call_a", "list_files", '{"dir":"/tmp"}'), call("call_b", "f", "{}")),
        "tool_calls",
    )


def test_repeated_id_type_name_are_assigned_not_appended() -> None:
    got = streamed(
        chunk({"tool_calls": [frag(0, id="call_a", name="get_weather", args='{"ci')]}),
        chunk({"tool_calls": [frag(0, id="call_a", name="get_weather", args='ty":"Rome"}')]}),
        chunk(finish="tool_calls"),
    )
    assert tool_calls_of(got) == [call("call_a", "get_weather", '{"city":"Rome"}')]


def test_a_name_split_in_pieces_is_appended() -> None:
    got = streamed(
        chunk({"tool_calls": [frag(0, id="call_a", name="get_current_", args="")]}),
        chunk({"tool_calls": [frag(0, name="weather", args="{}")]}),
        chunk(finish="tool_calls"),
    )
    assert tool_calls_of(got) == [call("call_a", "get_current_weather", "{}")]


def test_no_index_new_id_opens_a_slot_no_id_continues_the_last() -> None:
    got = streamed(
        chunk({"tool_calls": [frag(id="call_1", name="a", args='{"x"')]}),
        chunk({"tool_calls": [frag(args=":1}")]}),
        chunk({"tool_calls": [frag(id="call_2", name="b", args="")]}),
        chunk({"tool_calls": [frag(id="call_2", args='{"y":')]}),  # a repeated id continues
        chunk({"tool_calls": [frag(args="2}")]}),
        chunk(finish="tool_calls"),
        usage_chunk(),
    )
    assert got == non_streamed(
        calls_message(call("call_1", "a", '{"x":1}'), call("call_2", "b", '{"y":2}')),
        "tool_calls",
    )


def test_calls_without_any_id_get_the_non_streamed_synthetic_ids() -> None:
    # litellm #11262 (Ollama): no ids at all; the ids synthesised must match non-streaming
    got = streamed(
        chunk({"tool_calls": [{"index": 0, "function": {"name": "a", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"name": "a", "arguments": "{}"}}]}),
        chunk(finish="tool_calls"),
    )
    bare = {"function": {"name": "a", "arguments": "{}"}}
    assert got == non_streamed(calls_message(bare, bare), "tool_calls", usage=None)
    ids = [c["id"] for c in tool_calls_of(got)]
    assert all(CALL_ID.match(i) for i in ids) and ids[0] != ids[1]


def test_whole_call_in_one_chunk() -> None:
    got = streamed(
        chunk(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [frag(0, id="call_a", name="get_weather", args='{"city":"Paris"}')],
            },
            finish="tool_calls",
        ),
        usage_chunk(),
    )
    assert got == non_streamed(
        calls_message(call("call_a", "get_weather", '{"city":"Paris"}')), "tool_calls"
    )


def test_arguments_sent_as_an_object_are_serialised() -> None:
    got = streamed(
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "c", "function": {"name": "f", "arguments": {"a": 1}}}
                ]
            }
        ),
        chunk(finish="stop"),
    )
    assert tool_calls_of(got) == [call("c", "f", '{"a":1}')]


def test_finish_chunk_then_usage_chunk_with_empty_choices() -> None:
    got = streamed(
        ROLE,
        chunk({"content": "Hello"}),
        chunk({"content": " there."}),
        {
            "object": "chat.completion.chunk",
            **TOP,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        },
        usage_chunk(),
    )
    assert got == non_streamed({"role": "assistant", "content": "Hello there."}, "stop")
    assert got["usage"] == USAGE


def test_usage_only_from_the_usage_chunk() -> None:
    partial = {"prompt_tokens": 82, "completion_tokens": 3, "total_tokens": 85}
    first = chunk({"content": "Hi"})
    first["usage"] = partial  # continuous usage stats on a content chunk
    got = streamed(first, chunk(finish="stop"), usage_chunk())
    assert got["usage"] == USAGE


def test_without_include_usage_usage_is_zero() -> None:
    got = streamed(chunk({"content": "Hi"}), chunk(finish="stop"))
    assert got["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def test_reasoning_deltas_kept_apart_from_content() -> None:
    for name in ("reasoning", "reasoning_content"):
        asm, deltas = run(
            sse(
                chunk({"role": "assistant", name: "Need the "}),
                chunk({name: "tool..."}),
                chunk({"content": "It is 4."}),
                chunk(finish="stop"),
                usage_chunk(),
            )
        )
        assert deltas == [
            Delta("reasoning", "Need the "),
            Delta("reasoning", "tool..."),
            Delta("content", "It is 4."),
        ]
        message = {"role": "assistant", "content": "It is 4.", name: "Need the tool..."}
        assert asm.result() == non_streamed(message, "stop")


def test_reasoning_then_tool_call() -> None:
    got = streamed(
        chunk({"role": "assistant", "content": None, "reasoning_content": "Call it."}),
        chunk({"tool_calls": [frag(0, id="call_a", name="f", args="{}")]}),
        chunk(finish="tool_calls"),
    )
    message = got["choices"][0]["message"]
    assert message["reasoning_content"] == "Call it."
    assert message["content"] is None
    assert got["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("error", "kind", "status"),
    [
        ({"message": "upstream timeout", "code": 504}, ProviderRetryableError, 504),
        ({"message": "Rate limited", "code": "429"}, ProviderRetryableError, 429),
        (
            {"message": "Provider disconnected", "code": "server_error"},
            ProviderRetryableError,
            None,
        ),
        ({"message": "Overloaded", "type": "overloaded_error"}, ProviderRetryableError, None),
        ("upstream connect error", ProviderRetryableError, None),
        ({"message": "bad tool schema", "code": 400}, ProviderRequestError, 400),
        ({"message": "too long", "code": "context_length_exceeded"}, ProviderRequestError, None),
    ],
)
def test_error_object_inside_the_stream(
    error: Any, kind: type[ProviderError], status: int | None
) -> None:
    asm = OpenAIStreamAssembler()
    body = sse(chunk({"content": "par"}), {"error": error})
    with pytest.raises(kind) as info:
        run(body, asm)
    assert type(info.value) is kind
    assert info.value.status == status
    assert info.value.message.startswith("error in stream: ")
    assert not asm.finished


def test_error_event_without_json() -> None:
    with pytest.raises(ProviderRetryableError, match="error in stream: upstream reset"):
        run(b"event: error\ndata: upstream reset\n\n")


def test_openrouter_error_chunk_with_choices() -> None:
    body = {
        **chunk(finish="error"),
        "error": {"code": 502, "message": "Provider returned error"},
    }
    with pytest.raises(ProviderRetryableError) as info:
        run(sse(chunk({"content": "x"}), body))
    assert info.value.status == 502


def test_stream_without_done_is_truncated() -> None:
    asm, _ = run(
        sse(chunk({"tool_calls": [frag(0, id="c", name="rm", args='{"path":"/tmp/a')]}), done=False)
    )
    assert not asm.finished
    with pytest.raises(ProviderProtocolError, match=r"without \[DONE\]"):
        asm.result()


def test_done_without_finish_reason_is_truncated() -> None:
    asm, _ = run(sse(chunk({"tool_calls": [frag(0, id="c", name="f", args="{}")]})))
    assert asm.finished
    with pytest.raises(ProviderProtocolError, match="without a finish_reason"):
        asm.result()
    with pytest.raises(ProviderProtocolError):
        streamed(done=True)  # [DONE] alone


def test_done_stops_reading() -> None:
    body = sse(chunk({"content": "a"}), chunk(finish="stop")) + sse(chunk({"content": "LATE"}))
    asm, deltas = run(body)
    assert deltas == [Delta("content", "a")]
    assert asm.result()["choices"][0]["message"]["content"] == "a"


def test_streamed_usage_normalised() -> None:
    got = streamed(
        chunk({"content": "x"}, finish="stop"),
        usage_chunk({"prompt_tokens": 10, "completion_tokens": 5.0, "cost": 0.1}),
    )
    assert got["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


# Other stream shapes -------------------------------------------------------------------------


def test_text_stream_deltas_and_result() -> None:
    asm, deltas = run(
        sse(
            chunk({"role": "assistant", "content": "", "refusal": None}),
            chunk({"content": "Grüße"}),
            chunk({"content": ", world"}),
            chunk(finish="length"),
            usage_chunk(),
        )
    )
    assert deltas == [Delta("content", "Grüße"), Delta("content", ", world")]
    assert asm.result() == non_streamed({"role": "assistant", "content": "Grüße, world"}, "length")


def test_text_and_tool_calls_together() -> None:
    got = streamed(
        chunk({"role": "assistant", "content": "Let me check."}),
        chunk({"tool_calls": [frag(0, id="call_a", name="f", args="{}")]}),
        chunk(finish="stop"),  # calls decide over "stop" in streams too
    )
    assert got == non_streamed(
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [call("call_a", "f", "{}")],
        },
        "stop",
        usage=None,
    )
    assert got["choices"][0]["finish_reason"] == "tool_calls"


def test_legacy_function_call_stream() -> None:
    got = streamed(
        chunk({"role": "assistant", "function_call": {"name": "f", "arguments": ""}}),
        chunk({"function_call": {"arguments": '{"x":1}'}}),
        chunk(finish="function_call"),
    )
    legacy = {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "f", "arguments": '{"x":1}'},
    }
    assert got == non_streamed(legacy, "function_call", usage=None)
    assert got["choices"][0]["finish_reason"] == "tool_calls"


def test_refusal_stream() -> None:
    got = streamed(
        chunk({"refusal": "I can't "}), chunk({"refusal": "help."}), chunk(finish="stop")
    )
    assert got["choices"][0]["message"]["refusal"] == "I can't help."


def test_other_choices_and_comments_ignored() -> None:
    other = chunk({"content": "OTHER"})
    other["choices"][0]["index"] = 1
    body = b": keep-alive\n\n" + sse(chunk({"content": "a"}), other, chunk(finish="stop"))
    asm, _ = run(body)
    assert asm.result()["choices"][0]["message"]["content"] == "a"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not json", "not JSON"),
        ("[" * 50_000 + "]" * 50_000, "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"choices": {"0": {}}}', "choices is not a list"),
        ('{"choices": [{"index": 0, "delta": {"tool_calls": {"a": 1}}}]}', "not a list"),
    ],
)
def test_unreadable_chunks(data: str, message: str) -> None:
    with pytest.raises(ProviderProtocolError, match=message):
        OpenAIStreamAssembler().feed(SseEvent("message", data))


def test_a_call_without_name_is_kept_for_the_loop_to_answer() -> None:
    """Issue 9: the model is told (VALIDATION_ERROR) rather than the session ended."""
    asm, _ = run(sse(chunk({"tool_calls": [{"index": 0, "id": "c"}]}), chunk(finish="tool_calls")))
    [call] = asm.result()["choices"][0]["message"]["tool_calls"]
    assert (call["id"], call["function"]["name"]) == ("c", INVALID_CALL_NAME)


def test_byte_split_stream_gives_the_same_result() -> None:
    body = sse(
        chunk({"role": "assistant", "content": "Zoë "}),
        chunk({"tool_calls": [frag(0, id="call_a", name="f", args='{"q":"€"}')]}),
        chunk(finish="tool_calls"),
        usage_chunk(),
    ).replace(b"\n", b"\r\n")
    whole, _ = run(body)
    for cut in range(0, len(body), 7):
        asm = OpenAIStreamAssembler()
        parser = SseParser()
        for event in parser.feed(body[:cut]) + parser.feed(body[cut:]) + parser.close():
            asm.feed(event)
        assert asm.result() == whole.result()


# OpenAICodec ---------------------------------------------------------------------------------

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = {"role": "user", "content": "Weather in Paris?"}


def request(**kw: Any) -> ChatRequest:
    kw.setdefault("messages", [USER])
    return ChatRequest(model="m", **kw)


def test_codec_encode_basic() -> None:
    wire = OpenAICodec().encode(request(params={"temperature": 0}))
    assert wire.path == "/chat/completions"
    assert wire.body == {"model": "m", "messages": [USER], "temperature": 0, "stream": False}
    assert wire.headers == {} and wire.query == {}


def test_codec_encode_stream_asks_for_usage() -> None:
    wire = OpenAICodec().encode(request(stream=True, params={"stream_options": {"x": 1}}))
    assert wire.body["stream"] is True
    assert wire.body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("choice", "wire"),
    [
        (None, None),
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_codec_tool_choice_table(choice: Any, wire: Any) -> None:
    body = OpenAICodec().encode(request(tools=[TOOL], tool_choice=choice)).body
    assert body["tools"] == [TOOL]
    assert body.get("tool_choice") == wire


def test_codec_parallel_tool_calls_passed() -> None:
    body = OpenAICodec().encode(request(tools=[TOOL], parallel_tool_calls=False)).body
    assert body["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in OpenAICodec().encode(request(tools=[TOOL])).body


def test_codec_tool_fields_dropped_without_tools() -> None:
    body = OpenAICodec().encode(request(tool_choice="required", parallel_tool_calls=False)).body
    assert "tools" not in body and "tool_choice" not in body and "parallel_tool_calls" not in body


def test_codec_bad_tool_choice() -> None:
    with pytest.raises(ProviderRequestError):
        OpenAICodec().encode(request(tools=[TOOL], tool_choice={"function": "x"}))


def test_codec_thinking_ignored_and_max_tokens() -> None:
    body = OpenAICodec().encode(request(thinking_budget_tokens=2048, max_tokens=300)).body
    assert body == {"model": "m", "messages": [USER], "max_tokens": 300, "stream": False}
    body = OpenAICodec().encode(request(max_tokens=300, params={"max_completion_tokens": 9})).body
    assert body["max_completion_tokens"] == 9 and "max_tokens" not in body


ASSISTANT = {
    "role": "assistant",
    "content": None,
    "reasoning_content": "The user wants weather.",
    "tool_calls": [call("call_a", "get_weather", {"city": "Paris"})],
    "_provider": {"anthropic": {"content": [{"type": "thinking", "signature": "Es..."}]}},
}
TOOL_MSG = {"role": "tool", "tool_call_id": "call_a", "content": "18C"}


def test_reasoning_not_replayed_by_default() -> None:
    wire = OpenAICodec().encode(request(messages=[USER, ASSISTANT, TOOL_MSG]))
    sent = wire.body["messages"][1]
    assert sent == {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("call_a", "get_weather", '{"city":"Paris"}')],
    }
    assert ASSISTANT["_provider"]  # the transcript itself is untouched
    vllm = {**ASSISTANT, "reasoning": "x"}
    del vllm["reasoning_content"]
    assert "reasoning" not in OpenAICodec().encode(request(messages=[vllm])).body["messages"][0]


def test_reasoning_replayed_when_asked_deepseek() -> None:
    wire = OpenAICodec().encode(
        request(messages=[USER, ASSISTANT, TOOL_MSG], params={"replay_reasoning": True})
    )
    sent = wire.body["messages"][1]
    assert sent["reasoning_content"] == "The user wants weather."
    assert "_provider" not in sent
    assert "replay_reasoning" not in wire.body
    assert wire.body["messages"][2] == TOOL_MSG


def test_codec_decode_and_assembler() -> None:
    codec = OpenAICodec()
    raw = {
        **TOP,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": USAGE,
    }
    assert codec.decode(raw, request()) == normalize_completion(raw)
    assert isinstance(codec.assembler(request(stream=True)), OpenAIStreamAssembler)
    assert codec.retry_after_s(429, {"error": {}}) is None
    assert codec.protocol == "openai"
    with pytest.raises(ProviderProtocolError):
        codec.decode({"error": {"message": "x"}}, request())

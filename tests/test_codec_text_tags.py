"""The `<tool_call>` text-tag codec: each case of docs/provider-conformance.md's text-tag list,
replayed both as a JSON reply (`decode`) and as an SSE stream (the assembler's `result()`
must equal `decode`)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest

from worker.codecs.openai_chat import decode_arguments, tool_calls_of
from worker.codecs.protocol import ChatRequest, Delta
from worker.codecs.sse import SseParser
from worker.codecs.text_tags import (
    INVALID_CALL_NAME,
    NO_CALLS_RULE,
    PROTOCOL,
    TextTagAssembler,
    TextTagCodec,
    VisibleText,
    render_messages,
)
from worker.errors import ToolValidationError

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object"}},
}
USER: dict[str, Any] = {"role": "user", "content": "Weather and time in Paris?"}
REQUEST = ChatRequest(model="qwen2.5-7b-instruct", messages=[USER], tools=[WEATHER, TIME])
CODEC = TextTagCodec()


def reply(content: str | None, finish: str = "stop", **message: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-local-1",
        "object": "chat.completion",
        "created": 1718000000,
        "model": "qwen2.5-7b-instruct",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **message},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340},
    }


def stream_result(
    content: str, pieces: int = 7, request: ChatRequest = REQUEST
) -> tuple[dict[str, Any], list[Delta]]:
    """The same reply streamed: content in `pieces`-char fragments, through SSE bytes."""
    head = {"id": "chatcmpl-local-1", "object": "chat.completion.chunk", "created": 1718000000}
    head["model"] = "qwen2.5-7b-instruct"
    chunks: list[dict[str, Any]] = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    ]
    for k in range(0, len(content), pieces):
        delta = {"content": content[k : k + pieces]}
        chunks.append({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340}
    chunks.append({**head, "choices": [], "usage": usage})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    assembler = CODEC.assembler(request)
    parser = SseParser()
    deltas: list[Delta] = []
    for event in parser.feed(body.encode()) + parser.close():
        deltas.extend(assembler.feed(event))
    assert assembler.finished
    return assembler.result(), deltas


def decoded(content: str, request: ChatRequest = REQUEST) -> dict[str, Any]:
    """decode, checked against the streamed result for several fragment sizes (tags split
    across chunks)."""
    got = CODEC.decode(reply(content), request)
    for pieces in (1, 3, 11, 10_000):
        assert stream_result(content, pieces, request)[0] == got
    return got


def message(completion: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = completion["choices"][0]["message"]
    return out


def names_args(completion: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls_of(completion)]


# Replies: blocks, bad blocks, fences, open tags, <think>, made-up results --------------------


def test_several_blocks_in_order_with_synthesised_ids() -> None:
    content = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    got = decoded(content)
    assert names_args(got) == [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    ids = [c["id"] for c in tool_calls_of(got)]
    assert all(CALL_ID.match(i) for i in ids) and len(set(ids)) == 2
    assert [c["type"] for c in tool_calls_of(got)] == ["function", "function"]
    assert got["choices"][0]["finish_reason"] == "tool_calls"
    assert message(got)["content"] is None
    assert message(got)["_provider"] == {PROTOCOL: {"content": content}}
    assert CODEC.decode(reply(content), REQUEST) == got  # deterministic ids
    assert got["usage"]["total_tokens"] == 340


def test_malformed_block_is_an_error_call_valid_blocks_kept() -> None:
    content = (
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>\n'
        '<tool_call>{"name":"get_time","arguments":{"tz":"CET"}</tool_call>\n'
        "<tool_call>{'name': 'get_weather', 'arguments': {'city': 'Nice', 'metric': True}}"
        "</tool_call>\n"
        "<tool_call>not json at all</tool_call>"
    )
    got = decoded(content)
    calls = tool_calls_of(got)
    assert len(calls) == 4
    assert names_args(got)[0] == ("get_weather", '{"city":"Paris"}')
    # the lenient second pass reads Python literals (the Hermes prompt shows them)
    assert names_args(got)[2] == ("get_weather", '{"city":"Nice","metric":true}')
    # a malformed block: its name is recovered, and the loop's argument check answers the call
    # with an invalid_arguments error result (the parser's message, resend valid JSON)
    assert calls[1]["function"]["name"] == "get_time"
    with pytest.raises(ToolValidationError, match=r"^invalid JSON arguments: Expecting ','"):
        decode_arguments(calls[1]["function"]["arguments"])
    # no name at all: a call the loop rejects as an unknown tool
    assert calls[3]["function"]["name"] == INVALID_CALL_NAME
    with pytest.raises(ToolValidationError):
        decode_arguments(calls[3]["function"]["arguments"])
    # the replay shows the model what it wrote
    assert message(got)["_provider"][PROTOCOL]["content"] == content


def test_valid_json_that_is_not_a_call() -> None:
    got = decoded('<tool_call>{"tool": "get_weather", "args": {"name": "x"}}</tool_call>')
    (call,) = tool_calls_of(got)
    assert call["function"]["name"] == INVALID_CALL_NAME  # never a name taken from the args
    with pytest.raises(ToolValidationError):
        decode_arguments(call["function"]["arguments"])
    got = decoded('<tool_call>{"name": "get_time", "arguments": 5}</tool_call>')
    with pytest.raises(ToolValidationError, match="must be a JSON object, got number"):
        decode_arguments(tool_calls_of(got)[0]["function"]["arguments"])


def test_tag_split_across_chunks_never_shown_half() -> None:
    content = (
        'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for pieces in range(1, len(content) + 1):
        got, deltas = stream_result(content, pieces)
        visible = "".join(d.text for d in deltas if d.kind == "content")
        assert visible == "Sure "
        assert all("<" not in d.text for d in deltas)
        assert got == CODEC.decode(reply(content), REQUEST)
    view = VisibleText()
    assert view.push("Sure <tool") == [Delta("content", "Sure ")]
    assert view.push('_call>\n{"na') == []
    assert view.push('me": "x"}</tool_') == []
    assert view.push("call> done <") == [Delta("content", " done ")]
    assert view.flush() == [Delta("content", "<")]


def test_a_false_start_is_released() -> None:
    view = VisibleText()
    assert view.push("a <tool") == [Delta("content", "a ")]
    assert view.push("box> b") == [Delta("content", "<toolbox> b")]


def test_tags_inside_a_code_fence_are_literal() -> None:
    content = (
        "Example:\n```xml\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>\n```\nDone.'
    )
    got = decoded(content)
    assert tool_calls_of(got) == []
    assert got == CODEC.decode(reply(content), REQUEST)
    assert message(got)["content"] == content  # nothing to act on: untouched
    _, deltas = stream_result(content, 4)
    assert "".join(d.text for d in deltas) == content


def test_inline_code_tag_is_prose() -> None:
    content = "Wrap each call in a `<tool_call>` tag."
    assert message(decoded(content)) == {"role": "assistant", "content": content}
    for pieces in (1, 2, 5):
        _, deltas = stream_result(content, pieces)
        assert "".join(d.text for d in deltas) == content


def test_a_fence_inside_the_tag_is_stripped() -> None:
    content = (
        '<tool_call>\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
        "</tool_call>"
    )
    assert names_args(decoded(content)) == [("get_weather", '{"city":"Paris"}')]


def test_missing_closing_tag_accepted_when_one_complete_object() -> None:
    content = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    got = decoded(content)
    assert names_args(got) == [("get_weather", '{"city":"Paris"}')]
    assert message(got)["content"] == "Checking."


@pytest.mark.parametrize(
    "rest",
    [
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut off
        '{"name": "get_weather", "arguments": {"city": "Paris"}',  # a brace short
        '{"name": "get_weather", "arguments": {}} and then some text',
    ],
)
def test_missing_closing_tag_otherwise_an_error(rest: str) -> None:
    (call,) = tool_calls_of(decoded("<tool_call>" + rest))
    assert call["function"]["name"] == "get_weather"
    # the loop's repair of truncated arguments would close the cut-off text into the
    # {"name", "arguments"} wrapper: the call must not run with that, so the loop's check has
    # to fail
    with pytest.raises(ToolValidationError, match=r"^invalid JSON arguments: "):
        decode_arguments(call["function"]["arguments"])


def test_key_variants() -> None:
    content = (
        '<tool_call>{"name": "get_weather", "parameters": {"city": "Rome"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
        '<tool_call>{"id": 7, "name": "get_time", "arguments": {}, "confidence": 0.9}</tool_call>'
        '<tool_call>{"name": "get_time"}</tool_call>'
        '<tool_call>{"type": "function", "function": {"name": "get_time", "arguments": "{}"}}'
        "</tool_call>"
    )
    got = decoded(content)
    assert names_args(got) == [
        ("get_weather", '{"city":"Rome"}'),
        ("get_weather", '{"city": "Oslo"}'),  # string arguments kept as text
        ("get_time", "{}"),
        ("get_time", "{}"),
        ("get_time", "{}"),
    ]
    assert decode_arguments(names_args(got)[1][1]) == {"city": "Oslo"}


def test_calls_inside_think_are_reported_not_executed() -> None:
    content = (
        '<think>I could call <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        " but the weather is enough.</think>\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    got = decoded(content)
    assert names_args(got) == [("get_weather", '{"city":"Paris"}')]
    reasoning = message(got)["reasoning_content"]
    assert reasoning.startswith("I could call <tool_call>")
    assert "1 <tool_call> block(s) inside <think> were not executed: get_time" in reasoning
    assert "<think>" not in message(got)["_provider"][PROTOCOL]["content"]
    _, deltas = stream_result(content, 5)
    assert (
        "".join(d.text for d in deltas if d.kind == "reasoning") == content[7:].split("</think>")[0]
    )
    assert [d for d in deltas if d.kind == "content"] == [Delta("content", "\n")]


def test_only_calls_inside_think_gives_an_answer_not_a_call() -> None:
    got = decoded('<think><tool_call>{"name": "get_time"}</tool_call></think>It is noon.')
    assert tool_calls_of(got) == []
    assert message(got)["content"] == "It is noon."
    assert got["choices"][0]["finish_reason"] == "stop"
    assert "not executed: get_time" in message(got)["reasoning_content"]


def test_template_opened_think() -> None:
    # Qwen3/DeepSeek-R1 templates write <think> into the prompt: the reply starts inside it
    got = decoded("The user wants weather.\n</think>\n\nIt is sunny.")
    assert message(got)["content"] == "It is sunny."
    assert message(got)["reasoning_content"] == "The user wants weather."


def test_server_reasoning_kept() -> None:
    raw = reply("<think>more</think>ok", reasoning_content="split by the server")
    assert message(CODEC.decode(raw, REQUEST))["reasoning_content"] == "split by the server\n\nmore"


def test_preamble_kept_and_fabricated_response_cut() -> None:
    content = (
        "Let me check the weather.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_response>\n{"name": "get_weather", "content": "sunny"}\n</tool_response>\n'
        "It is sunny in Paris."
    )
    got = decoded(content)
    assert message(got)["content"] == "Let me check the weather."
    assert names_args(got) == [("get_weather", '{"city":"Paris"}')]
    replay = message(got)["_provider"][PROTOCOL]["content"]
    assert replay.endswith("</tool_call>") and "sunny" not in replay
    _, deltas = stream_result(content, 6)
    assert "".join(d.text for d in deltas) == "Let me check the weather.\n\n"


def test_plain_answer_untouched() -> None:
    got = decoded("Paris is sunny, 18C. Use <b>tags</b> < and > freely.")
    assert got == CODEC.decode(
        reply("Paris is sunny, 18C. Use <b>tags</b> < and > freely."), REQUEST
    )
    assert message(got) == {
        "role": "assistant",
        "content": "Paris is sunny, 18C. Use <b>tags</b> < and > freely.",
    }


def test_native_tool_calls_win() -> None:
    native = {
        "id": "call_n",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{}"},
    }
    raw = reply('<tool_call>{"name": "get_weather"}</tool_call>', tool_calls=[native])
    got = CODEC.decode(raw, REQUEST)
    assert tool_calls_of(got) == [native]


def test_tool_choice_none_or_no_tools_leaves_tags_as_text() -> None:
    content = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for request in (
        ChatRequest(model="m", messages=[USER], tools=[TIME], tool_choice="none"),
        ChatRequest(model="m", messages=[USER]),
    ):
        got = decoded(content, request)
        assert tool_calls_of(got) == []
        assert message(got)["content"] == content


def test_length_cut_call_is_kept_as_length() -> None:
    got = CODEC.decode(reply('<tool_call>{"name": "get_time", "arguments": {}}', "length"), REQUEST)
    # a call cut off by the token limit: the loop will not run it
    assert got["choices"][0]["finish_reason"] == "length"


# Requests: results as <tool_response> blocks in one user turn; the system prompt -------------


def test_encode_tools_in_the_system_prompt_not_in_a_field() -> None:
    system = {"role": "system", "content": "You are terse."}
    request = ChatRequest(model="m", messages=[system, USER], tools=[WEATHER, TIME], stream=True)
    wire = CODEC.encode(request)
    body = wire.body
    assert wire.path == "/chat/completions"
    assert "tools" not in body and "tool_choice" not in body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    first, rest = body["messages"][0], body["messages"][1:]
    assert rest == [USER]
    assert first["role"] == "system"
    prompt = first["content"]
    assert prompt.startswith("You are terse.\n\n# Tools")
    listed = [
        json.loads(line)
        for line in prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    ]
    assert listed == [
        {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": WEATHER["function"]["parameters"],
        },
        {"name": "get_time", "parameters": {"type": "object"}},
    ]
    assert '<tool_call>\n{"name": "<function-name>", "arguments":' in prompt
    assert "one <tool_call> block per call" in prompt and "<tool_response>" in prompt
    assert "only when it helps" in prompt


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        ("required", None, "You must call at least one function"),
        ({"name": "get_time"}, None, 'You must call the function "get_time" in this turn'),
        ("auto", False, "call at most one function per turn"),
    ],
)
def test_encode_tool_choice_in_the_prompt(choice: Any, parallel: Any, expected: str) -> None:
    request = ChatRequest(
        model="m", messages=[USER], tools=[TIME], tool_choice=choice, parallel_tool_calls=parallel
    )
    body = CODEC.encode(request).body
    assert expected in body["messages"][0]["content"]
    assert "parallel_tool_calls" not in body


def test_encode_tool_choice_none_drops_the_instructions() -> None:
    system = {"role": "system", "content": "Be brief."}
    body = CODEC.encode(
        ChatRequest(model="m", messages=[system, USER], tools=[TIME], tool_choice="none")
    ).body
    # the tool list goes; one line says that no call is wanted now
    told = {"role": "system", "content": f"Be brief.\n\n{NO_CALLS_RULE}"}
    assert body["messages"] == [told, USER]
    assert CODEC.encode(ChatRequest(model="m", messages=[USER])).body["messages"] == [USER]


ASSISTANT: dict[str, Any] = {
    "role": "assistant",
    "content": "Checking.",
    "reasoning_content": "weather first",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
    ],
}
RESULTS: list[dict[str, Any]] = [
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": {"time": "12:00"}},
]


def test_tool_results_as_one_user_turn_of_tool_responses_in_order() -> None:
    messages = [USER, ASSISTANT, *RESULTS, {"role": "user", "content": "Thanks"}]
    body = CODEC.encode(ChatRequest(model="m", messages=messages, tools=[WEATHER, TIME])).body
    sent = body["messages"][1:]
    assert [m["role"] for m in sent] == ["user", "assistant", "user", "user"]
    assert sent[1] == {
        "role": "assistant",
        "content": "Checking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    }  # no tool_calls field, reasoning not replayed
    assert sent[2] == {
        "role": "user",
        "content": "<tool_response>\n"
        '{"name": "get_weather", "content": "18C, sunny"}\n'
        "</tool_response>\n"
        "<tool_response>\n"
        '{"name": "get_time", "content": "{\\"time\\":\\"12:00\\"}"}\n'
        "</tool_response>",
    }
    assert sent[3] == {"role": "user", "content": "Thanks"}


def test_replay_uses_the_turn_as_written() -> None:
    content = '<tool_call>{"name":"get_time","arguments":{"tz":"CET"}</tool_call>'
    turn = message(CODEC.decode(reply(content), REQUEST))
    call_id = turn["tool_calls"][0]["id"]
    result = {"role": "tool", "tool_call_id": call_id, "content": "invalid JSON arguments: ..."}
    body = CODEC.encode(ChatRequest(model="m", messages=[USER, turn, result], tools=[TIME])).body
    assert body["messages"][2] == {"role": "assistant", "content": content}
    assert json.loads(body["messages"][3]["content"].split("\n")[1])["name"] == "get_time"


def test_round_trip_reply_to_transcript_to_wire() -> None:
    content = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    turn = message(CODEC.decode(reply(content), REQUEST))
    body = CODEC.encode(ChatRequest(model="m", messages=[USER, turn], tools=[TIME])).body
    assert body["messages"][2] == {"role": "assistant", "content": content}


def test_stream_result_equals_decode_for_every_case() -> None:
    samples = [
        "plain",
        "<think>a</think>b",
        'x <tool_call>{"name": "get_time"}</tool_call> y <tool_response>z',
        "```\n<tool_call>x</tool_call>\n``` and <tool_call>{'name': 'get_time'}</tool_call>",
    ]
    for content in samples:
        assert decoded(content) == CODEC.decode(reply(content), REQUEST)


def test_assembler_type() -> None:
    assert isinstance(CODEC.assembler(REQUEST), TextTagAssembler)
    assert CODEC.protocol == "openai-text-tags"
    assert CODEC.retry_after_s(503, None) is None


def test_hostile_blocks_do_not_crash() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    for body in (deep, "{'name': 'get_time', 'arguments': {'x': {1, 2}}}", "{" * 300):
        (call,) = tool_calls_of(CODEC.decode(reply(f"<tool_call>{body}</tool_call>"), REQUEST))
        with pytest.raises(ToolValidationError):
            decode_arguments(call["function"]["arguments"])


def test_tool_choice_none_tells_the_model_to_answer_without_calls() -> None:
    """Issue 9's final answer after a limit: the history shows <tool_call> blocks, so a model
    that reads tags is told that none are wanted now (and no tool list is sent)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    request = ChatRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="none"
    )
    [system, _] = render_messages(request)
    assert system == {"role": "system", "content": NO_CALLS_RULE}
    auto = render_messages(replace(request, tool_choice="auto"))
    assert NO_CALLS_RULE not in auto[0]["content"] and "<tools>" in auto[0]["content"]

"""OpenAI chat codec: each case of docs/provider-conformance.md's list of non-streamed
OpenAI-compatible replies.

An unknown tool name and tool-message ordering belong to the session engine and are tested
there; text beside tool calls is tested here only for what the codec must keep.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from schemas.spec_types import INVALID_CALL_NAME
from worker.codecs.openai_chat import (
    build_request,
    content_text,
    decode_arguments,
    is_empty_reply,
    is_truncated,
    normalize_completion,
    tool_calls_of,
    tool_message_content,
    tool_result_text,
)
from worker.errors import ProviderProtocolError, ToolValidationError

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def reply(
    message: dict[str, Any], finish_reason: str | None = "stop", **top: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    }
    body.update(top)
    return body


def call(name: str = "f", arguments: Any = "{}", **extra: Any) -> Any:
    return {
        "id": "call_a",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
        **extra,
    }


def calls_reply(*calls: Any, finish_reason: str = "tool_calls") -> dict[str, Any]:
    return reply({"role": "assistant", "content": None, "tool_calls": list(calls)}, finish_reason)


def only_call(raw: dict[str, Any]) -> dict[str, Any]:
    calls = tool_calls_of(normalize_completion(raw))
    assert len(calls) == 1
    return calls[0]


# Non-streamed replies: arguments, ids, types, finish reasons, tool output, reasoning, usage --


def test_empty_arguments() -> None:
    assert only_call(calls_reply(call(arguments="")))["function"]["arguments"] == "{}"
    assert only_call(calls_reply(call(arguments=None)))["function"]["arguments"] == "{}"
    assert decode_arguments("") == {}
    assert decode_arguments("  \n") == {}


def test_invalid_json_arguments() -> None:
    raw = '{"city": "Paris", "days": }'
    # The raw text is kept in the normalised reply: the replay stays byte-faithful.
    assert only_call(calls_reply(call(arguments=raw)))["function"]["arguments"] == raw
    with pytest.raises(ToolValidationError) as info:
        decode_arguments(raw)
    assert info.value.code == "VALIDATION_ERROR"
    assert info.value.message.startswith("invalid JSON arguments: Expecting value")
    assert info.value.message.endswith(", resend valid JSON")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ('{"city": "Paris"', {"city": "Paris"}),  # truncated: closed
        ('{"city": "Par', {"city": "Par"}),  # open string closed too
        ('{"a": [1, 2', {"a": [1, 2]}),
        ('{"a": 1,', {"a": 1}),  # dangling comma dropped
        ('```json\n{"city": "Paris"}\n```', {"city": "Paris"}),  # fences
        ('```\n{"city": "Paris"}\n```', {"city": "Paris"}),
        ('```{"city": "Paris"}```', {"city": "Paris"}),
    ],
)
def test_cheap_repair(raw: str, expected: dict[str, Any]) -> None:
    assert decode_arguments(raw) == expected


@pytest.mark.parametrize("raw", ['{"a": 1}}', '{"a": ]', "{'a': 1}", '{"a" 1}', "not json"])
def test_no_repair_when_malformed_not_truncated(raw: str) -> None:
    with pytest.raises(ToolValidationError, match=r"^invalid JSON arguments: .*resend valid JSON$"):
        decode_arguments(raw)


def test_arguments_already_object() -> None:
    got = only_call(calls_reply(call(arguments={"city": "Paris", "n": [1, 2]})))
    assert got["function"]["arguments"] == '{"city":"Paris","n":[1,2]}'
    assert decode_arguments(got["function"]["arguments"]) == {"city": "Paris", "n": [1, 2]}


def test_double_encoded_arguments() -> None:
    raw = json.dumps(json.dumps({"city": "Paris"}))
    assert decode_arguments(raw) == {"city": "Paris"}


@pytest.mark.parametrize(
    ("raw", "kind"),
    [('["Paris"]', "array"), ('"Paris"', "string"), ("3", "number"), ("true", "boolean")],
)
def test_valid_json_not_object(raw: str, kind: str) -> None:
    with pytest.raises(ToolValidationError) as info:
        decode_arguments(raw)
    assert info.value.message == f"tool arguments must be a JSON object, got {kind}"


def test_null_is_no_arguments() -> None:
    assert decode_arguments("null") == {}


def test_missing_or_empty_id() -> None:
    missing = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    raw = calls_reply(missing, call(id=""))
    first = tool_calls_of(normalize_completion(raw))
    assert [CALL_ID.match(c["id"]) is not None for c in first] == [True, True]
    assert first[0]["id"] != first[1]["id"]
    # Deterministic: a redelivered step normalising the same reply gets the same ids.
    assert tool_calls_of(normalize_completion(raw)) == first


def test_duplicate_ids_renamed() -> None:
    raw = calls_reply(call(id="call_0"), call(id="call_0"), call(id="call_0"), call(id="x"))
    assert [c["id"] for c in tool_calls_of(normalize_completion(raw))] == [
        "call_0",
        "call_0_2",
        "call_0_3",
        "x",
    ]


def test_renamed_id_never_clashes() -> None:
    raw = calls_reply(call(id="a"), call(id="a"), call(id="a_2"))
    ids = [c["id"] for c in tool_calls_of(normalize_completion(raw))]
    assert ids == ["a", "a_3", "a_2"]


def test_missing_type_defaults_to_function() -> None:
    raw = calls_reply({"id": "c1", "function": {"name": "f", "arguments": "{}"}})
    assert only_call(raw) == {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }


def test_text_and_tool_calls_together() -> None:
    raw = reply({"role": "assistant", "content": "Let me check.", "tool_calls": [call()]})
    message = normalize_completion(raw)["choices"][0]["message"]
    assert message["content"] == "Let me check."
    assert len(message["tool_calls"]) == 1


def test_stop_with_tool_calls_means_tool_calls() -> None:
    completion = normalize_completion(calls_reply(call(), finish_reason="stop"))
    assert completion["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_finish_without_calls() -> None:
    text = normalize_completion(reply({"role": "assistant", "content": "Hi"}, "tool_calls"))
    assert text["choices"][0]["finish_reason"] == "stop"
    assert not is_empty_reply(text)
    empty = normalize_completion(reply({"role": "assistant", "content": None}, "tool_calls"))
    assert empty["choices"][0]["finish_reason"] == "stop"
    assert is_empty_reply(empty)
    assert "tool_calls" not in empty["choices"][0]["message"]


def test_length_mid_tool_call_is_kept_as_length() -> None:
    completion = normalize_completion(
        calls_reply(call(arguments='{"path":"/tmp/a'), finish_reason="length")
    )
    assert completion["choices"][0]["finish_reason"] == "length"
    assert is_truncated(completion)
    assert tool_calls_of(completion)[0]["function"]["arguments"] == '{"path":"/tmp/a'
    assert not is_truncated(normalize_completion(calls_reply(call())))


def test_legacy_function_call() -> None:
    raw = reply(
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "f", "arguments": '{"x":1}'},
        },
        "function_call",
    )
    completion = normalize_completion(raw)
    message = completion["choices"][0]["message"]
    assert "function_call" not in message
    (got,) = message["tool_calls"]
    assert CALL_ID.match(got["id"])
    assert got["type"] == "function"
    assert got["function"] == {"name": "f", "arguments": '{"x":1}'}
    assert completion["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("plain", "plain"),
        ({"temp": 21, "city": "Zürich"}, '{"temp":21,"city":"Zürich"}'),
        ([1, "a"], '[1,"a"]'),
        ("", "(no output)"),
        (None, "(no output)"),
        (42, "42"),
        ({}, "{}"),
    ],
)
def test_non_string_tool_output(output: Any, expected: str) -> None:
    assert tool_message_content(output) == expected


PARTS = [
    {"type": "text", "text": "A"},
    {"type": "image_url", "image_url": {"url": "https://h/x.png"}},
    "bare string",
    {"type": "text", "text": 5},
    {"type": "text"},
    {"type": "text", "text": "B"},
]


@pytest.mark.parametrize(
    ("content", "expected"),
    [("plain", "plain"), ("", ""), (None, ""), (PARTS, "AB"), ([], ""), ({"text": "x"}, "")],
)
def test_content_text_is_the_text_of_the_text_parts(content: Any, expected: str) -> None:
    assert content_text(content) == expected


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("18C", "18C"),
        (PARTS, "AB"),
        ([{"type": "image_url", "image_url": {"url": "https://h/x.png"}}], "(no output)"),
        ({"time": "12:00"}, '{"time":"12:00"}'),
        (None, "(no output)"),
        ("", "(no output)"),
    ],
)
def test_tool_result_text_is_never_empty(content: Any, expected: str) -> None:
    assert tool_result_text(content) == expected


def test_reasoning_fields_kept_under_their_names() -> None:
    for name in ("reasoning_content", "reasoning"):
        raw = reply({"role": "assistant", "content": "4", name: "2+2"})
        message = normalize_completion(raw)["choices"][0]["message"]
        assert message[name] == "2+2"
        assert message["content"] == "4"


# Canonical shape, usage, protocol errors -----------------------------------------------------


def test_canonical_shape_single_choice() -> None:
    raw = reply(
        {"role": "assistant", "content": "Hi", "annotations": []},
        logprobs=None,
        system_fingerprint="fp_1",
        service_tier="default",
    )
    raw["choices"].append({"index": 1, "message": {"role": "assistant", "content": "other"}})
    raw["choices"][0]["logprobs"] = None
    assert normalize_completion(raw) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": "fp_1",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def test_content_parts_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    raw = reply({"role": "assistant", "content": parts})
    assert normalize_completion(raw)["choices"][0]["message"]["content"] == "ab"


def test_usage_normalised() -> None:
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 5.0,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 2},
        "cost": 0.1,
    }
    assert normalize_completion(reply({"content": "x"}, usage=usage))["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    given_total = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 9}
    assert normalize_completion(reply({"content": "x"}, usage=given_total))["usage"] == given_total
    assert normalize_completion(reply({"content": "x"}, usage=None))["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
    }


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "completion is not a JSON object"),
        ("text", "completion is not a JSON object"),
        ({"id": "x"}, "completion has no choices"),
        ({"choices": []}, "completion has no choices"),
        ({"error": {"message": "secret prompt echoed"}}, "error object"),
        ({"choices": [{"index": 0}]}, "completion choice has no message"),
        ({"choices": ["x"]}, "completion choice has no message"),
        (reply({"role": "user", "content": "x"}), "role"),
        (reply({"content": 5}), "unsupported type int"),
        (reply({"content": None, "tool_calls": {"a": 1}}), "tool_calls is not a list"),
    ],
)
def test_protocol_errors(raw: Any, message: str) -> None:
    with pytest.raises(ProviderProtocolError, match=message) as info:
        normalize_completion(raw)
    assert "secret" not in info.value.message


@pytest.mark.parametrize(
    ("raw_call", "kept"),
    [
        ({"id": "c", "function": {"arguments": "{}"}}, [("c", INVALID_CALL_NAME)]),
        ({"id": "c", "function": "f"}, [("c", INVALID_CALL_NAME)]),
        ({"function": {"arguments": "{}"}}, []),  # nothing to answer it by: no call
        ("call", []),
    ],
    ids=["no-name", "function-not-object", "no-name-no-id", "not-an-object"],
)
def test_an_unreadable_tool_call_is_answered_or_dropped(
    raw_call: Any, kept: list[tuple[str, str]]
) -> None:
    """Issue 9: a call with an id is kept under INVALID_CALL_NAME (the loop answers it with
    VALIDATION_ERROR); one with nothing to answer it by is no call (logged at debug)."""
    message = normalize_completion(calls_reply(raw_call))["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    assert [(c["id"], c["function"]["name"]) for c in calls] == kept


def test_refusal_is_not_empty() -> None:
    completion = normalize_completion(reply({"content": None, "refusal": "I can't."}))
    assert completion["choices"][0]["message"]["refusal"] == "I can't."
    assert not is_empty_reply(completion)
    assert is_empty_reply(normalize_completion(reply({"content": " \n"})))


def test_tool_calls_of_without_calls() -> None:
    assert tool_calls_of(normalize_completion(reply({"content": "x"}))) == []
    assert tool_calls_of({"error": {"message": "x"}}) == []


# build_request -------------------------------------------------------------------------------

TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}


def test_build_request_basic() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = build_request("m", messages, [TOOL], {"temperature": 0.2, "tool_choice": "auto"})
    assert body == {
        "model": "m",
        "messages": messages,
        "tools": [TOOL],
        "temperature": 0.2,
        "tool_choice": "auto",
        "stream": False,
    }
    assert body["messages"][0] is not messages[0]  # the caller's transcript is not aliased


def test_build_request_reserved_params_ignored_and_no_tools_key() -> None:
    params = {
        "model": "evil",
        "messages": [],
        "tools": [TOOL],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "max_tokens": 5,
    }
    body = build_request("m", [], [], params)
    assert body == {"model": "m", "messages": [], "max_tokens": 5, "stream": False}


def test_build_request_arguments_sent_as_strings() -> None:
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "b", "function": {"name": "f", "arguments": ""}},
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"y": 2}'}},
        ],
        "reasoning_content": "r",
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        assistant,
        {"role": "tool", "tool_call_id": "a", "content": "ok"},
    ]
    body = build_request("m", messages, [], {})
    sent = body["messages"][1]
    assert [c["function"]["arguments"] for c in sent["tool_calls"]] == ['{"x":1}', "{}", '{"y": 2}']
    assert [c["type"] for c in sent["tool_calls"]] == ["function"] * 3
    assert sent["reasoning_content"] == "r"
    assert body["messages"][2] == messages[2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # input untouched
    json.dumps(body)


def test_round_trip_normalised_reply_replays() -> None:
    completion = normalize_completion(calls_reply(call(arguments={"x": 1})))
    message = completion["choices"][0]["message"]
    body = build_request("m", [message], [], {})
    assert body["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"x":1}'

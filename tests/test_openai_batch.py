"""OpenAI Batch files (producer/openai_batch.py): request lines made specs, their tools bound by
a tools file, every problem named by its line and the request's own field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.cli import main
from producer.openai_batch import (
    ToolBindings,
    ToolsFileError,
    converter,
    load_tool_bindings,
    openai_field,
    request_to_spec,
)
from producer.specfile import SpecFileError, load_spec_file
from schemas.spec_types import spec_to_json
from tests.conftest import GUESTS

WEATHER_WASM = str(GUESTS / "weather.wasm")
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(custom_id: str = "req-1", **body: Any) -> dict[str, Any]:
    body = {"model": "replay/plain", "messages": [{"role": "user", "content": "hi"}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def function_tool(name: str = "get_weather", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": PARAMETERS, **function}}


def bindings(**tools: dict[str, Any]) -> ToolBindings:
    default = {"get_weather": {"module": WEATHER_WASM, "export": "get_weather"}}
    return ToolBindings("tools.json", tools or default)


# request lines in ---------------------------------------------------------------------------


def test_a_request_line_becomes_a_spec() -> None:
    """model and messages as they are, function tools bound to their module (`strict` dropped:
    the worker checks arguments against `parameters`), every other body field a param, the
    provider from --provider; `stream: false` says nothing."""
    line = request(
        temperature=0,
        max_tokens=64,
        tool_choice="auto",
        stream=False,
        tools=[function_tool(description="Weather", strict=True)],
    )
    bound = bindings(get_weather={"module": WEATHER_WASM, "export": "get_weather",
                                  "policy": {"timeout_ms": 2000}})  # fmt: skip
    assert request_to_spec(line, bound, provider="replay-anthropic") == {
        "id": "req-1",
        "model": "replay/plain",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {
                "module": WEATHER_WASM,
                "export": "get_weather",
                "policy": {"timeout_ms": 2000},
                "function": {
                    "name": "get_weather",
                    "description": "Weather",
                    "parameters": PARAMETERS,
                },
            }
        ],
        "params": {"temperature": 0, "max_tokens": 64, "tool_choice": "auto"},
        "provider": "replay-anthropic",
    }
    assert request_to_spec(request(), None, None) == {
        "id": "req-1",
        "model": "replay/plain",
        "messages": [{"role": "user", "content": "hi"}],
    }


def test_every_problem_of_a_request_line_names_its_line_and_openai_field(tmp_path: Path) -> None:
    """Problems of the request itself, of its tools' bindings, and what the spec schema finds
    in the spec it makes (named back: messages.0.content is body.messages.0.content, id is
    custom_id), each on its physical line, in a file that mixes them with cchatq specs."""
    cchatq = {"id": "plain-1", "model": "replay/plain",
              "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    bound = bindings(
        get_weather={"module": WEATHER_WASM, "export": "get_weather",
                     "policy": {"fallback": "weather_cache"}},
        weather_cache={"module": WEATHER_WASM, "export": "get_weather"},
    )  # fmt: skip
    bad_schema = function_tool("weather_cache", parameters={"type": "objec"})
    lines: list[Any] = [
        cchatq,  # 1: no problem
        {**request("r2"), "method": "GET"},
        {k: v for k, v in request("r3").items() if k != "method"},
        {**request("r4"), "url": "/v1/embeddings"},
        {**request("r5"), "extra": 1},
        {**request("r6"), "body": "hi"},
        request("r7", stream=True),
        request("r8", functions=[{"name": "f"}]),
        request("r9", tools={"get_weather": {}}),
        request("r10", tools=["get_weather"]),
        request("r11", tools=[{"type": "custom", "function": {"name": "weather_cache"}}]),
        request("r12", tools=[{"type": "function"}]),
        request("r13", tools=[{"type": "function", "function": {"name": 7}}]),
        request("r14", tools=[function_tool("lookup")]),
        request("r 15"),
        request("r16", messages=[{"role": "user", "content": None}]),
        {**request("r17"), "body": {"messages": [{"role": "user", "content": "hi"}]}},
        request("r18", tools=[function_tool("weather_cache", foo=1)]),
        request("plain-1"),
        request("r20", tools=[function_tool()]),
        request("r21", tools=[bad_schema]),
        request("r22", tools=[function_tool(), function_tool("weather_cache")]),  # no problem
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    with pytest.raises(SpecFileError) as caught:
        load_spec_file(path, convert=converter(bound))
    said = [str(issue).removeprefix(f"{path}:") for issue in caught.value.issues]
    assert said == [
        "2: method: must be POST, got 'GET'",
        "3: method: must be POST",
        "4: url: only /v1/chat/completions is supported, got '/v1/embeddings'",
        "5: extra: Unknown field.",
        "6: body: must be a chat completion request (an object)",
        "7: body.stream: not in a batch (a backend's `stream` setting streams)",
        "8: body.functions: legacy functions are not run: give tools",
        "9: body.tools: must be a list of function tools",
        '10: body.tools.0: must be an object {"type": "function", "function"}',
        "11: body.tools.0.type: only function tools are run, got 'custom'",
        '12: body.tools.0.function: must be an object {"name", "parameters"}',
        "13: body.tools.0.function.name: must be a string, got 7",
        "14: body.tools.0.function.name: tool 'lookup' is not bound to a module"
        " (not in --tools tools.json)",
        "15: custom_id: Must match [A-Za-z0-9._:/@+-]+.",
        "16: body.messages.0.content: Required (non-null) when role is 'user'.",
        "17: body.model: Missing data for required field.",
        "18: body.tools.0.function.foo: Unknown field.",
        "19: custom_id: duplicate of line 1",
        "20: body.tools.0.function.name: tool 'get_weather' falls back on 'weather_cache'"
        " (--tools), not in this request",
        "21: body.tools.0.function.parameters: Not a valid JSON Schema at $.type: 'objec' is"
        " not valid under any of the given schemas",
    ]
    # without --tools, a request's tool says how to bind it
    path.write_text(json.dumps(request("r1", tools=[function_tool()])) + "\n")
    with pytest.raises(SpecFileError) as caught:
        load_spec_file(path, convert=converter(None))
    assert str(caught.value) == (
        f"{path}:1: body.tools.0.function.name: tool 'get_weather' is not bound to a module"
        " (--tools FILE)"
    )


def test_request_lines_load_beside_specs_with_their_bindings_and_provider(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    cchatq = {"id": "own", "model": "replay/plain",
              "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    lines = [request("oa-1", tools=[function_tool()], temperature=0), cchatq]
    path.write_text("# a comment\n" + "".join(json.dumps(obj) + "\n" for obj in lines))
    loaded = load_spec_file(path, convert=converter(bindings(), provider="replay-anthropic"))
    assert [item.line for item in loaded] == [2, 3]
    first, second = (spec_to_json(item.spec) for item in loaded)
    assert (first["id"], first["provider"], first["params"]) == (
        "oa-1",
        "replay-anthropic",
        {"temperature": 0},
    )
    assert [(t["module"], t["export"]) for t in first["tools"]] == [(WEATHER_WASM, "get_weather")]
    assert (second["id"], second["provider"]) == ("own", None)  # --provider: OpenAI lines only


def test_openai_field_names() -> None:
    assert [
        openai_field(f)
        for f in ("id", "model", "messages.0.role", "params.temperature", "params",
                  "tools.1.function.name", "tools.0.module", "provider", "")
    ] == [
        "custom_id", "body.model", "body.messages.0.role", "body.temperature", "body",
        "body.tools.1.function.name", "body.tools.0.module", "provider", "",
    ]  # fmt: skip


def test_submit_refuses_a_bad_tools_file_or_request_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cchatq submit` (no Redis needed: nothing is enqueued): exit 2, the problems listed."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps(request("r1", tools=[function_tool("lookup")])) + "\n")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"get_weather": {"module": "nope.wasm", "export": "x"}}))
    assert main(["submit", str(batch), "--tools", str(tools)]) == 2
    assert capsys.readouterr().err == (
        f"rejected, nothing enqueued:\n{tools}: get_weather.module: no such file: "
        f"{tmp_path / 'nope.wasm'}\n"
    )
    assert main(["submit", str(batch)]) == 2
    assert capsys.readouterr().err == (
        f"rejected, nothing enqueued:\n{batch}:1: body.tools.0.function.name: tool 'lookup' is"
        " not bound to a module (--tools FILE)\n"
    )


# the tools file -----------------------------------------------------------------------------


def test_a_tools_file_binds_names_to_modules_relative_to_itself(tmp_path: Path) -> None:
    folder = tmp_path / "tools"
    folder.mkdir()
    (folder / "weather.wasm").write_bytes(Path(WEATHER_WASM).read_bytes())
    path = folder / "tools.json"
    path.write_text(json.dumps({
        "get_weather": {"module": "weather.wasm", "export": "get_weather",
                        "policy": {"timeout_ms": 500, "max_retries": 1, "fallback": "by_index"}},
        "by_index": {"module": "weather.wasm", "table_index": 1},
    }))  # fmt: skip
    found = load_tool_bindings(path)
    module = str(folder / "weather.wasm")
    assert found == ToolBindings(
        str(path),
        {
            "get_weather": {"module": module, "export": "get_weather",
                            "policy": {"timeout_ms": 500, "max_retries": 1,
                                       "fallback": "by_index"}},
            "by_index": {"module": module, "table_index": 1},
        },
    )  # fmt: skip


def test_every_problem_of_a_tools_file_names_its_tool_and_field(tmp_path: Path) -> None:
    (tmp_path / "text.wasm").write_text("not wasm")
    weather = {"module": WEATHER_WASM, "export": "get_weather"}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({
        "a b": weather,
        "not_object": "weather.wasm",
        "unknown": {**weather, "timeout_ms": 5, "name": "x"},
        "no_module": {"export": "get_weather"},
        "missing_file": {"module": "nope.wasm", "export": "get_weather"},
        "not_wasm": {"module": "text.wasm", "export": "get_weather"},
        "no_export": {"module": WEATHER_WASM, "export": "nope"},
        "neither": {"module": WEATHER_WASM},
        "both": {**weather, "table_index": 0},
        "past_table": {"module": WEATHER_WASM, "table_index": 99},
        "bad_policy": {**weather, "policy": {"timeout_ms": 0}},
        "self_fallback": {**weather, "policy": {"fallback": "self_fallback"}},
        "far_fallback": {**weather, "policy": {"fallback": "elsewhere"}},
    }))  # fmt: skip
    with pytest.raises(ToolsFileError) as caught:
        load_tool_bindings(path)
    assert caught.value.problems == [
        ("a b", "Not a tool name: 1-64 characters of A-Z a-z 0-9 _ -."),
        ("not_object", 'expected an object {"module", "export"}'),
        ("unknown.timeout_ms", "Unknown field. (policy.timeout_ms?)"),
        ("unknown.name", "Unknown field."),
        ("no_module.module", "Missing data for required field."),
        ("missing_file.module", f"no such file: {tmp_path / 'nope.wasm'}"),
        ("not_wasm.module", "not a WebAssembly module"),
        ("no_export.export",
         "weather.wasm exports no function 'nope' (its functions: _initialize, get_weather)"),
        ("neither.export", "One of export or table_index is required."),
        ("both.table_index", "Give export or table_index, not both."),
        ("past_table.table_index", "weather.wasm's function table has 5 entries, not 100"),
        ("bad_policy.policy.timeout_ms",
         "Must be between 1 and 120000 (up to 21600000 with background: true)."),
        ("self_fallback.policy.fallback", "Must name another tool of this file."),
        ("far_fallback.policy.fallback", "Must name another tool of this file."),
    ]  # fmt: skip
    assert str(caught.value).splitlines()[0] == (
        f"{path}: a b: Not a tool name: 1-64 characters of A-Z a-z 0-9 _ -."
    )
    for text, problem in [
        (None, "cannot read: No such file or directory"),
        ("{nope", "invalid JSON: Expecting property name enclosed in double quotes:"
                  " line 1 column 2 (char 1)"),
        ('["get_weather"]', 'expected an object {"name": {"module", "export"}}'),
    ]:  # fmt: skip
        other = tmp_path / "other.json"
        other.unlink(missing_ok=True)
        if text is not None:
            other.write_text(text)
        with pytest.raises(ToolsFileError) as caught:
            load_tool_bindings(other)
        assert str(caught.value) == f"{other}: {problem}"

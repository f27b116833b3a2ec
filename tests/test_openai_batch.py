"""OpenAI Batch files both ways (producer/openai_batch.py in, openai_output.py out): request
lines made specs, their tools bound by a tools file, every problem named by its line and the
request's own field; and output and error lines checked field by field against OpenAI's
documented request output object. The last test runs `cchatq submit --format openai` through a
subprocess on a real fleet."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from fixtures.demo_scenarios import weather_json
from producer.cli import main
from producer.client import Client
from producer.openai_batch import (
    ToolBindings,
    ToolsFileError,
    converter,
    load_tool_bindings,
    openai_field,
    request_to_spec,
)
from producer.openai_output import ResultFiles, errors_path, openai_lines, output_line
from producer.specfile import SpecFileError, load_spec_file
from schemas.spec_types import spec_to_json
from tests.conftest import GUESTS, Running

WEATHER_WASM = str(GUESTS / "weather.wasm")
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LINE_ID = re.compile(r"batch_req_[0-9a-f]{32}\Z")


def request(custom_id: str = "req-1", **body: Any) -> dict[str, Any]:
    body = {"model": "replay/plain", "messages": [{"role": "user", "content": "hi"}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def function_tool(name: str = "get_weather", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": PARAMETERS, **function}}


def bindings(**tools: dict[str, Any]) -> ToolBindings:
    default = {"get_weather": {"module": WEATHER_WASM, "export": "get_weather"}}
    return ToolBindings("tools.json", tools or default)


# request lines in ---------------------------------------------------------------------------


USER_HI = {"role": "user", "content": "hi"}


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
    # OpenAI's `developer` role is the system role of every other provider
    developer = request(messages=[{"role": "developer", "content": "Be brief."}, USER_HI])
    converted = request_to_spec(developer, None, None)
    assert isinstance(converted, dict)
    assert converted["messages"] == [
        {"role": "system", "content": "Be brief."},
        USER_HI,
    ]


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
        {**request("r15"), "custom_id": 15},
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
        "15: custom_id: must be a non-empty string, got 15",
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
        (None, "no such file"),
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


# output lines out ---------------------------------------------------------------------------

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1711475054,
    "model": "replay/plain",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Echo: hi"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
}  # fmt: skip


def record(status: str, body: dict[str, Any], spec_id: str = "req-1") -> dict[str, Any]:
    return {"id": spec_id, "status": status, "body": body, "transcript": [], "metrics": {}}


def test_an_answer_is_a_200_line_without_cchatq_fields() -> None:
    body = {**COMPLETION, "_spear": {"backend": "replay", "model": "replay/plain"}}
    failed, line = output_line("sk1", record("ok", body))
    assert not failed
    assert list(line) == ["id", "custom_id", "response", "error"]
    assert LINE_ID.match(line["id"])
    assert line["id"] == output_line("sk1", record("ok", body))[1]["id"]  # stable
    assert line["id"] != output_line("sk2", record("ok", body))[1]["id"]
    assert line["custom_id"] == "req-1"
    said = {**COMPLETION, "_cchatq": {"round_usage": COMPLETION["usage"]}}
    assert line["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": said}
    assert line["error"] is None
    no_id = {k: v for k, v in body.items() if k != "id"}
    assert output_line("sk1", record("ok", no_id))[1]["response"]["request_id"] == "sk1"


def test_a_failure_is_an_error_file_line_shaped_as_openai_writes_them() -> None:
    """An HTTP error from the model: its status and the error as response.body, error null (as
    OpenAI's error files hold them); any other failure: response null, error {code, message}."""
    http = {"error": {"code": "provider_error", "message": "HTTP 400: bad model\nsecond line"}}
    failed, line = output_line("sk1", record("error", http))
    assert failed
    assert list(line) == ["id", "custom_id", "response", "error"]
    assert line["response"] == {
        "status_code": 400,
        "request_id": "sk1",
        "body": {"error": {"message": "bad model\nsecond line", "type": "provider_error",
                           "param": None, "code": "provider_error"}},
    }  # fmt: skip
    assert line["error"] is None
    limit = {"error": {"code": "tool_call_limit", "message": "exceeded max_iterations"}}
    failed, line = output_line("sk1", record("error", limit))
    assert failed and line["response"] is None
    assert line["error"] == {"code": "tool_call_limit", "message": "exceeded max_iterations"}
    timeout = {"error": {"code": "provider_unavailable", "message": "read timeout calling x"}}
    assert output_line("sk1", record("error", timeout))[1]["error"] == {
        "code": "provider_unavailable",
        "message": "read timeout calling x",
    }


def test_a_program_run_answers_with_its_result_fields() -> None:
    run = {**record("ok", {}), "kind": "program", "exit_code": 0, "stdout": "hi\n"}
    failed, line = output_line("sk1", run)
    assert not failed
    fields = {"status": "ok", "exit_code": 0, "stdout": "hi\n", "stderr": None, "logs": None,
              "responses": None, "metrics": {}}  # fmt: skip
    assert line["response"] == {"status_code": 200, "request_id": "sk1", "body": fields}


def test_result_files_write_as_sessions_finish_then_in_input_order(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert errors_path(out) == tmp_path / "out.errors.jsonl"
    assert errors_path(tmp_path / "out") == tmp_path / "out.errors.jsonl"
    files = ResultFiles(out, openai_lines(), errors_path(out))
    rows = [
        ("sk-a", record("ok", COMPLETION, "a"), "B", 1),
        ("sk-b", record("error", {"error": {"code": "cancelled", "message": "x"}}, "b"), "B", 1),
        ("sk-c", record("ok", COMPLETION, "c"), "B", 1),
    ]
    with files:
        for row in reversed(rows):  # as they finish
            files.write(*row)
        assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["c", "a"]
    files.rewrite(rows)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "c"]
    errors = [json.loads(x) for x in errors_path(out).read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["b"]
    assert str(files) == f"{out} (errors: {errors_path(out)})"


def test_errors_goes_with_the_openai_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["submit", "x.jsonl", "--errors", "e.jsonl"])
    assert caught.value.code == 2
    assert "--errors goes with --format openai" in capsys.readouterr().err


# end to end ---------------------------------------------------------------------------------


def assert_output_line(line: dict[str, Any], custom_id: str) -> dict[str, Any]:
    """A successful request's line, every field as the request output object documents it;
    its response body as a ChatCompletion (the openai SDK's type)."""
    assert list(line) == ["id", "custom_id", "response", "error"]
    assert LINE_ID.match(line["id"]) and line["custom_id"] == custom_id
    assert line["error"] is None
    response = line["response"]
    assert list(response) == ["status_code", "request_id", "body"]
    assert response["status_code"] == 200
    body = response["body"]
    assert response["request_id"] == body["id"] and body["id"]
    assert body["object"] == "chat.completion" and "_spear" not in body
    completion = ChatCompletion.model_validate(body)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens > 0
    return body


@pytest.mark.fleet
def test_submit_an_openai_batch_file_and_get_openai_batch_output(
    running: Running, tmp_path: Path, fresh_id: str
) -> None:
    """OpenAI Batch file in (a plain request, one whose tool runs as a WASM export bound by
    --tools, one the model refuses with an HTTP 400, and a cchatq spec beside them that ends
    on its iteration limit), OpenAI Batch output out: answers in --out, failures in the errors
    file, each in input order; `cchatq batch results --format openai` writes the same lines."""
    tools = tmp_path / "tools.json"
    module = os.path.relpath(WEATHER_WASM, tmp_path)  # relative to the tools file
    tools.write_text(json.dumps({"get_weather": {"module": module, "export": "get_weather"}}))
    weather = function_tool(description="Current weather for a city")
    ids = [f"{fresh_id}-{name}" for name in ("plain", "weather", "refused", "limit")]
    limit_spec = {
        "id": ids[3], "model": "replay/loop",
        "messages": [{"role": "user", "content": "Loop forever"}],
        "tools": [{"module": WEATHER_WASM, "export": "get_weather",
                   "function": weather["function"]}],
        "limits": {"max_iterations": 2}, "flags": {"final_answer_on_limit": False},
    }  # fmt: skip
    lines = [
        request(ids[0], temperature=0, messages=[{"role": "user", "content": "Say hi"}]),
        request(ids[1], model="replay/weather", tools=[weather], tool_choice="auto",
                messages=[{"role": "user", "content": "Weather in Paris?"}]),
        request(ids[2], model="replay/bad_request"),
        limit_spec,
    ]  # fmt: skip
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    out = tmp_path / "out.jsonl"
    # the fleet's configuration, which names its replay-* backends: submit checks against it
    env = {"REDIS_URL": running.redis_url, "PATH": "/usr/bin:/bin",
           "CCHATQ_BACKENDS": running.fleet.env["CCHATQ_BACKENDS"]}  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "producer.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    proc = cli("submit", str(batch), "--tools", str(tools), "--provider", "replay-anthropic",
               "--format", "openai", "--out", str(out))  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # every session ended, some with an error
    assert f"results: {out} (errors: {errors_path(out)})" in proc.stderr
    answers = [json.loads(x) for x in out.read_text().splitlines()]
    failures = [json.loads(x) for x in errors_path(out).read_text().splitlines()]
    assert [x["custom_id"] for x in answers] == ids[:2]
    assert [x["custom_id"] for x in failures] == ids[2:]
    assert len({x["id"] for x in answers + failures}) == 4

    plain = assert_output_line(answers[0], ids[0])
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Echo: Say hi"}
    told = assert_output_line(answers[1], ids[1])["choices"][0]["message"]
    assert told["content"] == f"Weather report: {weather_json('Paris')}"
    # ran on the backend --provider named (the answer is a chat.completion all the same);
    # the file's ids are its batch's own (as OpenAI scopes custom_id), so found through it
    batch_id = re.search(r"batch (\S+): 4 sessions enqueued", proc.stderr)
    assert batch_id, proc.stderr
    client = Client(running.redis_url, config=running.fleet.config(), lookup_batch=batch_id[1])
    assert running.client.session_key(ids[1]) is None  # not an id of the namespace
    stored = json.loads(client.response(ids[1]) or b"{}")
    assert stored["_spear"]["backend"] == "replay-anthropic"
    assert client.record(ids[1])["metrics"]["tool_calls"] == 1  # type: ignore[index]

    refused, limited = failures
    assert list(refused) == ["id", "custom_id", "response", "error"]
    assert LINE_ID.match(refused["id"]) and refused["error"] is None
    assert list(refused["response"]) == ["status_code", "request_id", "body"]
    assert refused["response"]["status_code"] == 400
    assert client.session_key(ids[2]) == refused["response"]["request_id"]
    said = refused["response"]["body"]["error"]
    assert list(said) == ["message", "type", "param", "code"]
    assert (said["type"], said["param"], said["code"]) == ("provider_error", None, "provider_error")
    assert said["message"] and not said["message"].startswith("HTTP")
    assert list(limited) == ["id", "custom_id", "response", "error"]
    assert LINE_ID.match(limited["id"]) and limited["response"] is None
    assert list(limited["error"]) == ["code", "message"]
    assert limited["error"]["code"] == "tool_call_limit"

    client.close()
    again, again_errors = tmp_path / "again.jsonl", tmp_path / "again-errors.jsonl"
    collected = cli("batch", "results", batch_id.group(1), "--format", "openai",
                    "--out", str(again), "--errors", str(again_errors))  # fmt: skip
    assert collected.returncode == 1, collected.stderr
    assert again.read_text() == out.read_text()
    assert again_errors.read_text() == errors_path(out).read_text()


def test_an_answer_counts_the_usage_of_every_round_and_keeps_the_last_rounds_apart() -> None:
    """A two-round session: `usage` is what a cost sum needs (the record's total), the last
    round's own usage and the rounds under `_cchatq`, the transcript only when asked."""
    total = {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    transcript = [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                  {"role": "assistant", "content": "hello"}]  # fmt: skip
    done = {**record("ok", COMPLETION), "transcript": transcript,
            "metrics": {"iterations": 2, "usage": total}}  # fmt: skip
    body = output_line("sk1", done)[1]["response"]["body"]
    assert body["usage"] == total
    assert body["_cchatq"] == {"round_usage": COMPLETION["usage"], "rounds": 2}
    assert body["choices"] == COMPLETION["choices"]
    with_rounds = output_line("sk1", done, transcript=True)[1]["response"]["body"]
    assert with_rounds["_cchatq"]["transcript"] == transcript


@pytest.mark.parametrize(
    "custom_id", ["request-1", "task 7 / row #3", "é中文", "x" * 500, "a\nb", '{"json": 1}']
)
def test_any_string_is_a_custom_id_and_the_output_names_it_as_given(custom_id: str) -> None:
    spec = request_to_spec(request(custom_id), None)
    assert isinstance(spec, dict)
    if spec["id"] == custom_id:  # already a spec id: kept, so `cchatq result ID` finds it
        assert "metadata" not in spec
    else:
        assert spec["id"].startswith("cid-") and spec["metadata"] == {"custom_id": custom_id}
        again = request_to_spec(request(custom_id), None)
        assert isinstance(again, dict) and again["id"] == spec["id"]  # by digest
    done = {**record("ok", COMPLETION, spec_id=spec["id"]), "metadata": spec.get("metadata")}
    assert output_line("sk1", done)[1]["custom_id"] == custom_id

"""Spec schemas and the spec-file loader (pure: no Redis, no workers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import wasmtime
from marshmallow import ValidationError

from producer.specfile import (
    LoadedSpec,
    SpecFileError,
    SpecIssue,
    flatten_errors,
    load_spec_file,
)
from schemas.limits import LIMIT_ALIASES, LIMIT_BOUNDS
from schemas.spec import LimitsSchema, SessionSpecSchema
from schemas.spec_types import spec_to_json

# a tool module as submit checks it: a memory, the exported functions these tests name, a table
WASM = bytes(
    wasmtime.wat2wasm(
        '(module (memory (export "memory") 1)'
        + ' (table (export "__indirect_function_table") 4 funcref)'
        + "".join(f' (func (export "{name}"))' for name in ("get_weather", "a", "b", "f", "g"))
        + ")"
    )
)

# docs/architecture.md section 1, verbatim.
ARCH_EXAMPLE = """
{"id": "eval-17/0042", "provider": "openai", "model": "gpt-4o-mini",
 "messages": [{"role": "user", "content": "Weather in Paris?"}],
 "tools": [{"module": "fixtures/guests/weather.wasm", "export": "get_weather",
            "function": {"name": "get_weather", "parameters": {"type": "object",
              "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
 "flags": {"auto_tool_call": true, "metrics": true},
 "limits": {"max_iterations": 8, "max_total_tool_calls": 32}}
"""

DEFAULT_LIMITS = {
    **{name: d for name, (d, _) in LIMIT_BOUNDS.items() if d is not None},
    "compress": "excerpt",
}


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "s1",
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    }
    base.update(overrides)
    return base


def tool(name: str = "get_weather", **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "module": "t.wasm",
        "export": name,
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
    }
    base.update(overrides)
    return base


def errors_of(obj: dict[str, Any]) -> dict[str, list[str]]:
    """Load expecting failure; return {dotted field: [messages]}."""
    with pytest.raises(ValidationError) as info:
        SessionSpecSchema().load(obj)
    out: dict[str, list[str]] = {}
    for field, message in flatten_errors(info.value.messages):
        out.setdefault(field, []).append(message)
    return out


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def wasm_dir(tmp_path: Path) -> Path:
    (tmp_path / "t.wasm").write_bytes(WASM)
    return tmp_path


# --- schema -----------------------------------------------------------------------------


def test_architecture_example_loads_and_canonicalises(tmp_path: Path) -> None:
    guests = tmp_path / "fixtures" / "guests"
    guests.mkdir(parents=True)
    (guests / "weather.wasm").write_bytes(WASM)
    path = tmp_path / "batch.json"
    path.write_text(ARCH_EXAMPLE)

    [loaded] = load_spec_file(path)

    assert loaded.line == 2
    assert spec_to_json(loaded.spec) == {
        "id": "eval-17/0042",
        "provider": "openai",
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [
            {
                "module": str((guests / "weather.wasm").resolve()),
                "export": "get_weather",
                "table_index": None,
                "function": {
                    "name": "get_weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        ],
        "params": {},
        "flags": {
            "auto_tool_call": True,
            "metrics": True,
            "strict_unknown_tool": False,
            "tool_result_envelope": True,
            "final_answer_on_limit": True,
        },
        "limits": DEFAULT_LIMITS,
        "metadata": {},
        "permissions": {},
    }


def test_minimal_spec_gets_defaults() -> None:
    out = spec_to_json(SessionSpecSchema().load(spec()))
    assert out["tools"] == [] and out["params"] == {} and out["provider"] is None
    assert out["flags"] == {
        "auto_tool_call": True,
        "metrics": True,
        "strict_unknown_tool": False,
        "tool_result_envelope": True,
        "final_answer_on_limit": True,
    }
    assert out["limits"] == DEFAULT_LIMITS


def test_legacy_tool_form_is_wrapped_and_parameters_defaulted() -> None:
    legacy = {"module": "t.wasm", "export": "f", "name": "f", "description": "does f"}
    out = spec_to_json(SessionSpecSchema().load(spec(tools=[legacy])))
    assert out["tools"] == [
        {
            "module": "t.wasm",
            "export": "f",
            "table_index": None,
            "function": {
                "name": "f",
                "description": "does f",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    assert legacy == {"module": "t.wasm", "export": "f", "name": "f", "description": "does f"}


def test_table_index_form() -> None:
    entry = tool(type="function")
    del entry["export"]
    entry["table_index"] = 3
    [out] = spec_to_json(SessionSpecSchema().load(spec(tools=[entry])))["tools"]
    assert out["export"] is None and out["table_index"] == 3 and "type" not in out


@pytest.mark.parametrize(
    ("target", "field"),
    [({"export": "f", "table_index": 0}, "tools.0.table_index"), ({}, "tools.0.export")],
)
def test_export_and_table_index_exactly_one(target: dict[str, Any], field: str) -> None:
    entry = {k: v for k, v in tool().items() if k != "export"} | target
    assert field in errors_of(spec(tools=[entry]))


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"table_index": -1, "export": None}, "tools.0.table_index"),
        ({"table_index": 1.5, "export": None}, "tools.0.table_index"),
        ({"type": "retrieval"}, "tools.0.type"),
        ({"function": {"name": "bad name!"}}, "tools.0.function.name"),
        ({"function": {"name": "x" * 65}}, "tools.0.function.name"),
        ({"function": {"name": "f\n"}}, "tools.0.function.name"),
        ({"function": {"name": "f", "parameters": []}}, "tools.0.function.parameters"),
        ({"function": {"name": "f", "extra": 1}}, "tools.0.function.extra"),
        ({"module": ""}, "tools.0.module"),
    ],
)
def test_bad_tool_fields(patch: dict[str, Any], field: str) -> None:
    assert field in errors_of(spec(tools=[tool(**patch)]))


def test_parameters_must_be_a_valid_json_schema() -> None:
    bad = tool(function={"name": "f", "parameters": {"type": "strin"}})
    [message] = errors_of(spec(tools=[bad]))["tools.0.function.parameters"]
    assert message.startswith("Not a valid JSON Schema at $.type:") and len(message) <= 200


def test_bad_role() -> None:
    errs = errors_of(spec(messages=[{"role": "user", "content": "a"}, {"role": "bot"}]))
    assert list(errs) == ["messages.1.role"]


def test_tool_message_needs_tool_call_id_and_others_may_not_have_one() -> None:
    errs = errors_of(
        spec(
            messages=[
                {"role": "user", "content": "hi", "tool_call_id": "c1"},
                {"role": "tool", "content": "{}"},
            ]
        )
    )
    assert set(errs) == {"messages.0.tool_call_id", "messages.1.tool_call_id"}


def test_message_shapes() -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
    ]
    out = spec_to_json(SessionSpecSchema().load(spec(messages=messages)))
    assert out["messages"][2]["tool_calls"][0]["type"] == "function"
    assert out["messages"][0]["content"] == [{"type": "text", "text": "be brief"}]


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "user", "content": None}, "messages.0.content"),
        ({"role": "system"}, "messages.0.content"),
        ({"role": "user", "content": 5}, "messages.0.content"),
        ({"role": "user", "content": [{"text": "no type"}]}, "messages.0.content"),
        ({"role": "user", "content": "x", "extra": 1}, "messages.0.extra"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages.0.tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_messages(message: dict[str, Any], field: str) -> None:
    assert field in errors_of(spec(messages=[message]))


def test_messages_required_and_non_empty() -> None:
    assert "messages" in errors_of(spec(messages=[]))
    assert "messages" in errors_of({"id": "a", "model": "m"})


def test_duplicate_tool_names_reported_on_the_duplicate() -> None:
    errs = errors_of(spec(tools=[tool("f"), tool("g"), tool("f", export="f2")]))
    assert errs == {"tools.2.function.name": ["Duplicate of tools.0.function.name."]}


def test_duplicate_tool_names_reported_alongside_other_errors() -> None:
    errs = errors_of(spec(model=5, tools=[tool("f"), tool("f")]))
    assert set(errs) == {"model", "tools.1.function.name"}


def test_limits_over_cap_and_alias() -> None:
    errs = errors_of(spec(limits={"max_iterations": 129, "max_tool_calls": 0}))
    assert errs == {
        "limits.max_iterations": ["Must be between 1 and 128."],
        "limits.max_tool_calls": ["Must be between 1 and 10000."],
    }
    out = spec_to_json(
        SessionSpecSchema().load(spec(limits={"max_tool_calls": 5, "max_iterations": 128}))
    )
    assert out["limits"] == DEFAULT_LIMITS | {"max_total_tool_calls": 5, "max_iterations": 128}


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"max_tool_calls": 3, "max_total_tool_calls": 4}, "limits.max_tool_calls"),
        ({"max_iterations": True}, "limits.max_iterations"),
        ({"max_iterations": "8"}, "limits.max_iterations"),
        ({"max_iterations": 8.0}, "limits.max_iterations"),
        ({"max_round_trips": 3}, "limits.max_round_trips"),
    ],
)
def test_bad_limits(limits: dict[str, Any], field: str) -> None:
    assert field in errors_of(spec(limits=limits))


def test_limits_schema_matches_limit_bounds() -> None:
    assert set(LimitsSchema().fields) == set(LIMIT_BOUNDS) | set(LIMIT_ALIASES) | {
        "compress",
        "compress_backend",
        "compress_model",
    }


def test_flags_are_strict_booleans() -> None:
    errs = errors_of(spec(flags={"metrics": 1, "verbose": True}))
    assert set(errs) == {"flags.metrics", "flags.verbose"}
    out = spec_to_json(SessionSpecSchema().load(spec(flags={"strict_unknown_tool": True})))
    assert out["flags"] == {
        "auto_tool_call": True,
        "metrics": True,
        "strict_unknown_tool": True,
        "tool_result_envelope": True,
        "final_answer_on_limit": True,
    }


def test_unknown_top_level_key() -> None:
    assert errors_of(spec(temperature=0.2)) == {"temperature": ["Unknown field."]}


@pytest.mark.parametrize("key", ["model", "messages", "tools", "stream"])
def test_params_reserved_keys(key: str) -> None:
    assert f"params.{key}" in errors_of(spec(params={"temperature": 0, key: 1}))


def test_params_and_metadata_pass_through() -> None:
    params = {"temperature": 0.2, "response_format": {"type": "json_object"}}
    out = spec_to_json(SessionSpecSchema().load(spec(params=params, metadata={"row": 7})))
    assert out["params"] == params and out["metadata"] == {"row": 7}


@pytest.mark.parametrize("bad_id", ["", "a b", "x" * 201, "abc\n", 7])
def test_bad_ids(bad_id: Any) -> None:
    assert "id" in errors_of(spec(id=bad_id))


# --- spec files -------------------------------------------------------------------------


def test_issue_and_error_rendering() -> None:
    assert str(SpecIssue("f.jsonl", 3, "id", "bad")) == "f.jsonl:3: id: bad"
    assert str(SpecIssue("f.jsonl", 3, "", "bad")) == "f.jsonl:3: bad"
    issues = [SpecIssue("f", n, "", "x") for n in range(1, 26)]
    text = str(SpecFileError(issues)).splitlines()
    assert len(text) == 21 and text[-1] == "... and 5 more" and text[0] == "f:1: x"


def test_jsonl_collects_every_problem(wasm_dir: Path) -> None:
    lines = [json.dumps(spec(id=f"s{n}")) for n in range(1, 6)]
    lines[2] = '{"id": "s3", "model": '
    lines[4] = json.dumps(spec(id="s5", messages=[{"role": "bot", "content": "x"}]))
    path = write_jsonl(wasm_dir / "file.jsonl", lines)

    with pytest.raises(SpecFileError) as info:
        load_spec_file(path)

    text = str(info.value)
    assert f"{path}:3: invalid JSON: Expecting value (column 23)" in text
    assert f"{path}:5: messages.0.role: Must be one of" in text
    assert [(i.line, i.field) for i in info.value.issues] == [(3, ""), (5, "messages.0.role")]


def test_duplicate_id(wasm_dir: Path) -> None:
    lines = [json.dumps(spec(id="a")), json.dumps(spec(id="b")), json.dumps(spec(id="a"))]
    with pytest.raises(SpecFileError) as info:
        load_spec_file(write_jsonl(wasm_dir / "f.jsonl", lines))
    assert info.value.issues == [
        SpecIssue(str(wasm_dir / "f.jsonl"), 3, "id", "duplicate of line 1")
    ]


def test_missing_module_file(wasm_dir: Path) -> None:
    line = json.dumps(spec(tools=[tool("a"), tool("b", module="gone/b.wasm")]))
    path = write_jsonl(wasm_dir / "f.jsonl", [line])
    with pytest.raises(SpecFileError) as info:
        load_spec_file(path)
    [issue] = info.value.issues
    assert (issue.line, issue.field) == (1, "tools.1.module")
    assert issue.message == f"no such file: {(wasm_dir / 'gone' / 'b.wasm').resolve()}"


def test_not_wasm_module(wasm_dir: Path) -> None:
    (wasm_dir / "fake.wasm").write_bytes(b"\x7fELF....")
    line = json.dumps(spec(tools=[tool(module="fake.wasm")]))
    with pytest.raises(SpecFileError) as info:
        load_spec_file(write_jsonl(wasm_dir / "f.jsonl", [line]))
    assert str(info.value).endswith(":1: tools.0.module: not a WebAssembly module")


def test_module_checked_even_when_schema_fails(wasm_dir: Path) -> None:
    line = json.dumps(spec(model=None, tools=[tool(module="nope.wasm")]))
    with pytest.raises(SpecFileError) as info:
        load_spec_file(write_jsonl(wasm_dir / "f.jsonl", [line]))
    assert {i.field for i in info.value.issues} == {"model", "tools.0.module"}


def test_module_paths_resolved_against_spec_file_dir(wasm_dir: Path, tmp_path: Path) -> None:
    sub = tmp_path / "specs"
    sub.mkdir()
    absolute = str(wasm_dir / "t.wasm")
    lines = [json.dumps(spec(tools=[tool(module="../t.wasm"), tool("g", module=absolute)]))]
    [loaded] = load_spec_file(write_jsonl(sub / "f.jsonl", lines))
    assert [t["module"] for t in spec_to_json(loaded.spec)["tools"]] == [
        str(Path(absolute).resolve())
    ] * 2


def test_blank_and_comment_lines_keep_physical_numbers(wasm_dir: Path) -> None:
    lines = [
        "# batch of two",
        "",
        json.dumps(spec(id="a")),
        "   ",
        "  # indented comment",
        "\t" + json.dumps(spec(id="b")) + "\r",
        "",
    ]
    loaded = load_spec_file(write_jsonl(wasm_dir / "f.txt", lines))
    assert [(s.line, s.spec.id) for s in loaded] == [(3, "a"), (6, "b")]
    assert all(isinstance(s, LoadedSpec) for s in loaded)


def test_json_list_reports_item_lines(wasm_dir: Path) -> None:
    items = [spec(id="a"), spec(id="b", model=3), spec(id="c")]
    path = wasm_dir / "f.json"
    # One item per 2 lines after the opening bracket: item i starts on line 2 + 2*i.
    path.write_text("[\n" + ",\n\n".join(json.dumps(i) for i in items) + "\n]\n")
    with pytest.raises(SpecFileError) as info:
        load_spec_file(path)
    assert [(i.line, i.field) for i in info.value.issues] == [(4, "model")]

    items[1]["model"] = "m"
    path.write_text("[\n" + ",\n\n".join(json.dumps(i, indent=1) for i in items) + "\n]\n")
    loaded = load_spec_file(path)
    starts = [n for n, text in enumerate(path.read_text().split("\n"), 1) if text == "{"]
    assert [s.line for s in loaded] == starts and len(starts) == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "f.json: no specs in file"),
        ("[]", "f.json: no specs in file"),
        ('[\n{"id": "a"},\n]', "f.json:3: invalid JSON: Expecting value"),
        ('{"id": "a"}\n{"id": "b"}', "f.json:2: invalid JSON: extra data"),
        ('[{"id": "a"} {"id": "b"}]', "f.json:1: invalid JSON: expected ',' or ']'"),
        ("[1]", "f.json:1: expected a JSON object, got number"),
        ('{"x": NaN}', "f.json:1: invalid JSON: NaN is not valid JSON"),
    ],
)
def test_json_file_problems(wasm_dir: Path, text: str, expected: str) -> None:
    (wasm_dir / "f.json").write_text(text)
    with pytest.raises(SpecFileError) as info:
        load_spec_file(wasm_dir / "f.json")
    assert str(info.value).splitlines()[0].startswith(str(wasm_dir) + "/" + expected)


def test_empty_jsonl_is_an_error(wasm_dir: Path) -> None:
    path = write_jsonl(wasm_dir / "f.jsonl", ["# nothing here", ""])
    with pytest.raises(SpecFileError, match="no specs in file"):
        load_spec_file(path)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(SpecFileError) as caught:
        load_spec_file(tmp_path / "missing.jsonl")
    assert str(caught.value) == f"{tmp_path / 'missing.jsonl'}: no such file"


def test_a_tool_that_does_not_fit_its_module_is_refused_at_submit(wasm_dir: Path) -> None:
    """Issue 11, point 3 (part): each distinct module is compiled once at submit; an export it
    lacks, a table index past its table, or a corrupt module is refused with its line and
    field (before, the session ran and its tool call failed)."""
    (wasm_dir / "broken.wasm").write_bytes(WASM[:-3])
    lines = [
        json.dumps(spec(id="ok", tools=[tool("a")])),
        json.dumps(spec(id="no-export", tools=[tool("get_wether")])),
        json.dumps(spec(id="past", tools=[tool("f", export=None, table_index=4)])),
        json.dumps(spec(id="corrupt", tools=[tool("a", module="broken.wasm")])),
        json.dumps(spec(id="ok-index", tools=[tool("f", export=None, table_index=3)])),
    ]
    path = write_jsonl(wasm_dir / "fit.jsonl", lines)
    with pytest.raises(SpecFileError) as info:
        load_spec_file(path)
    shown = str(info.value).splitlines()
    assert shown == [
        f"{path}:2: tools.0.export: t.wasm exports no function 'get_wether' "
        "(its functions: a, b, f, g, get_weather)",
        f"{path}:3: tools.0.table_index: t.wasm's function table has 4 entries, not 5",
        f"{path}:4: tools.0.module: not a valid WebAssembly module: "
        + shown[2].split("not a valid WebAssembly module: ", 1)[1],
    ]

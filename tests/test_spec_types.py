"""Typed specs: the schemas load into them, and the stored form (spec_to_json /
spec_from_json) gives the same value back, for specs built from real-world tool definitions
(BFCL v4, ../shared/data/bfcl) and for program runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schemas.program_spec import ProgramSpecSchema
from schemas.spec import SessionSpecSchema
from schemas.spec_types import (
    ProgramSpec,
    SessionSpec,
    spec_from_json,
    spec_to_json,
    stored,
)
from schemas.tool_schema import schema_problem

BFCL = Path(__file__).resolve().parents[2] / "shared" / "data" / "bfcl"
# BFCL's own type names -> JSON Schema
BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def json_schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: json_schema(v) for k, v in node.items()}
        if isinstance(node.get("type"), str) and node["type"] in BFCL_TYPES:
            mapped = BFCL_TYPES[node["type"]]
            if mapped is None:
                del out["type"]
            else:
                out["type"] = mapped
        return out
    if isinstance(node, list):
        return [json_schema(v) for v in node]
    return node


def bfcl_specs() -> list[dict[str, Any]]:
    if not BFCL.is_dir():
        pytest.skip("shared/data/bfcl is not beside this checkout")
    raw: list[dict[str, Any]] = []
    for name in ("BFCL_v4_simple_python.json", "BFCL_v4_multiple.json", "BFCL_v4_live_simple.json"):
        for line in (BFCL / name).read_text().splitlines():
            item = json.loads(line)
            raw.append(
                {
                    "id": item["id"],
                    "model": "m",
                    "messages": item["question"][0],
                    "tools": [
                        {
                            "module": "tool.wasm",
                            "export": fn["name"].replace(".", "_")[:64],
                            "function": {
                                "name": fn["name"].replace(".", "_")[:64],
                                "description": fn.get("description", ""),
                                "parameters": json_schema(fn["parameters"]),
                            },
                        }
                        for fn in item["function"]
                    ],
                }
            )
    return raw


def test_bfcl_specs_load_typed_and_round_trip_through_the_stored_form() -> None:
    raw = bfcl_specs()
    assert len(raw) > 800
    schema = SessionSpecSchema()
    for obj in raw:
        spec = schema.load(obj)
        assert isinstance(spec, SessionSpec)
        assert [t.name for t in spec.tools] == [t["function"]["name"] for t in obj["tools"]]
        for tool in spec.tools:
            assert schema_problem(tool.function.parameters) is None
        as_stored = stored(spec, {"tool.wasm": "ab" * 32})
        assert spec_from_json(json.loads(json.dumps(spec_to_json(as_stored)))) == as_stored
        assert all(
            t.module == "tool.wasm" and t.module_sha256 == "ab" * 32 for t in as_stored.tools
        )


def test_a_program_spec_round_trips_and_keeps_its_kind() -> None:
    spec = ProgramSpecSchema().load(
        {"id": "p/1", "program": {"module": "/x/agent.wasm", "args": ["-v"], "env": {"A": "1"}}}
    )
    assert isinstance(spec, ProgramSpec)
    as_stored = stored(spec, {"/x/agent.wasm": "cd" * 32})
    assert as_stored.program.module == "agent.wasm"
    again = spec_from_json(json.loads(json.dumps(spec_to_json(as_stored))))
    assert again == as_stored and isinstance(again, ProgramSpec)
    assert again.limits.run_timeout_ms == 60_000  # the default, written once (schemas/limits)


def test_a_tool_schema_is_checked_once_per_distinct_content() -> None:
    """Issue 11, point 3 (part): a file's lines mostly share their tools; the schema check
    runs once per distinct schema, whatever its key order, and a bad one is still refused."""
    from schemas import tool_schema

    one = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    same = {"required": ["city"], "properties": {"city": {"type": "string"}}, "type": "object"}
    before = tool_schema._cached_schema_problem.cache_info()
    assert schema_problem(one) is None and schema_problem(same) is None
    after = tool_schema._cached_schema_problem.cache_info()
    assert after.hits - before.hits >= 1 and after.misses - before.misses <= 1
    bad = {"type": "object", "properties": {"city": {"type": 7}}}
    assert "not a valid JSON Schema" in str(schema_problem(bad))
    assert "not a valid JSON Schema" in str(schema_problem(dict(bad)))  # cached, still refused


def test_the_queues_a_batch_needs() -> None:
    from producer.fleet_status import FleetStatus, needed_queues, unserved

    hi = [{"role": "user", "content": "hi"}]

    chat = SessionSpecSchema().load({"id": "c", "model": "m", "messages": hi})
    tool = {"module": "t.wasm", "export": "f", "function": {"name": "f"}}
    with_tools = SessionSpecSchema().load({"id": "t", "model": "m", "messages": hi,
                                           "tools": [tool]})  # fmt: skip
    background = SessionSpecSchema().load(
        {
            "id": "b",
            "model": "m",
            "messages": hi,
            "tools": [{**tool, "policy": {"background": True}}],
        }
    )
    program = ProgramSpecSchema().load({"id": "p", "program": {"module": "p.wasm"}})
    assert needed_queues([chat]) == ["llm", "control"]
    assert needed_queues([with_tools]) == ["llm", "tools", "control"]
    assert needed_queues([background, program]) == [
        "llm", "tools", "control", "programs", "background"
    ]  # fmt: skip
    fleet = FleetStatus({}, {}, 1, {"llm": 1, "control": 1}, 0, 0)
    assert unserved(fleet, [with_tools]) == ["tools"]


@pytest.mark.parametrize("dialect", [5, True, [], {}, None])
def test_a_schema_whose_dollar_schema_is_not_a_string_is_refused(dialect: Any) -> None:
    problem = schema_problem({"$schema": dialect, "type": "object"})
    expected = f"not a valid JSON Schema at $['$schema']: {dialect!r} is not of type 'string'"
    assert problem == expected

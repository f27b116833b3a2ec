"""`cchat_write_fn`'s -EINVAL comes with a `warn` line in the run's logs naming the check that
failed and its field, on the in-memory twins as tests/test_hostcalls.py runs programs; the
line quotes nothing the program wrote beyond a field's name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_hostcalls import EINVAL, Harness, Shared, _Source
from tests.twin_pipeline import pipeline
from tests.wat_program import Program, Ref

UNQUOTED_NAME = "Expecting property name enclosed in double quotes"  # the parser's words
SECRET = "s3cret-city"  # written by the program into every rejected tool: never in a log line


@pytest.fixture
def h(tmp_path: Path, fresh_id: str) -> Iterator[Harness]:
    blobs: dict[str, bytes] = {}
    pipe = pipeline(blobs, tmp_path)
    try:
        yield Harness(
            Shared(pipe.store, pipe.store, pipe.queue, _Source(pipe.runtime), blobs, pipe), fresh_id
        )
        assert pipe.crashed == []
    finally:
        pipe.close()


def warn(message: str) -> dict[str, Any]:
    return {"level": "warn", "message": f"cchat_write_fn: {message}"}


def test_each_rejected_tool_names_its_check_and_field_in_the_runs_logs(h: Harness) -> None:
    p = Program()
    tool, other = p.tool("first"), p.other_function()
    beyond = p.table_size
    s = p.call("cchat_create")

    def fn(obj: Any, offset: int = tool) -> int:
        raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        span = p.data(raw)
        return p.call("cchat_write_fn", Ref(s), offset, span.ptr, span.len)

    wrapped = {"type": "function", "function": {"name": "w", "description": SECRET}}
    calls = [
        fn(b'{"name": "' + SECRET.encode() + b'",'),
        fn(b'{"name": "\xff' + SECRET.encode() + b'"}'),
        fn([SECRET]),
        fn({"type": "function", "function": SECRET}),
        fn({"type": "function", "function": {"description": SECRET}}),
        fn({"name": "", "description": SECRET}),
        fn({"name": 7, "description": SECRET}),
        fn({**wrapped, "policy": SECRET}),
        fn({**wrapped, "policy": {"max_retries": -1}}),
        fn({**wrapped, "policy": {"colour": SECRET}}),
        fn({"name": "f", "parameters": {"type": "objectx", "description": SECRET}}),
        fn({"name": "f", "parameters": {"properties": {SECRET: {"type": SECRET}}}}),
        fn({"name": "f", "parameters": {"$ref": f"#/$defs/{SECRET}"}}),
        fn({"type": "function", "function": {"name": "f", "parameters": {"$schema": 7}}}),
        fn({"name": SECRET}, offset=other),
        fn({"name": SECRET}, offset=0),
        fn({"name": SECRET}, offset=beyond),
        fn({"name": SECRET}, offset=-1),
    ]
    ok = fn({"name": "fine", "description": SECRET})
    ran = h.run(p)
    assert [ran.r(c) for c in calls] == [-EINVAL] * len(calls)
    assert ran.r(ok) == 0
    metaschema = "not a valid JSON Schema: fails the metaschema's"
    assert ran.host.logs == [
        warn(f"tool JSON: not valid JSON ({UNQUOTED_NAME} at char 23)"),
        warn("tool JSON: not UTF-8"),
        warn("tool JSON: not a JSON object"),
        warn("function: not a JSON object"),
        warn("function.name: missing"),
        warn("name: empty"),
        warn("name: not a string"),
        warn("policy: not a JSON object"),
        warn("policy.max_retries: Must be between 0 and 10"),
        warn("policy.colour: Unknown field"),
        warn(f"parameters: {metaschema} 'anyOf' check 1 level(s) deep"),
        warn(f"parameters: {metaschema} 'anyOf' check 3 level(s) deep"),
        warn("parameters: a $ref that does not resolve"),
        warn("function.parameters: not a valid JSON Schema: its $schema is not a string"),
        warn(
            f"fn_offset {other}: not a function of the tool signature (i32, i32, i32, i32) -> i32"
        ),
        warn("fn_offset 0: an empty slot of the function table"),
        warn(f"fn_offset {beyond}: outside the function table (size {beyond})"),
        warn(f"fn_offset -1: outside the function table (size {beyond})"),
    ]
    assert not any(SECRET in line["message"] for line in ran.host.logs)
    assert [t.function["name"] for t in ran.host.fds[1000].tools] == ["fine"]


@pytest.mark.parametrize("export", ["funcs", None])
def test_a_module_without_a_function_table_is_named(h: Harness, export: str | None) -> None:
    p = Program(table_export=export)
    tool = p.tool("x")
    s = p.call("cchat_create")
    span = p.data('{"name":"t"}')
    rc = p.call("cchat_write_fn", Ref(s), tool, span.ptr, span.len)
    ran = h.run(p)
    assert ran.r(rc) == (0 if export else -EINVAL)
    expected = [] if export else [warn(f"fn_offset {tool}: the module exports no function table")]
    assert ran.host.logs == expected

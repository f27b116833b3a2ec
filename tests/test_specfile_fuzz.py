"""Spec files fuzzed with hypothesis: for any bytes, any byte-mutated valid file and any
JSON-mutated valid spec, `load_spec_file` returns specs that can be stored, or raises
SpecFileError whose every issue names its line (0 only for the file as a whole), names a field
unless the line is no JSON object at all, and renders as one printable line. Never another
exception. Bounded (a few seconds): max_examples per property, no deadline."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.fast_specs import FastSessions
from producer.specfile import LoadedSpec, SpecFileError, load_spec_file, load_spec_from_objects
from schemas.bodies import dump_body
from schemas.spec_types import spec_to_json
from tests.test_spec_schema import WASM, spec, tool

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
WHOLE_FILE = ("no specs in file", "cannot read", "no such file", "is a directory")
NO_OBJECT = ("invalid JSON", "invalid UTF-8", "expected a JSON object", "line longer than")

VALID: list[dict[str, Any]] = [
    spec(
        id="a/1",
        provider="openai",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "Weather in Paris?", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "{}"},
        ],
        tools=[
            tool(policy={"timeout_ms": 5000, "max_retries": 1}),
            {"module": "t.wasm", "table_index": 1, "name": "a", "parameters": {"type": "object"}},
        ],
        params={"temperature": 0.2, "response_format": {"type": "json_object"}},
        flags={"metrics": False},
        limits={"max_iterations": 4, "tool_timeout_ms": 1000},
        metadata={"row": 1, "tags": ["x", "y"]},
        permissions={"allow_tools": ["get_*"], "grant": ["a"]},
    ),
    spec(id="a/2", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
    {"id": "p/1", "program": {"module": "t.wasm", "args": ["-v"]}, "limits": {"run_timeout_ms": 9}},
]
VALID_JSONL = b"".join(json.dumps(obj).encode() + b"\n" for obj in VALID)
TOKENS = [
    b"1e400", b"-1e400", b"1" * 5000, b'"\\ud800"', b'"\\udfff x"', b'"\\ud83d\\ude00"',
    b'"_schema": 1, ', b'"_schema"', b'"a\\nb": 1, ', b'"\\u0000"', b"\\u2028", b"\xe2\x80\xa8",
    b"[" * 70, b"{" * 70, b'{"a":' * 70, b"[" * 3000, b"]", b"}", b"\x00", b"\xff", b"\xc3",
    b"\xed\xa0\x80", b"\r", b"\r\n", b"\n", b"\xef\xbb\xbf", b"null", b"true", b"[]", b"{}", b'"',
    b",", b":", b"NaN", b"-Infinity", b"#", b" ", b"\t", b"0", b"-0.0", b"1.5", b"7",
]  # fmt: skip
SPECIAL_TEXT = st.sampled_from(
    ["", "_schema", "a\nb", "\x00", "\x1b[2J", "\u2028", "\ud800", "x\udfff", "\ufeff", "💥"]
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)  # +-inf: written as Infinity, which is no JSON
    | st.sampled_from([1e308, -1e308, 5e-324])
    | st.text(max_size=8)
    | SPECIAL_TEXT,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=6) | SPECIAL_TEXT, children, max_size=3)
    ),
    max_leaves=12,
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "t.wasm").write_bytes(WASM)
    return tmp_path


def assert_clean_outcome(path: Path) -> list[LoadedSpec] | None:
    """The property: specs that can be stored, or well-formed issues; nothing else."""
    lines = path.read_bytes().count(b"\n") + 1
    try:
        loaded = load_spec_file(path)
    except SpecFileError as exc:
        assert exc.issues
        for issue in exc.issues:
            text = str(issue)
            assert text.isprintable(), text
            assert "could not be checked" not in issue.message, text
            if issue.line == 0:
                assert issue.message.startswith(WHOLE_FILE) and not issue.field, text
            else:
                assert 1 <= issue.line <= lines, text
                assert issue.field or issue.message.startswith(NO_OBJECT), text
        return None
    assert loaded
    for item in loaded:  # stored as the client does: UTF-8, finite numbers
        json.dumps(spec_to_json(item.spec), allow_nan=False)
        dump_body(spec_to_json(item.spec))
    return loaded


def test_the_valid_file_is_valid(folder: Path) -> None:
    (folder / "f.jsonl").write_bytes(VALID_JSONL)
    loaded = assert_clean_outcome(folder / "f.jsonl")
    assert loaded is not None and len(loaded) == len(VALID)


@FUZZ
@given(data=st.binary(max_size=600), suffix=st.sampled_from([".jsonl", ".json"]))
def test_any_bytes(folder: Path, data: bytes, suffix: str) -> None:
    path = folder / f"f{suffix}"
    path.write_bytes(data)
    assert_clean_outcome(path)


@st.composite
def mutated_file(draw: st.DrawFn) -> bytes:
    data = bytearray(VALID_JSONL)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "byte"]))
        if op == "insert":
            data[at:at] = draw(st.sampled_from(TOKENS))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 40))]
        elif op == "replace":
            data[at : at + draw(st.integers(1, 8))] = draw(st.sampled_from(TOKENS))
        else:
            data[at:at] = bytes([draw(st.integers(0, 255))])
    return bytes(data)


@FUZZ
@given(data=mutated_file(), suffix=st.sampled_from([".jsonl", ".json"]))
def test_byte_mutations_of_a_valid_file(folder: Path, data: bytes, suffix: str) -> None:
    path = folder / f"f{suffix}"
    if suffix == ".json":  # the same specs as one array
        data = b"[" + b",".join(line for line in data.split(b"\n") if line.strip()) + b"]"
    path.write_bytes(data)
    assert_clean_outcome(path)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out.extend(_paths(value, (*prefix, index)))
    return out


@st.composite
def mutated_spec(draw: st.DrawFn) -> Any:
    obj = json.loads(json.dumps(draw(st.sampled_from(VALID))))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(obj)))
        if not path:
            obj = draw(JSON_VALUES) if draw(st.integers(0, 9)) == 0 else obj
            continue
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["set", "delete", "add"]))
        if op == "set":
            parent[path[-1]] = draw(JSON_VALUES)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6) | SPECIAL_TEXT)] = draw(JSON_VALUES)
        else:
            parent.append(draw(JSON_VALUES))
        if not isinstance(obj, dict | list):
            break
    return obj


@FUZZ
@given(objs=st.lists(mutated_spec(), min_size=1, max_size=3), ascii_only=st.booleans())
def test_json_mutations_of_valid_specs(folder: Path, objs: list[Any], ascii_only: bool) -> None:
    lines = [json.dumps(obj, ensure_ascii=ascii_only) for obj in objs]
    path = folder / "f.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    assert_clean_outcome(path)


@FUZZ
@given(
    objs=st.lists(mutated_spec(), min_size=1, max_size=3),
    odd=st.sampled_from([float("inf"), float("nan"), "\ud800", 10**400, [[[]]] * 3]),
)
def test_in_memory_objects(folder: Path, objs: list[Any], odd: Any) -> None:
    """The same checks without a file (`cchatq run`, `Client.submit`); non-JSON values too."""
    if isinstance(objs[0], dict):
        if not isinstance(objs[0].get("metadata"), dict):  # a mutation may have made it null
            objs[0]["metadata"] = {}
        objs[0]["metadata"]["odd"] = odd
    try:
        specs = load_spec_from_objects(objs, base_dir=folder)
    except SpecFileError as exc:
        for issue in exc.issues:
            assert str(issue).isprintable() and 1 <= issue.line <= len(objs), str(issue)
            assert "could not be checked" not in issue.message, str(issue)
            assert issue.field or issue.message.startswith("expected a JSON object"), str(issue)
        return
    for item in specs:
        dump_body(spec_to_json(item))


# --- the fast path gives what the schemas give ---------------------------------------------


def _pick(draw: st.DrawFn, valid: Sequence[Any], invalid: Sequence[Any] = ()) -> Any:
    """A valid value, or now and then (1 in 8) an invalid one; a fresh copy."""
    values = invalid if invalid and draw(st.integers(0, 7)) == 0 else valid
    return json.loads(json.dumps(draw(st.sampled_from(values))))


def _maybe(
    draw: st.DrawFn, out: dict[str, Any], key: str, valid: Sequence[Any], bad: Sequence[Any] = ()
) -> None:
    if draw(st.booleans()):
        out[key] = _pick(draw, valid, bad)


CALL = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
CONTENT: dict[str, list[Any]] = {
    "system": ["be brief", [{"type": "text", "text": "x"}]],
    "user": ["hi", "", [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {}}], []],
    "assistant": [None, "ok", [{"type": "text", "text": "x"}]],
    "tool": [None, "{}", ""],
}
BAD_MESSAGE_FIELDS = [
    ("role", "bot"), ("role", 5), ("content", 5), ("content", [{}]), ("content", [{"type": 1}]),
    ("content", None), ("name", 5), ("tool_calls", [CALL]), ("tool_calls", {}),
    ("tool_calls", [{**CALL, "id": ""}]), ("tool_calls", [{**CALL, "type": "x"}]),
    ("tool_calls", [{"id": "c", "function": {"name": "f"}}]), ("tool_calls", [{**CALL, "x": 1}]),
    ("tool_call_id", "c1"), ("tool_call_id", ""), ("tool_call_id", 5), ("extra", 1),
]  # fmt: skip


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(sorted(CONTENT)))
    out: dict[str, Any] = {"role": role}
    if role in ("system", "user") or draw(st.booleans()):
        out["content"] = _pick(draw, CONTENT[role])
    _maybe(draw, out, "name", ["ann", ""])
    if role == "assistant":
        _maybe(draw, out, "tool_calls", [[], [CALL], [{**CALL, "type": "function"}, CALL]])
    if role == "tool":
        out["tool_call_id"] = "c1"
    if draw(st.integers(0, 7)) == 0:
        key, value = draw(st.sampled_from(BAD_MESSAGE_FIELDS))
        out[key] = value
    return out


ASYNC = {"background": True, "background_mode": "async", "timeout_ms": 200_000}
TOOLS = [
    tool(),
    tool("a", export=None, table_index=1),
    tool("f", policy=ASYNC),
    tool("task_status", export=None, table_index=0),
    tool("g", policy={"fallback": "a"}),
    {"module": "t.wasm", "export": "b", "name": "b", "parameters": {"type": "object"}},
]
BAD_TOOLS = [
    tool("b", module="gone.wasm"),
    tool("b", export="nope"),
    tool("b", function={"name": "b", "parameters": {"type": "strin"}}),
    tool("b", policy={"timeout_ms": 0}),
    {"module": "t.wasm", "export": "b"},
    tool("b", extra=1),
]


@st.composite
def session(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": draw(st.from_regex(r"[A-Za-z0-9._:/@+-]{1,12}", fullmatch=True)),
        "model": "m",
        "messages": draw(st.lists(message(), min_size=1, max_size=3)),
    }
    _maybe(draw, out, "id", ["a/1"], ["", "a b", "x" * 201, "abc\n", 7])
    _maybe(draw, out, "model", ["gpt-4o"], ["", 5])
    _maybe(draw, out, "messages", [[{"role": "user", "content": "hi"}]], [[], None])
    _maybe(draw, out, "provider", [None, "openai"], ["", 3])
    if draw(st.booleans()):
        tools = st.sampled_from(TOOLS) if draw(st.integers(0, 7)) else st.sampled_from(BAD_TOOLS)
        out["tools"] = json.loads(json.dumps(draw(st.lists(tools, max_size=3))))
    _maybe(draw, out, "tools", [[]], [None, {}])
    params = [{}, {"temperature": 0.2, "n": 1}, {"a": [1, {"b": None}], "c": True}]
    _maybe(draw, out, "params", params, [{"model": "x"}, None, []])
    flags = [{}, {"metrics": False}, {"auto_tool_call": True}]
    _maybe(draw, out, "flags", flags, [{"metrics": 1}, {"verbose": True}, None])
    limits = [{}, {"max_iterations": 4}, {"max_tool_calls": 3}, {"compress": "summarize"}]
    bad_limits = [{"max_tool_calls": 3, "max_total_tool_calls": 4}, {"max_iterations": 0}, 3]
    _maybe(draw, out, "limits", limits, bad_limits)
    _maybe(draw, out, "metadata", [{}, {"row": 1, "x": [1.5]}], [[], None])
    permissions = [{}, {"grant": ["a"]}, {"user": "u", "deny_tools": ["x*"]}]
    _maybe(draw, out, "permissions", permissions, [{"grant": ["zzz"]}, {"allow_tools": [""]}, None])
    if draw(st.integers(0, 15)) == 0:
        out["temperature"] = 0.2
    return out


def _outcome(path: Path) -> Any:
    try:
        loaded = load_spec_file(path)
    except SpecFileError as exc:
        return ("rejected", exc.issues)
    # dataclass equality, and the same JSON in the same key order
    return ("loaded", loaded, [json.dumps(spec_to_json(item.spec)) for item in loaded])


@FUZZ
@given(obj=session())
def test_the_fast_path_gives_what_the_schemas_give(
    folder: Path, obj: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = folder / "f.jsonl"
    path.write_text(json.dumps(obj))
    fast = _outcome(path)
    with monkeypatch.context() as patch:
        patch.setattr(FastSessions, "load", lambda self, obj: None)
        slow = _outcome(path)
    assert fast == slow


def test_the_common_specs_take_the_fast_path(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[bool] = []
    load = FastSessions.load

    def spy(self: FastSessions, obj: dict[str, Any]) -> Any:
        spec = load(self, obj)
        taken.append(spec is not None)
        return spec

    monkeypatch.setattr(FastSessions, "load", spy)
    (folder / "f.jsonl").write_bytes(VALID_JSONL)
    assert_clean_outcome(folder / "f.jsonl")
    assert taken == [True, True, False]  # the two sessions; the program takes the schemas

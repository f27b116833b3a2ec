"""Spec files a tester fuzzed (2,002 malformed files): each class that ended in a traceback, was
accepted, or was rejected without its line and field, reproduced and pinned. Every rejection
is a SpecFileError whose issues each name the line (0 only for the file as a whole) and, for a
problem inside an object, the field; each issue renders as one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from producer import spec_json
from producer.specfile import (
    MAX_DEPTH,
    SpecFileError,
    SpecIssue,
    load_spec_file,
    load_spec_from_objects,
)
from schemas.spec_types import SessionSpec
from tests.test_spec_schema import WASM, spec, tool

ROOT = Path(__file__).resolve().parent.parent
OK = json.dumps(spec())


def issues_of(path: Path) -> list[SpecIssue]:
    with pytest.raises(SpecFileError) as info:
        load_spec_file(path)
    for line in str(info.value).split("\n"):  # one line per issue, nothing else
        assert line.isprintable(), line
    return info.value.issues


def shown(issues: list[SpecIssue]) -> list[tuple[int, str, str]]:
    return [(i.line, i.field, i.message) for i in issues]


def write(path: Path, text: str) -> Path:
    # surrogatepass: some cases write what a broken producer would (lone surrogates, raw)
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    return path


def with_line(**fields: Any) -> str:
    return json.dumps(spec(**fields))


# --- nesting ------------------------------------------------------------------------------


@pytest.mark.parametrize("opener", ["[", '{"a": '])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 300, 100_000])
def test_deep_nesting_in_a_line_is_rejected_on_its_line(
    tmp_path: Path, opener: str, depth: int
) -> None:
    closer = "]" if opener == "[" else "}"
    deep = opener * depth + "1" + closer * depth
    bad = with_line(id="b")[:-1] + f', "metadata": {{"x": {deep}}}}}'
    path = write(tmp_path / "f.jsonl", "\n".join([OK, bad, with_line(id="c")]) + "\n")
    [issue] = issues_of(path)
    assert issue.line == 2
    assert f"nested deeper than {MAX_DEPTH} levels" in issue.message
    if depth < 1000:  # parsed: the field is known; deeper, the parser gives up first
        assert issue.field == "metadata.x"


def test_nesting_up_to_the_limit_is_accepted(tmp_path: Path) -> None:
    # the spec object is level 1, metadata 2, so the innermost value may open level MAX_DEPTH
    inner = MAX_DEPTH - 2
    deep = "[" * inner + "]" * inner
    path = write(tmp_path / "f.jsonl", OK[:-1] + f', "metadata": {{"x": {deep}}}}}\n')
    [loaded] = load_spec_file(path)
    assert loaded.spec.metadata["x"] == json.loads(deep)


def test_deep_nesting_in_a_json_file(tmp_path: Path) -> None:
    issues = issues_of(write(tmp_path / "f.json", "\n[" + "[" * 100_000))
    assert [(i.line, i.field) for i in issues] == [(2, "")]
    assert "nested deeper than" in issues[0].message

    item = json.dumps(spec(id="b", metadata={"a": json.loads("[" * 80 + "]" * 80)}))
    path = write(tmp_path / "g.json", f"[\n{OK},\n{item}\n]")
    [issue] = issues_of(path)
    assert (issue.line, issue.field) == (3, "metadata.a")


# --- numbers and strings JSON can write but nothing later can use --------------------------


def test_infinite_numbers_are_rejected_naming_the_field(tmp_path: Path) -> None:
    bad = OK[:-1] + ', "params": {"temperature": 1e400}, "metadata": {"w": [1, -1e400]}}'
    path = write(tmp_path / "f.jsonl", "\n".join([OK.replace('"s1"', '"s0"'), bad]))
    assert shown(issues_of(path)) == [
        (2, "params.temperature", "numbers must be finite"),
        (2, "metadata.w.1", "numbers must be finite"),
    ]


def test_lone_surrogates_are_rejected_naming_the_field(tmp_path: Path) -> None:
    lines = [
        OK[:-1] + ', "metadata": {"\\ud800": 1}}',
        json.dumps(spec(id="b")).replace('"hi"', '"hi \\udc00 there"'),
        json.dumps(spec(id="c")).replace('"hi"', '"\\ud83d\\ude00 a pair is fine"'),
    ]
    issues = issues_of(write(tmp_path / "f.jsonl", "\n".join(lines)))
    assert [(i.line, i.field) for i in issues] == [
        (1, "metadata.\ud800"),
        (2, "messages.0.content"),
    ]
    assert all("lone surrogate" in i.message for i in issues)
    assert "metadata.\\ud800: " in str(issues[0])  # shown escaped


def test_in_memory_objects_get_the_same_checks() -> None:
    objs = [spec(params={"temperature": float("inf")}), spec(id="b", metadata={"k": "\udcff"})]
    with pytest.raises(SpecFileError) as info:
        load_spec_from_objects(objs)
    assert [(i.line, i.field) for i in info.value.issues] == [
        (1, "params.temperature"),
        (2, "metadata.k"),
    ]


def test_nan_and_infinity_literals_are_not_json(tmp_path: Path) -> None:
    path = write(tmp_path / "f.jsonl", OK[:-1] + ', "params": {"t": -Infinity}}')
    [issue] = issues_of(path)
    assert (issue.line, issue.message) == (1, "invalid JSON: -Infinity is not valid JSON")


# --- bytes ------------------------------------------------------------------------------


def test_invalid_utf8_names_its_line_and_the_rest_is_still_checked(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(
        b"\n".join([OK.encode(), b'{"id": "b\xff", "model": "m"}', json.dumps(spec(id=5)).encode()])
    )
    issues = issues_of(path)
    assert shown(issues) == [
        (2, "", "invalid UTF-8: byte 0xff at column 10"),
        (3, "id", "Not a valid string."),
    ]


def test_encoded_surrogates_are_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(OK.replace("hi", "h\udc80i").encode("utf-8", "surrogatepass"))
    [issue] = issues_of(path)
    assert (issue.line, issue.field) == (1, "") and issue.message.startswith("invalid UTF-8")


def test_invalid_utf8_in_a_json_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(b'[\n{"id": "a"},\n{"id": "\xc3("}]')
    [issue] = issues_of(path)
    assert (issue.line, issue.message) == (3, "invalid UTF-8: byte 0xc3 at column 9")


def test_nul_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(OK.encode() + b'\n{"id": "b\x00"}\n\x00\n')
    issues = issues_of(path)
    assert [(i.line, i.field) for i in issues] == [(2, ""), (3, "")]
    assert all(i.message.startswith("invalid JSON") for i in issues)
    assert "\x00" not in str(SpecFileError(issues))


def test_bom_and_crlf_are_accepted(tmp_path: Path) -> None:
    path = write(tmp_path / "f.jsonl", "\ufeff" + OK + "\r\n" + with_line(id="b") + "\r\n")
    assert [s.line for s in load_spec_file(path)] == [1, 2]
    path = write(tmp_path / "f.json", "\ufeff[" + OK + ",\r\n" + with_line(id="b") + "]\r\n")
    assert [s.line for s in load_spec_file(path)] == [1, 2]


def test_a_bom_after_the_first_line_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "f.jsonl", OK + "\n\ufeff" + with_line(id="b"))
    [issue] = issues_of(path)
    assert (issue.line, issue.field) == (2, "") and "invalid JSON" in issue.message


def test_very_long_lines(tmp_path: Path) -> None:
    long_prompt = "x" * (3 << 20)
    path = write(
        tmp_path / "f.jsonl", with_line(messages=[{"role": "user", "content": long_prompt}])
    )
    [loaded] = load_spec_file(path)
    assert isinstance(loaded.spec, SessionSpec)
    assert loaded.spec.messages[0]["content"] == long_prompt
    path = write(tmp_path / "g.jsonl", OK + "\n" + "[" * (2 << 20) + "\n" + with_line(id=9))
    issues = issues_of(path)
    assert [(i.line, i.field) for i in issues] == [(2, ""), (3, "id")]


def test_a_line_past_the_limit_is_skipped_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spec_json, "MAX_LINE_BYTES", 4096)
    long_line = with_line(id="b", metadata={"x": "y" * 5000})
    path = write(tmp_path / "f.jsonl", "\n".join([OK, long_line, with_line(id=3)]))
    assert shown(issues_of(path)) == [
        (2, "", "line longer than 4,096 bytes: not read"),
        (3, "id", "Not a valid string."),
    ]


def test_truncated_json(tmp_path: Path) -> None:
    for cut in (1, 10, len(OK) // 2, len(OK) - 1):
        [issue] = issues_of(write(tmp_path / "f.jsonl", OK[:cut]))
        assert issue.line == 1 and issue.message.startswith("invalid JSON")
        [issue] = issues_of(write(tmp_path / "f.json", f"[{OK},\n{OK[:cut]}"))
        assert issue.line == 2 and issue.message.startswith("invalid JSON")


@pytest.mark.parametrize(("text", "kind"), [("1", "number"), ('"x"', "string"), ("[]", "array"),
                                            ("null", "null"), ("true", "boolean")])  # fmt: skip
def test_top_level_non_objects(tmp_path: Path, text: str, kind: str) -> None:
    issues = issues_of(write(tmp_path / "f.jsonl", f"{OK}\n{text}\n"))
    assert shown(issues) == [(2, "", f"expected a JSON object, got {kind}")]


@pytest.mark.parametrize("text", ["", "\n\n", "  \r\n", "\ufeff", "# only a comment\n"])
def test_empty_files(tmp_path: Path, text: str) -> None:
    assert shown(issues_of(write(tmp_path / "f.jsonl", text))) == [(0, "", "no specs in file")]


def test_a_directory_or_a_missing_file(tmp_path: Path) -> None:
    for path, said in (
        (tmp_path, "is a directory, not a file"),
        (tmp_path / "nope.jsonl", "no such file"),
    ):
        [issue] = issues_of(path)
        assert issue.line == 0 and issue.message == said
        assert str(issue) == f"{path}: {said}"  # no `:0`: the file as a whole


def test_an_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path / "secret.jsonl", "{}\n")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("run as a user who reads every file (root)")
        [issue] = issues_of(path)
        assert str(issue) == f"{path}: cannot read: permission denied"
    finally:
        path.chmod(0o600)


# --- keys -------------------------------------------------------------------------------


def test_a_key_named_schema_is_an_unknown_field(tmp_path: Path) -> None:
    """marshmallow files whole-object errors under `_schema`, so a user's `_schema` key read as
    an error about the object itself, with no field."""
    line = OK[:-1] + ', "_schema": 1}'
    line = line.replace('"content": "hi"', '"content": "hi", "_schema": 2')
    assert shown(issues_of(write(tmp_path / "f.jsonl", line))) == [
        (1, "messages.0._schema", "Unknown field."),
        (1, "_schema", "Unknown field."),
    ]


def test_an_empty_key_is_named(tmp_path: Path) -> None:
    line = OK[:-1] + ', "": 1, "metadata": {"": 1e999}}'
    assert shown(issues_of(write(tmp_path / "f.jsonl", line))) == [
        (1, 'metadata.""', "numbers must be finite")
    ]
    assert shown(issues_of(write(tmp_path / "f.jsonl", OK[:-1] + ', "": 1}'))) == [
        (1, '""', "Unknown field.")
    ]


def test_a_key_named_schema_in_a_tool(tmp_path: Path) -> None:
    (tmp_path / "t.wasm").write_bytes(WASM)
    line = json.dumps(spec(tools=[tool(_schema=1), tool("a", policy={"_schema": {}})]))
    assert shown(issues_of(write(tmp_path / "f.jsonl", line))) == [
        (1, "tools.0._schema", "Unknown field."),
        (1, "tools.1.policy._schema", "Unknown field."),
    ]


@pytest.mark.parametrize("key", ["a\nb", "a\rb", "tab\there", "nul\x00", "\u2028", "esc\x1b[31m"])
def test_keys_holding_control_characters_are_shown_escaped(tmp_path: Path, key: str) -> None:
    line = OK[:-1] + f", {json.dumps(key)}: 1}}"
    [issue] = issues_of(write(tmp_path / "f.jsonl", line))
    assert (issue.line, issue.field, issue.message) == (1, key, "Unknown field.")
    assert str(issue).endswith(": " + repr(key)[1:-1] + ": Unknown field.")


# --- module paths that cannot even be looked at -----------------------------------------


@pytest.mark.parametrize(
    "module", ["~nosuchuser-zz/t.wasm", "a\x00b.wasm", "x" * 5000, "d/" * 3000]
)
def test_module_paths_that_cannot_be_checked(tmp_path: Path, module: str) -> None:
    (tmp_path / "t.wasm").write_bytes(WASM)
    path = write(tmp_path / "f.jsonl", json.dumps(spec(tools=[tool(module=module)])))
    [issue] = issues_of(path)
    assert (issue.line, issue.field) == (1, "tools.0.module")


def test_a_parameters_schema_naming_no_string_schema(tmp_path: Path) -> None:
    (tmp_path / "t.wasm").write_bytes(WASM)
    parameters = {"$schema": 5, "type": "object"}
    bad = tool(function={"name": "get_weather", "parameters": parameters})
    [issue] = issues_of(write(tmp_path / "f.jsonl", json.dumps(spec(tools=[bad]))))
    assert (issue.line, issue.field) == (1, "tools.0.function.parameters")


# --- the command line -------------------------------------------------------------------


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"id": "a", "model": "m", "messages": [{"role": "user", "content": "\xff"}]}',
         ":1: invalid UTF-8: byte 0xff"),
        (OK[:-1].encode() + b', "params": {"temperature": 1e400}}',
         ":1: params.temperature: numbers must be finite"),
        (b"\n" + OK[:-1].encode() + b', "metadata": ' + b"[" * 50_000 + b"}",
         ":2: invalid JSON: nested deeper than"),
        (OK[:-1].encode() + b', "a\\nb": 1}', ":1: a\\nb: Unknown field."),
    ],
)  # fmt: skip
def test_cli_submit_rejects_without_a_traceback(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{unused_port()}/0"}  # never reached
    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(path), "--out", str(tmp_path / "r")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{path}{expected}" in done.stderr

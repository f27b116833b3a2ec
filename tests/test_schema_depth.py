"""A tool schema whose $refs loop (every one resolves, so submit accepts it) or recurse with
arguments nested deep is a clear validation error, the same from any depth of the caller's
stack: the validation stops REF_HEADROOM_FRAMES short of Python's recursion limit, where it
used to run into the limit itself (a RecursionError, and whatever else ran at that depth failing
by chance)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import jsonschema
import pytest

from schemas import tool_schema
from worker.session.engine import argument_problem

LOOPING = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#"}}}
TREE = {
    "type": "object",
    "properties": {"child": {"$ref": "#"}, "leaf": {"type": "string"}},
    "additionalProperties": False,
}
TOO_DEEP = (
    "the tool's parameters schema cannot be checked: its $ref recursion runs too deep to "
    "check (a $ref that refers back to itself without descending into the arguments, or "
    "arguments nested too deep)"
)


def _at_depth(frames: int, call: Callable[[], Any]) -> Any:
    return call() if frames <= 0 else _at_depth(frames - 1, call)


def _nested(levels: int) -> str:
    value: dict[str, Any] = {"leaf": "x"}
    for _ in range(levels):
        value = {"child": value}
    return json.dumps(value)


@pytest.fixture
def deepest() -> Iterator[list[int]]:
    """The most frames the stack held at any reference the validation followed."""
    seen = [0]
    follow = jsonschema.Draft202012Validator.VALIDATORS["$ref"]

    def counting(validator: Any, ref: Any, instance: Any, schema: Any) -> Iterator[Any]:
        frame: FrameType | None = sys._getframe()
        frames = 0
        while frame is not None:
            frames, frame = frames + 1, frame.f_back
        seen[0] = max(seen[0], frames)
        yield from follow(validator, ref, instance, schema)

    jsonschema.Draft202012Validator.VALIDATORS["$ref"] = counting
    tool_schema._validator_of.cache_clear()
    try:
        yield seen
    finally:
        jsonschema.Draft202012Validator.VALIDATORS["$ref"] = follow
        tool_schema._validator_of.cache_clear()


@pytest.mark.parametrize("caller_frames", [0, 200, 500])
def test_a_looping_schema_is_the_same_clear_error_from_any_depth(
    caller_frames: int, deepest: list[int]
) -> None:
    problem = _at_depth(caller_frames, lambda: argument_problem('{"x":1}', LOOPING))
    assert problem == TOO_DEEP
    assert deepest[0] <= sys.getrecursionlimit() - tool_schema.REF_HEADROOM_FRAMES


def test_arguments_nested_too_deep_for_a_recursive_schema_are_a_clear_error() -> None:
    assert argument_problem(_nested(10), TREE) is None  # a recursive schema works
    assert argument_problem(json.dumps({"child": {"leaf": 1}}), TREE) == (
        "child/leaf: 1 is not of type 'string'"
    )
    assert argument_problem(_nested(400), TREE) == TOO_DEEP

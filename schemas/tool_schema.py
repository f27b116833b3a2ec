"""The one JSON-Schema check of a tool's `parameters`, used at submit (spec files), by
`cchat_write_fn` (programs) and by the engine before a call runs, so a schema accepted at
the door is one the engine can validate arguments against.

A schema is usable when it is a valid schema of its draft (2020-12 unless `$schema` says
otherwise) and every `$ref` in it resolves without network access.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import referencing.exceptions
import regex
from jsonschema.exceptions import ValidationError

MAX_PROBLEM_CHARS = 200
# Keywords whose values are data, not subschemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def schema_problem(schema: Any) -> str | None:
    """Why `schema` cannot check a tool's arguments, or None when it can. Checked once per
    distinct schema (by its canonical JSON): a batch's lines mostly share their tools, and the
    check (jsonschema's metaschema walk) was three quarters of validating a spec file."""
    problem = _problem_of(schema)
    return None if problem is None else problem[0]


def schema_problem_reason(schema: Any) -> str | None:
    """`schema_problem` in a few words that quote nothing of the schema (no value, no path of
    its property names): what a program's log line may say."""
    problem = _problem_of(schema)
    return None if problem is None else problem[1]


def _problem_of(schema: Any) -> tuple[str, str] | None:
    """(the problem, its reason without the schema's content), or None."""
    if not isinstance(schema, dict):
        return "parameters must be a JSON object", "not a JSON object"
    try:
        canonical = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not JSON (in memory only): checked as it is, uncached
        return _schema_problem(schema)
    return _cached_schema_problem(canonical)


@functools.lru_cache(maxsize=4096)
def _cached_schema_problem(canonical: str) -> tuple[str, str] | None:
    return _schema_problem(json.loads(canonical))


def _schema_problem(schema: dict[str, Any]) -> tuple[str, str] | None:
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):  # validator_for would raise
        message = f"not a valid JSON Schema at $['$schema']: {dialect!r} is not of type 'string'"
        return _capped(message), "not a valid JSON Schema: its $schema is not a string"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        # the metaschema's keyword that failed (`type`, `minimum`, ...) is the draft's, not the
        # schema's; the depth says where without naming its properties
        where = f"{len(exc.absolute_path)} level(s) deep" if exc.absolute_path else "at its root"
        reason = f"not a valid JSON Schema: fails the metaschema's {exc.validator!r} check {where}"
        return _capped(f"not a valid JSON Schema at {exc.json_path}: {exc.message}"), reason
    # jsonschema's own resolver, so a reference resolves here exactly when it will at call time
    root = cls(schema)._resolver
    for path, ref, resolver in _refs(schema, "$", root, root=True):
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            return _capped(f"unresolvable $ref {ref!r} at {path}"), "a $ref that does not resolve"
    return None


@functools.lru_cache(maxsize=512)
def _validator_of(schema_json: str) -> jsonschema.protocols.Validator:
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return _bounded(cls)(schema)


# Patterns come from specs and values from models: a pattern like "(a+)+b" on a long value
# backtracks for minutes and froze a worker. Every regex of a validation runs
# under the `regex` module's timeout; one that takes too long is a validation error.
PATTERN_TIMEOUT_S = 0.1


def _search(pattern: str, text: str) -> bool:
    """re.search, bounded: TimeoutError past PATTERN_TIMEOUT_S."""
    return regex.search(pattern, text, timeout=PATTERN_TIMEOUT_S) is not None


def _too_slow(pattern: str) -> ValidationError:
    ms = int(PATTERN_TIMEOUT_S * 1000)
    return ValidationError(f"checking the pattern {pattern!r} took over {ms} ms: not accepted")


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "string"):
        return
    try:
        if not _search(pattern, instance):
            yield ValidationError(f"{instance!r} does not match {pattern!r}")
    except TimeoutError:
        yield _too_slow(pattern)


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            try:
                matches = _search(pattern, key)
            except TimeoutError:
                yield _too_slow(pattern)
                return
            if matches:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    declared = schema.get("properties", {})
    patterns = "|".join(schema.get("patternProperties", {}))
    extras = []
    for key in instance:
        if key in declared:
            continue
        try:
            if patterns and _search(patterns, key):
                continue
        except TimeoutError:
            yield _too_slow(patterns)
            return
        extras.append(key)
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:  # jsonschema's own messages
        names = ", ".join(repr(k) for k in sorted(extras))
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            regexes = ", ".join(repr(p) for p in sorted(schema["patternProperties"]))
            yield ValidationError(f"{names} {verb} not match any of the regexes: {regexes}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(
                f"Additional properties are not allowed ({names} {verb} unexpected)"
            )


# A schema's $refs may loop (`{"$ref": "#"}`: every reference resolves, so it passes the check
# above) or recurse with arguments nested deep: jsonschema then recurses until Python's own
# limit, where whatever else runs at that depth (a finalizer, a signal handler, a logging
# call) fails too, by chance. A reference followed this close to the limit stops the
# validation instead, always at the same depth, with SchemaTooDeep.
REF_HEADROOM_FRAMES = 200
_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


class SchemaTooDeep(Exception):
    """A validation whose $refs recursed too deep to go on: a schema that refers back to
    itself without descending into the arguments, or arguments nested too deep for it."""


def _near_the_limit() -> bool:
    try:
        sys._getframe(sys.getrecursionlimit() - REF_HEADROOM_FRAMES)
    except ValueError:  # fewer frames than that on this thread's stack
        return False
    return True


def _guarded(follow: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """A reference keyword that is followed only while the stack has room."""

    def checked(validator: Any, ref: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if _near_the_limit():
            raise SchemaTooDeep(
                "its $ref recursion runs too deep to check (a $ref that refers back to "
                "itself without descending into the arguments, or arguments nested too deep)"
            )
        yield from follow(validator, ref, instance, schema)

    return checked


def _bounded(cls: Any) -> Any:
    """`cls` with its regex keywords bounded in time and its references in depth (the others
    are jsonschema's own)."""
    refs = {
        name: _guarded(cls.VALIDATORS[name]) for name in _REF_KEYWORDS if name in cls.VALIDATORS
    }
    return jsonschema.validators.extend(
        cls,
        validators={
            "pattern": _pattern,
            "patternProperties": _pattern_properties,
            "additionalProperties": _additional_properties,
            **refs,
        },
    )


def validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A cached validator for a tool's parameters."""
    return _validator_of(json.dumps(schema, sort_keys=True))


def _refs(
    node: Any, path: str, resolver: Any, root: bool = False
) -> Iterator[tuple[str, str, Any]]:
    """Each `$ref` with its path and the resolver of its base URI (a nested `$id` moves it)."""
    if isinstance(node, dict):
        if not root and isinstance(node.get("$id"), str):
            resolver = resolver.lookup(node["$id"]).resolver
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield path, ref, resolver
        for key, value in node.items():
            if key not in _DATA_KEYWORDS:
                yield from _refs(value, f"{path}.{key}", resolver)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{path}[{i}]", resolver)


def _capped(message: str) -> str:
    if len(message) > MAX_PROBLEM_CHARS:
        return message[: MAX_PROBLEM_CHARS - 3] + "..."
    return message

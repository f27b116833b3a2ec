"""A tool-policy field is declared once (schemas/tool_policy.py): a field added to the
declaration, and nowhere else, is checked at submit, resolved for a call and documented. The
README's table is held to the declaration in test_readme.py."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any

import pytest
from marshmallow import ValidationError

from schemas.fleet import ToolDefaults
from schemas.limits import Limits
from schemas.policy_schema import ToolPolicySchema, policy_schema
from schemas.spec_types import tool_from_json
from schemas.tool_policy import (
    Rule,
    ToolPolicy,
    declarations,
    policy_table,
    resolve,
    tool_references,
)
from tests.test_engine import WEATHER
from worker.session.tool_policy import CallPolicy, call_policy


@dataclass(frozen=True)
class GrownPolicy(ToolPolicy):
    """ToolPolicy with three fields more, written as a new field would be."""

    cooldown_ms: Annotated[
        int | None,
        Rule(
            "wait after a call before the next one",
            bounds=(0, 500),
            raised_by=("background", 5_000),
            session="default_tool_timeout_ms",
            fleet="retry_backoff_ms",
        ),
    ] = None
    tier: Annotated[
        str, Rule("`bronze` or `gold`", choices=("bronze", "gold"), only_with="background")
    ] = "bronze"
    escalate_to: Annotated[str | None, Rule("another tool, asked when", names_tool=True)] = None


def load(raw: dict[str, Any]) -> dict[str, Any] | dict[str, list[str]]:
    try:
        loaded: dict[str, Any] = policy_schema(GrownPolicy)().load(raw)
    except ValidationError as exc:
        return exc.messages  # type: ignore[return-value]
    return loaded


def test_a_field_added_to_the_declaration_is_checked_at_submit() -> None:
    range_said = "Must be between 0 and 500 (up to 5000 with background: true)."
    assert load({"cooldown_ms": 501}) == {"cooldown_ms": [range_said]}
    assert load({"cooldown_ms": 5_001, "background": True}) == {"cooldown_ms": [range_said]}
    assert load({"cooldown_ms": "3"}) == {"cooldown_ms": ["Not a valid integer."]}
    assert load({"cooldown_ms": 5_000, "background": True, "tier": "gold"}) == {
        "cooldown_ms": 5_000,
        "background": True,
        "tier": "gold",
    }
    assert load({"tier": "gold"}) == {"tier": ["Only with background: true."]}
    assert load({"tier": "tin", "background": True}) == {"tier": ["Must be one of: bronze, gold."]}
    assert load({"escalate_to": "no way"}) == {"escalate_to": ["Must name a tool of this session."]}
    assert load({"max_retries": 11}) == {"max_retries": ["Must be between 0 and 10."]}
    assert tool_references(GrownPolicy) == ("fallback", "escalate_to")


def test_a_field_added_to_the_declaration_is_resolved_for_a_call() -> None:
    fleet = ToolDefaults(retry_backoff_ms=70)
    assert resolve(GrownPolicy(), Limits(), fleet)["cooldown_ms"] == 70
    limits = Limits.resolve({"tool_timeout_ms": 300})
    assert resolve(GrownPolicy(), limits, fleet)["cooldown_ms"] == 300
    assert resolve(GrownPolicy(cooldown_ms=9), limits, fleet)["cooldown_ms"] == 9
    assert resolve(GrownPolicy(), limits, fleet)["tier"] == "bronze"
    grown = GrownPolicy.from_json({"cooldown_ms": 9, "colour": "red"})
    assert grown.to_json() == {"cooldown_ms": 9}


def test_a_field_added_to_the_declaration_is_documented() -> None:
    table = policy_table(GrownPolicy)
    assert table.startswith(policy_table().rstrip("\n"))
    assert table.splitlines()[-3:] == [
        "| `cooldown_ms` | `limits.default_tool_timeout_ms`, else the fleet's (200) "
        "| wait after a call before the next one |",
        "| `tier` | `bronze` | `bronze` or `gold` |",
        "| `escalate_to` | none | another tool, asked when |",
    ]


def test_the_call_policy_reads_declared_fields_each_resolved() -> None:
    declared = {d.name: d for d in declarations(ToolPolicy)}
    assert {f.name for f in fields(CallPolicy)} <= declared.keys()
    resolved = call_policy(tool_from_json(WEATHER), Limits(), ToolDefaults())
    for f in fields(CallPolicy):
        assert type(getattr(resolved, f.name)) is declared[f.name].kind, f.name


def test_the_schema_has_a_field_for_each_declared_field() -> None:
    assert list(ToolPolicySchema().fields) == [f.name for f in fields(ToolPolicy)]


@pytest.mark.parametrize(
    ("annotation", "default", "problem"),
    [
        ("int | None", None, "annotate it with one Rule"),
        ("Annotated[float, Rule('x', bounds=(0, 1))]", 0.0, r"an int, bool or str \(or None"),
        ("Annotated[int | None, Rule('x')]", None, "bounds are for an int, and an int needs them"),
        ("Annotated[str | None, Rule('x')]", None, "a str needs choices or names_tool"),
        ("Annotated[str, Rule('x', choices=('a',))]", "b", "its default must be one"),
        ("Annotated[bool, Rule('x', names_tool=True)]", False, "names_tool is for a str"),
        ("Annotated[bool, Rule('x', raised_by=('background', 2))]", False,
         "raised_by is for an int"),
        ("Annotated[str | None, Rule('x', names_tool=True, only_with='risk_level')]", None,
         "risk_level is not a bool field"),
        ("Annotated[int | None, Rule('x', bounds=(0, 1), session='max_tool_calls')]", None,
         "the session has no limit max_tool_calls"),
        ("Annotated[int | None, Rule('x', bounds=(0, 1), fleet='memory')]", None,
         "the fleet has no default memory"),
        ("Annotated[int, Rule('x', bounds=(0, 1), fleet='max_retries')]", 0,
         "needs a None default"),
    ],
)  # fmt: skip
def test_a_declaration_the_derived_views_cannot_read_fails_when_its_schema_is_built(
    annotation: str, default: Any, problem: str
) -> None:
    # built here, in this module, whose names (Annotated, Rule) its annotation is read with
    namespace = {"__annotations__": {"extra": annotation}, "extra": default}
    bad: type[ToolPolicy] = dataclass(frozen=True)(type("BadPolicy", (ToolPolicy,), namespace))
    with pytest.raises(TypeError, match=f"BadPolicy.extra: .*{problem}"):
        policy_schema(bad)

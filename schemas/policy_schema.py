"""The marshmallow schema of a tool policy, built from its declaration (schemas/tool_policy.py):
a field per declared field, and the checks between them."""

from __future__ import annotations

from typing import Any

from marshmallow import Schema, ValidationError, fields, validate, validates_schema

from schemas.strict import FUNCTION_NAME_PATTERN, StrictBool, strict_int
from schemas.tool_policy import Declared, ToolPolicy, declarations, tool_references

TOOL_NAME_PROBLEM = "Must name a tool of this session."


def policy_schema(policy: type[ToolPolicy]) -> type[Schema]:
    """The schema of a policy declaration (schemas.tool_policy): a field per declared field,
    and the checks between them."""
    declared = declarations(policy)
    checks = _flag_checks(declared)

    class PolicySchema(Schema):
        class Meta:
            include = {d.name: _policy_field(d) for d in declared}
            register = False  # made per declaration: a name lookup could not tell them apart

        @validates_schema
        def _check_flags(self, data: dict[str, Any], **kwargs: Any) -> None:
            # one problem per policy object: the first, in declaration order
            for name, flag, cap, problem in checks:
                if name in data and not data.get(flag) and (cap is None or data[name] > cap):
                    raise ValidationError(problem, name)

    PolicySchema.__name__ = PolicySchema.__qualname__ = f"{policy.__name__}Schema"
    return PolicySchema


def _policy_field(d: Declared) -> fields.Field[Any]:
    rule = d.rule
    if rule.bounds is not None:
        least, cap = rule.bounds
        greatest = rule.raised_by[1] if rule.raised_by else cap
        return strict_int(validate=validate.Range(min=least, max=greatest, error=_range(d)))
    if d.kind is bool:
        return StrictBool()
    if rule.choices:
        return fields.String(validate=validate.OneOf(rule.choices))
    return fields.String(validate=validate.Regexp(FUNCTION_NAME_PATTERN, error=TOOL_NAME_PROBLEM))


def _range(d: Declared) -> str:
    assert d.rule.bounds is not None
    least, cap = d.rule.bounds
    if d.rule.raised_by is None:
        return f"Must be between {least} and {cap}."
    flag, raised = d.rule.raised_by
    return f"Must be between {least} and {cap} (up to {raised} with {flag}: true)."


def _flag_checks(declared: tuple[Declared, ...]) -> list[tuple[str, str, int | None, str]]:
    """(field, flag, cap, problem): a given field is a problem while its flag is not true
    (and, with a cap, only past it)."""
    checks: list[tuple[str, str, int | None, str]] = []
    for d in declared:
        if d.rule.raised_by is not None and d.rule.bounds is not None:
            checks.append((d.name, d.rule.raised_by[0], d.rule.bounds[1], _range(d)))
        if d.rule.only_with is not None:
            checks.append((d.name, d.rule.only_with, None, f"Only with {d.rule.only_with}: true."))
    return checks


ToolPolicySchema = policy_schema(ToolPolicy)
TOOL_REFERENCES = tool_references(ToolPolicy)  # policy fields naming another tool

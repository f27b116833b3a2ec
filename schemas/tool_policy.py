"""A tool's execution policy (the README's "Tool calls": Policy), declared once. Each field of
`ToolPolicy` carries a `Rule` in its annotation: how it is checked at submit, where a call's
value comes from when the tool gives none, and its line in the README. Everything else is
derived from those declarations: the marshmallow schema (schemas/policy_schema.py, which the
fast path, the tools files and a program's cchat_write_fn load through), a call's values
(`resolve`, which worker.session.tool_policy.call_policy reads), the tools a session must have
(`tool_references`), and the README's policy table (`policy_table`, checked by
tests/test_tool_policy.py). A new field is one declaration here, plus the code that acts on it."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from types import NoneType, UnionType
from typing import Annotated, Any, Self, get_args, get_origin, get_type_hints

from schemas.fleet import ToolDefaults
from schemas.limits import (
    BACKGROUND_TIMEOUT_CAP_MS,
    MAX_TOOL_RETRIES_CAP,
    RETRY_BACKOFF_CAP_MS,
    TOOL_TIMEOUT_CAP_MS,
    Limits,
)

RISK_LEVELS = ("low", "medium", "high")
BACKGROUND_MODES = ("wait", "async")


@dataclass(frozen=True)
class Rule:
    """One policy field's declaration, beside its type and default."""

    doc: str  # the README table's meaning column
    bounds: tuple[int, int] | None = None  # an int's least and greatest value
    # (a bool field, a higher greatest value when that field is true)
    raised_by: tuple[str, int] | None = None
    choices: tuple[str, ...] = ()  # a str's values
    names_tool: bool = False  # a str naming another tool of the session
    only_with: str | None = None  # a bool field that must be true where this one is given
    # where a call's value comes from when the tool's is None: the session's limit of this
    # name (schemas.limits.Limits), else the fleet's default of this name (ToolDefaults)
    session: str | None = None
    fleet: str | None = None


@dataclass(frozen=True)
class ToolPolicy:
    """How one tool's calls run. None: the session's limits decide, then the fleet's
    defaults (each field's Rule names which)."""

    timeout_ms: Annotated[
        int | None,
        Rule(
            f"one attempt's time, up to {TOOL_TIMEOUT_CAP_MS}",
            bounds=(1, TOOL_TIMEOUT_CAP_MS),
            raised_by=("background", BACKGROUND_TIMEOUT_CAP_MS),
            session="default_tool_timeout_ms",
            fleet="timeout_ms",
        ),
    ] = None
    max_retries: Annotated[
        int | None,
        Rule(
            "attempts after the first, for a `TIMEOUT` or `RUNTIME_ERROR`",
            bounds=(0, MAX_TOOL_RETRIES_CAP),
            session="max_tool_retries",
            fleet="max_retries",
        ),
    ] = None
    retry_backoff_ms: Annotated[
        int | None,
        Rule(
            "wait before the first retry; it doubles with each retry, up to "
            f"{RETRY_BACKOFF_CAP_MS // 1000} s",
            bounds=(0, RETRY_BACKOFF_CAP_MS),
            fleet="retry_backoff_ms",
        ),
    ] = None
    idempotent: Annotated[
        bool,
        Rule(
            "false: retried only when it provably did not run (its module could not load, its "
            "export is missing); WASM tools run with no I/O, hence the default"
        ),
    ] = True
    background: Annotated[
        bool,
        Rule(
            "true: the call runs on the background queue, for up to "
            f"{BACKGROUND_TIMEOUT_CAP_MS // 3_600_000} hours (see Background tools)"
        ),
    ] = False
    background_mode: Annotated[
        str,
        Rule(
            "`wait`: the round waits for the call; `async`: the model gets a task id at once "
            "and asks `task_status`",
            choices=BACKGROUND_MODES,
            only_with="background",
        ),
    ] = "wait"
    risk_level: Annotated[
        str, Rule("`low`, `medium` or `high`: see Permissions", choices=RISK_LEVELS)
    ] = "low"
    fallback: Annotated[
        str | None,
        Rule(
            "another tool of the session, called with the same arguments when the retries "
            "are spent (once; a fallback's own fallback is not followed)",
            names_tool=True,
        ),
    ] = None

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> Self:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (raw or {}).items() if k in names})

    def to_json(self) -> dict[str, Any]:
        """Only what differs from the defaults: most tools store no policy at all."""
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclass(frozen=True)
class Declared:
    """A policy field as its class declares it."""

    name: str
    kind: type  # int, bool or str
    default: Any
    rule: Rule


_DECLARED: dict[type[ToolPolicy], tuple[Declared, ...]] = {}


def declarations(policy: type[ToolPolicy]) -> tuple[Declared, ...]:
    """`policy`'s fields in declaration order, each checked against what the derived views
    support: one they cannot read fails here, when its schema is built at import."""
    found = _DECLARED.get(policy)
    if found is None:
        found = _DECLARED[policy] = _declare(policy)
    return found


def _declare(policy: type[ToolPolicy]) -> tuple[Declared, ...]:
    hints = get_type_hints(policy, include_extras=True)
    out = []
    for f in fields(policy):
        hint = hints[f.name]
        rules = [a for a in get_args(hint)[1:] if isinstance(a, Rule)]
        if get_origin(hint) is not Annotated or len(rules) != 1:
            raise TypeError(f"{policy.__name__}.{f.name}: annotate it with one Rule")
        out.append(Declared(f.name, _kind(policy, f.name, get_args(hint)[0]), f.default, rules[0]))
    declared = tuple(out)
    for d in declared:
        problem = _declaration_problem(d, declared)
        if problem:
            raise TypeError(f"{policy.__name__}.{d.name}: {problem}")
    return declared


def _kind(policy: type[ToolPolicy], name: str, hint: Any) -> type:
    union = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    kinds = [k for k in union if k is not NoneType]
    if len(kinds) != 1 or kinds[0] not in (int, bool, str):
        raise TypeError(f"{policy.__name__}.{name}: an int, bool or str (or None) only")
    kind: type = kinds[0]
    return kind


def _declaration_problem(d: Declared, declared: tuple[Declared, ...]) -> str | None:
    rule, flags = d.rule, {x.name for x in declared if x.kind is bool}
    if (d.kind is int) != (rule.bounds is not None):
        return "bounds are for an int, and an int needs them"
    if d.kind is str and not rule.choices and not rule.names_tool:
        return "a str needs choices or names_tool"
    if rule.choices and (d.kind is not str or d.default not in (None, *rule.choices)):
        return "choices are for a str, and its default must be one"
    if rule.names_tool and d.kind is not str:
        return "names_tool is for a str"
    if rule.raised_by and d.kind is not int:
        return "raised_by is for an int"
    for flag in (rule.raised_by[0] if rule.raised_by else None, rule.only_with):
        if flag is not None and flag not in flags:
            return f"{flag} is not a bool field"
    if rule.session is not None and rule.session not in {f.name for f in fields(Limits)}:
        return f"the session has no limit {rule.session}"
    if rule.fleet is not None and rule.fleet not in {f.name for f in fields(ToolDefaults)}:
        return f"the fleet has no default {rule.fleet}"
    if (rule.session or rule.fleet) and d.default is not None:
        return "a value from the session or the fleet needs a None default"
    return None


def resolve(policy: ToolPolicy, limits: Limits, fleet: ToolDefaults) -> dict[str, Any]:
    """Every field's value for a call: the tool's own, else the session's limit, else the
    fleet's default."""
    out = {}
    for d in declarations(type(policy)):
        value = getattr(policy, d.name)
        if value is None and d.rule.session is not None:
            value = getattr(limits, d.rule.session)
        if value is None and d.rule.fleet is not None:
            value = getattr(fleet, d.rule.fleet)
        out[d.name] = value
    return out


def tool_references(policy: type[ToolPolicy] = ToolPolicy) -> tuple[str, ...]:
    """The fields naming another tool of the session: a name no tool has is refused."""
    return tuple(d.name for d in declarations(policy) if d.rule.names_tool)


def policy_table(policy: type[ToolPolicy] = ToolPolicy) -> str:
    """The README's table of policy fields."""
    rows = ["| policy field | default | meaning |", "|---|---|---|"]
    for d in declarations(policy):
        rows.append(f"| `{d.name}` | {_default_said(d)} | {d.rule.doc} |")
    return "\n".join(rows) + "\n"


def _default_said(d: Declared) -> str:
    said = [f"`limits.{d.rule.session}`"] if d.rule.session else []
    if d.rule.fleet:
        said.append(f"the fleet's ({_shown(getattr(ToolDefaults(), d.rule.fleet))})")
    return ", else ".join(said) or _shown(d.default)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    return f"`{value}`" if isinstance(value, str) else json.dumps(value)
